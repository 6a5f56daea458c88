"""The sized decode cache (``decode.SIZED_CACHE``) changes where the K/V lives, never what the decode computes.

Same batches and settings as test_decode_sized (TRL's shape: shuffled groups, left-padded prompts, rows ending at
many different steps; windows of 4 slots on the CPU path, a host check every 2 steps, so the cache moves into new
storage at windows and at narrowings, several times each). Checked here:

- log-probs: a decode step's distribution equals a plain forward's over the prompt and the tokens before it, for
  every row up to its end, on a model sharp enough that a wrong position or slot moves them far (negative controls:
  positions off by one, a move that leaves the last written slot behind);
- a step only ever runs on the cache's current storage, and once the cache has moved nothing holds the old one (on a
  GPU a step's CUDA graph replays on the addresses it was captured on: a step made before a move must never run
  after it, and the old storage must go back to the allocator); negative controls: a move that keeps the views (or
  the steps) made on the old storage;
- compiled, the tokens are ``generate``'s and one compilation of the step serves every window and width.
"""

from __future__ import annotations

import weakref

import pytest
import torch

import test_decode_compact
from test_decode_compact import _batch, _config, _lengths, _ragged_eos, _run, prompt_map_kernel, scores_only_sampling
from vlm_grpo.fastpath import decode, decode_cache, decode_compact
from vlm_grpo.modules import get_vlm_module
from vlm_grpo.testing.tiny import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-5  # fp32 log-prob gaps between the decode and a plain forward: <= 5e-6 measured
SHARP_STD = 0.15  # the LM's init std: a position off by one moves log-probs by ~4 (test_generation_parity's model)


@pytest.fixture
def sized(monkeypatch):
    monkeypatch.setattr(decode, "_CHECK_EVERY", 2)
    monkeypatch.setattr(decode_compact, "COMPACT", True)
    monkeypatch.setattr(decode, "ATTENTION_WINDOW", 4)
    monkeypatch.setattr(decode, "_WINDOWS_WITHOUT_GRAPH", True)
    monkeypatch.setattr(decode, "SIZED_CACHE", True)


@pytest.fixture(scope="module")
def sharp(tmp_path_factory):
    path = str(build_tiny_model("qwen2_5_vl", tmp_path_factory.mktemp("sharp"), seed=0, init_std=SHARP_STD))
    return get_vlm_module(path).load_model(path, dtype=torch.float32, attn_implementation="sdpa").eval()


def _decode_log_probs(model, config, batch, monkeypatch):
    """(fast_decode's tokens, generate's, the decode's log-softmax per batch row and step (rows, steps, vocab)).

    Each step's logits are taken as the selection gets them, in the workspace's row order, which each compaction
    changes (``ws.order``, recorded after it)."""
    logits, orders = [], {}
    real_call, real_compact = decode._Step.__call__, decode_compact.compact

    def call(step, *args):
        out = real_call(step, *args)
        logits.append(out.detach().clone())
        return out

    def compact(ws, width, new, *args):
        real_compact(ws, width, new, *args)
        orders[len(logits)] = ws.order[:new].clone()

    monkeypatch.setattr(decode._Step, "__call__", call)
    monkeypatch.setattr(decode_compact, "compact", compact)
    ours, plain, _ = _run(model, config, batch)
    monkeypatch.setattr(decode._Step, "__call__", real_call)
    steps = decode_compact.last_stats.steps
    out = torch.full((len(ours), steps, logits[0].size(-1)), float("nan"))
    order = torch.arange(len(ours))
    for t, step_logits in enumerate(logits[:steps]):
        order = orders.get(t, order)
        out[order[: step_logits.size(0)], t] = step_logits
    return ours, plain, torch.log_softmax(out, dim=-1)


def _forward_log_probs(model, batch, tokens: list[list[int]], lengths: list[int]) -> torch.Tensor:
    """A plain forward over each row's prompt (left-padded) and tokens, the tokens past its end masked out: the
    log-softmax that predicts each token (rows, steps, vocab)."""
    ids, mask, index = batch
    completion = torch.tensor(tokens)
    ended = (torch.arange(completion.size(1))[None] < torch.tensor(lengths)[:, None]).long()
    with torch.no_grad():
        logits = model(
            input_ids=torch.cat([ids[index], completion], 1), attention_mask=torch.cat([mask[index], ended], 1)
        ).logits
    start = ids.size(1) - 1
    return torch.log_softmax(logits[:, start : start + completion.size(1)].float(), dim=-1)


@pytest.mark.parametrize("broken", [None, "positions_off_by_one", "last_slot_left_behind"])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_log_probs_equal_a_plain_forwards(sample, broken, sharp, sized, monkeypatch):
    """Every row's steps up to its end: the sized decode's log-probs are a plain forward's over its own tokens
    (within 1e-5), and its tokens generate's. Controls: the decode's positions one off, or each move copying one
    written slot fewer (that slot's K/V left as zeros), must fail by a wide margin."""
    batch = _batch()
    eos = _ragged_eos(sharp, sample, batch)
    config = _config(sharp, sample, eos)
    if broken == "positions_off_by_one":
        real_next = test_decode_compact._next_positions
        monkeypatch.setattr(test_decode_compact, "_next_positions", lambda *a: real_next(*a) + 1)
    elif broken == "last_slot_left_behind":
        real_resize = decode.resize
        monkeypatch.setattr(decode, "resize", lambda cache, rows, slots, written, **kw: real_resize(
            cache, rows, slots, written - 1, **kw))  # fmt: skip
    ours, plain, logps = _decode_log_probs(sharp, config, batch, monkeypatch)
    lengths = _lengths(ours, eos)
    reference = _forward_log_probs(sharp, batch, ours, lengths)
    gap = max(float((logps[r, :n] - reference[r, :n]).abs().max()) for r, n in enumerate(lengths))
    stats = decode_compact.last_stats
    if broken is None:
        assert len(stats.widths) >= 2 and len(stats.allocations) >= 5, (stats.widths, stats.allocations)
        assert len(set(lengths)) >= 4, lengths  # rows end far apart
        assert ours == plain and gap <= TOL, gap
    else:
        assert gap > 1000 * TOL, gap


class _Kept(dict):
    """A dict whose ``clear`` keeps everything (a move that leaves what was made on the old storage in place)."""

    def clear(self) -> None:
        pass


@pytest.mark.parametrize("kept", [None, "views", "steps"], ids=["fresh", "control_views_kept", "control_steps_kept"])
def test_steps_run_only_on_the_current_storage(kept, sized, tiny_models, monkeypatch):
    """At every step call: the step's cache is the workspace cache's current storage (the K/V of every layer, one
    write position), its fed tokens, positions and mask are the workspace's own buffers (a move reallocates none of
    them), and no tensor of a storage the cache has moved out of is still alive. Controls: a move that keeps the
    views of the old storage (a narrowed step then runs on it), or the steps made on it (they keep it alive)."""
    from test_decode_speed import _tiny_qwen

    model = _tiny_qwen(tiny_models)
    real_workspace, real_resize, real_call = decode._workspace, decode.resize, decode._Step.__call__
    made, old, problems = [], [], []

    def workspace(*args, **kwargs):
        ws = real_workspace(*args, **kwargs)
        if kept is not None:
            setattr(ws, kept, _Kept())
        made.append(ws)
        return ws

    def resize(cache, *args, **kwargs):
        old.extend(weakref.ref(x) for layer in cache.layers for x in (layer.keys, layer.values))
        return real_resize(cache, *args, **kwargs)

    def same(x, y) -> bool:
        return x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()

    def call(step, *args):
        ws = made[-1]
        for mine, now in zip(step.cache.layers, ws.cache.layers, strict=True):
            if not (same(mine.keys, now.keys) and same(mine.values, now.values)):
                problems.append("a step ran on storage the cache has moved out of")
            if mine.cumulative_length is not now.cumulative_length:
                problems.append("a step writes at another position than the cache's")
        if not all(same(x, y) for x, y in ((step.tokens, ws.tokens), (step.positions, ws.positions),
                                           (step.mask, ws.mask))):  # fmt: skip
            problems.append("a step reads buffers that are not the workspace's")
        if any(ref() is not None for ref in old):
            problems.append("a storage the cache moved out of is alive")
        return real_call(step, *args)

    monkeypatch.setattr(decode, "_workspace", workspace)
    monkeypatch.setattr(decode, "resize", resize)
    monkeypatch.setattr(decode._Step, "__call__", call)
    batch = _batch()
    eos = _ragged_eos(model, False, batch)
    try:
        ours, plain, _ = _run(model, _config(model, False, eos), batch)
    except Exception as error:  # a stale view can also run past its storage's slots
        problems.append(repr(error))
        ours, plain = None, None
    if kept is not None:  # kept views: a narrowed step runs on the old storage; kept steps: they hold it
        caught = "a step ran on storage the cache has moved out of" if kept == "views" else "is alive"
        assert any(caught in p for p in problems), problems
        return
    stats = decode_compact.last_stats
    moves_after_narrowing = stats.allocations[[r for r, _ in stats.allocations].index(stats.widths[1]) + 1 :]
    assert len(stats.widths) >= 3 and moves_after_narrowing, stats.allocations  # windows grow at narrower widths
    assert not problems and ours == plain, problems


@pytest.mark.parametrize("marked", [True, False], ids=["slots_dynamic", "control_unmarked"])
def test_a_compiled_sized_decode_compiles_once(marked, sized, tiny_models, monkeypatch):
    """Compiled, with the selection in the step: generate's sampled tokens, and one compilation of the step (plus the
    selection's two) for every storage the cache moves into, windows and widths. The cache's slots are marked dynamic
    from its first storage on; unmarked (control), the first move recompiles the step."""
    from torch._dynamo.utils import counters

    from test_decode_speed import _tiny_qwen

    model = _tiny_qwen(tiny_models)
    monkeypatch.setattr(decode, "_SELECT_IN_STEP_WITHOUT_GRAPH", True)  # the selection a CUDA graph captures
    if not marked:
        real_resize, real_mark = decode_cache.resize, torch._dynamo.maybe_mark_dynamic

        def mark(x, dim):  # the rows stay marked (decode_compact.rows_dynamic), the slots do not
            if not (dim == 2 and x.dim() == 4):
                real_mark(x, dim)

        monkeypatch.setattr(torch._dynamo, "maybe_mark_dynamic", mark)
        monkeypatch.setattr(decode, "resize", lambda *a, **kw: real_resize(*a, **{**kw, "dynamic": False}))
    monkeypatch.setattr(decode, "_compiled_forward", None)
    monkeypatch.setattr(torch.compiler.config, "job_id", None)  # a cold process's counts (no saved dynamic profile)
    torch._dynamo.reset()
    batch, config = scores_only_sampling(model)
    counters.clear()
    ours, plain, same_sampler = _run(model, config, batch, compile=True)
    stats = decode_compact.last_stats
    assert ours == plain and same_sampler
    assert len(stats.widths) >= 3 and len({slots for _, slots in stats.allocations}) >= 4, stats.allocations
    graphs = counters["stats"]["unique_graphs"]
    assert (graphs == 3) == marked, graphs


@pytest.mark.parametrize("updated", [True, False], ids=["first_rows_updated", "control_stale_first_rows"])
def test_rows_read_their_prompt_from_a_first_row_of_the_moved_cache(updated, sized, tiny_models, monkeypatch):
    """The GPU's decode kernel reads a row's prompt slots from the first row of its prompt (``shared``); after a
    compaction the cache holds the live rows only, and that row must be one of them. A stand-in kernel that reads the
    prompt slots there keeps generate's tokens; the control, a compaction that leaves the map as it was, must not."""
    from test_decode_speed import _tiny_qwen

    prompt_map_kernel(monkeypatch, updated)  # its kernel asserts the source rows are rows of the (moved) cache
    model = _tiny_qwen(tiny_models)
    batch = _batch()
    eos = _ragged_eos(model, False, batch)
    try:
        ours, plain, _ = _run(model, _config(model, False, eos), batch)
    except (AssertionError, IndexError):  # the control: a source row past the moved cache's rows
        assert not updated
        return
    assert len(decode_compact.last_stats.widths) >= 3
    assert (ours == plain) == updated
