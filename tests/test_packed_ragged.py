"""The packed log-prob pass at each rollout's real length: every block is its own completion + 1, not the batch's
longest + 1.

Batches come from TRL (``_generate_and_score_completions`` on the two-prompt dataset of ``test_group_sharing``), then
get completions of very different lengths (the full width, one token, none at all as ``mask_truncated_completions``
leaves a row, and lengths between) and are shuffled as TRL shuffles them before the loss. Every attention path of
the packed pass is held against TRL's per-row pass at 1e-5: eager and sdpa with the dense block mask, the per-group
block kernel (CPU), and the varlen call (its CPU stand-in), where the groups of a pass share one packed row.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from trl import GRPOTrainer

import test_group_sharing
import test_multiturn_sharing
import vlm_grpo.fastpath.sharing as sharing
import vlm_grpo.fastpath.varlen as varlen
from test_group_sharing import MM_KEYS, G, interleaved, make_trainer
from vlm_grpo.fastpath.block_attention import PackedGroup, PackedLayout
from vlm_grpo.fastpath.pack_plan import build_mask, chunk_groups
from vlm_grpo.trainer import VLMGRPOTrainer, rows_forward_kwargs

rows_file = test_group_sharing.rows_file  # the fixture: two prompts, one and two images
textured_rows, batches = test_multiturn_sharing.textured_rows, test_multiturn_sharing.batches  # tool rollouts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CORE = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl")
WIDTH = 20
# Completion length per row, in the order TRL generates them (G=3 rows per prompt): within each group the longest,
# the shortest and one between; one row has no token the loss sees (a truncated row under mask_truncated_completions).
LENGTHS = (WIDTH, 1, 0, 9, 3, 14)
MODES = {
    "eager": {"attn": "eager"},
    "dense": {"packed_attention": "dense"},
    "blocks": {},  # the per-group block kernel: no varlen kernel on CPU
    "varlen": {"varlen": True},  # the varlen call (CPU stand-in); the groups share one packed row
}


def trainer_for(family, mode, tiny_models, rows_file, tmp_path, monkeypatch, **overrides):
    options = dict(MODES[mode])
    if options.pop("varlen", False):
        monkeypatch.setattr(varlen, "CPU_STAND_IN", varlen.varlen_reference)
    return make_trainer(tiny_models[family], rows_file, tmp_path, max_completion_length=WIDTH, **options, **overrides)


def ragged_batch(trainer, lengths=LENGTHS):
    """TRL's batch with rows cut to ``lengths`` (right padding, as TRL pads), shuffled so that groups interleave;
    advantages and old log-probs that make every row count in the loss."""
    trainer.model.eval()
    inputs = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    assert inputs["completion_ids"].size(1) == WIDTH and bool(inputs["completion_mask"].all()), "no early EOS"
    pad = trainer._tokenizer.pad_token_id
    for row, keep in enumerate(lengths):
        inputs["completion_mask"][row, keep:] = 0
        inputs["completion_ids"][row, keep:] = pad
    torch.manual_seed(1)
    inputs["advantages"] = torch.randn(len(lengths))
    return interleaved(inputs)


def per_token(trainer, inputs, trl: bool, batch_size=None):
    """(log-probs, entropies) in TRL's (rows, C) layout, from TRL's per-row pass or the packed one (``batch_size``:
    as TRL's old / reference passes give it)."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    mm = {k: inputs.get(k) for k in MM_KEYS}
    method = GRPOTrainer if trl else VLMGRPOTrainer
    scope = rows_forward_kwargs(trainer.model, trainer.vlm_module, mm) if trl else contextlib.nullcontext()
    with scope, torch.no_grad():
        logps, entropies, _ = method._get_per_token_logps_and_entropies(
            trainer, trainer.model, input_ids, mask, inputs["completion_ids"].size(1), batch_size, True, **mm
        )
    return logps, entropies


def loss_and_grads(trainer, inputs, **switches):
    """A training step's loss and gradients with config ``switches`` set for it (e.g. ``share_prompt=False``: TRL's
    per-row pass instead of the packed one); the config is restored after."""
    before = {name: getattr(trainer.args, name) for name in switches}
    for name, value in switches.items():
        setattr(trainer.args, name, value)
    try:
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
    finally:
        for name, value in before.items():
            setattr(trainer.args, name, value)
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_step_parity(trainer, inputs, tol=1e-5):
    """Log-probs and entropies over the whole (rows, C) layout (zeros where TRL's mask is 0), then the loss and
    gradients of a training step with old log-probs off the current ones (the importance ratio reads every column)."""
    ref_logps, ref_entropies = per_token(trainer, inputs, trl=True)
    logps, entropies = per_token(trainer, inputs, trl=False)
    torch.testing.assert_close(logps, ref_logps, rtol=0, atol=tol)
    torch.testing.assert_close(entropies, ref_entropies, rtol=0, atol=tol)
    noise = torch.randn(ref_logps.shape, generator=torch.Generator().manual_seed(2))
    inputs = {**inputs, "old_per_token_logps": (ref_logps + 0.1 * noise) * inputs["completion_mask"]}
    ref_loss, ref_grads = loss_and_grads(trainer, inputs, share_prompt=False)
    loss, grads = loss_and_grads(trainer, inputs, share_prompt=True)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=tol)
    assert grads.keys() == ref_grads.keys() and grads
    for name, g in ref_grads.items():
        if g.norm() < 1e-6 and grads[name].norm() < 1e-6:
            continue  # zero up to rounding
        rel = (grads[name] - g).norm() / g.norm()
        assert rel <= tol, f"{name}: relative L2 {rel:.2e}"


def expected_pass(inputs, multiple=1):
    """(tokens, rows of the longest group) of the packed pass, counted from the batch: each distinct prompt once
    but its last token, then per row its real completion length + 1 (rounded up to ``multiple``, at most C + 1)."""
    width = inputs["completion_ids"].size(1)
    groups: dict[tuple, int] = {}
    for ids, pmask, cmask in zip(inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_mask"], strict=True):
        key = tuple(ids[pmask.bool()].tolist())
        real = max((i + 1 for i, m in enumerate(cmask.tolist()) if m), default=0)
        groups[key] = groups.get(key, len(key) - 1) + min(math.ceil((real + 1) / multiple) * multiple, width + 1)
    return sum(groups.values()), max(groups.values())


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", CORE)
def test_packed_pass_matches_trl_on_rollouts_of_very_different_lengths(family, mode, tiny_models, rows_file, tmp_path,
                                                                       monkeypatch):  # fmt: skip
    trainer = trainer_for(family, mode, tiny_models, rows_file, tmp_path, monkeypatch)
    inputs = ragged_batch(trainer)
    assert_step_parity(trainer, inputs)


@pytest.mark.parametrize("mode", ["blocks", "varlen"])
def test_each_block_is_its_rows_real_length_and_the_model_runs_nothing_else(mode, tiny_models, rows_file, tmp_path,
                                                                            monkeypatch):  # fmt: skip
    """The decoder's input holds each distinct prompt once and each row's own completion + 1: far fewer tokens than
    the batch's longest completion per row. With the varlen kernel the two groups share one row (no padding)."""
    trainer = trainer_for("qwen2_5_vl", mode, tiny_models, rows_file, tmp_path, monkeypatch)
    inputs = ragged_batch(trainer)
    tokens, longest_group = expected_pass(inputs)
    prompts = {tuple(i[m.bool()].tolist()) for i, m in zip(inputs["prompt_ids"], inputs["prompt_mask"], strict=True)}
    uniform = sum(len(p) - 1 for p in prompts) + len(LENGTHS) * (WIDTH + 1)
    assert tokens < 0.7 * uniform, (tokens, uniform)
    decoded = []
    hook = trainer.model.get_decoder().register_forward_hook(
        lambda m, args, kwargs, out: decoded.append(tuple(kwargs["inputs_embeds"].shape[:2])), with_kwargs=True
    )
    try:
        per_token(trainer, inputs, trl=False)
    finally:
        hook.remove()
    record = trainer.last_packed_pass
    assert (record.tokens, record.forwards, record.rows, record.width) == (tokens, 1, len(LENGTHS), WIDTH)
    if mode == "varlen":
        assert decoded == [(1, tokens)] and record.slots == tokens
    else:
        assert decoded == [(2, longest_group)] and record.slots == 2 * longest_group


def test_blocks_rounded_up_to_a_multiple_keep_parity_and_are_counted(tiny_models, rows_file, tmp_path, monkeypatch):
    monkeypatch.setattr(sharing, "BLOCK_MULTIPLE", 8)
    trainer = trainer_for("internvl", "varlen", tiny_models, rows_file, tmp_path, monkeypatch)
    inputs = ragged_batch(trainer)
    assert_step_parity(trainer, inputs)
    assert trainer.last_packed_pass.tokens == expected_pass(inputs, multiple=8)[0] != expected_pass(inputs)[0]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "internvl"])
def test_the_parity_test_catches_a_block_one_token_short(family, tiny_models, rows_file, tmp_path, monkeypatch):
    """Control: blocks one token short of the row's last scored token (its log-prob left at zero) fail parity."""
    trainer = trainer_for(family, "varlen", tiny_models, rows_file, tmp_path, monkeypatch)
    inputs = ragged_batch(trainer)
    real = sharing.block_lengths
    monkeypatch.setattr(sharing, "block_lengths", lambda *a: [max(1, n - 1) for n in real(*a)])
    with pytest.raises(AssertionError, match="not close"):
        assert_step_parity(trainer, inputs)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "internvl"])
def test_the_parity_test_catches_positions_run_on_through_the_pack(family, tiny_models, rows_file, tmp_path,
                                                                   monkeypatch):  # fmt: skip
    """Control: positions counted on through the pack (each block not continuing from its prompt) fail parity."""
    trainer = trainer_for(family, "blocks", tiny_models, rows_file, tmp_path, monkeypatch)
    inputs = ragged_batch(trainer)
    module = type(trainer.vlm_module)
    real = module.packed_position_ids

    def run_on(self, model, group, mm, completions):
        positions = real(self, model, group, mm, completions)
        return positions[..., :1] + torch.arange(positions.size(-1))

    monkeypatch.setattr(module, "packed_position_ids", run_on)
    with pytest.raises(AssertionError, match="not close"):
        assert_step_parity(trainer, inputs)


def test_block_lengths_reach_the_last_scored_token_or_image_placeholder():
    """Independently of the pass: through the last unmasked token or image placeholder, + 1; one token for a row
    with neither; rounding never past C + 1."""
    ids = torch.tensor([[5, 6, 7, 0, 0, 0], [5, 9, 9, 6, 0, 0], [9, 9, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    assert sharing.block_lengths(ids, mask, None) == [4, 1, 1, 7]
    assert sharing.block_lengths(ids, mask, 9) == [4, 4, 3, 7]
    assert sharing.block_lengths(ids, mask, 9, multiple=4) == [4, 4, 4, 7]


@pytest.mark.parametrize(("family", "truncated"), [("qwen2_5_vl", False), ("internvl", True)])
def test_multi_turn_rows_in_one_packed_row_match_trl(family, truncated, batches, monkeypatch):
    """Tool rollouts (tool images in the completions, mrope continued per rollout) with the groups in one packed
    row. ``truncated``: a rollout with two tool images has nothing scored (``mask_truncated_completions``); its block
    still holds its images' placeholders (TRL's Qwen pass cannot take such a row: its rope index drops the masked
    placeholders). Control: a block that stops at the last scored token leaves the images without placeholders."""
    trainer, batch = batches(family)
    monkeypatch.setattr(varlen, "CPU_STAND_IN", varlen.varlen_reference)
    if truncated:
        _, tool_images = test_multiturn_sharing.images_per_row(trainer, family, batch)
        batch = {**batch, "completion_mask": batch["completion_mask"].clone()}
        batch["completion_mask"][tool_images.index(2)] = 0
    test_group_sharing.assert_parity(trainer, batch)
    record = trainer.last_packed_pass
    assert record.forwards == 1 and record.slots == record.tokens
    assert (record.tokens > expected_pass(batch)[0]) == truncated  # the truncated block reaches its placeholders
    if truncated:
        real = sharing.block_lengths
        monkeypatch.setattr(sharing, "block_lengths", lambda ids, mask, token, multiple: real(ids, mask, None))
        with pytest.raises(ValueError, match=r"[Ii]mage features and image tokens do not match"):
            test_group_sharing.assert_parity(trainer, batch)


@pytest.mark.parametrize(
    ("budget", "forwards"),
    [(None, 2), ("both", 1), ("one_short", 2)],
    ids=["trl_rows", "both_groups_fit", "one_token_short"],
)
def test_old_and_reference_passes_chunk_by_packed_tokens_when_asked(budget, forwards, tiny_models, rows_file,
                                                                    tmp_path, monkeypatch):  # fmt: skip
    """TRL's old / reference passes give batch_size = per_device_train_batch_size rows (here G: one group per
    forward). packed_chunk_tokens packs whole groups up to that many packed tokens instead: at exactly both groups'
    tokens one forward, one token less two; the numbers are TRL's either way."""
    trainer = trainer_for("qwen2_5_vl", "varlen", tiny_models, rows_file, tmp_path, monkeypatch)
    inputs = ragged_batch(trainer)
    tokens = expected_pass(inputs)[0]
    trainer.args.packed_chunk_tokens = {None: None, "both": tokens, "one_short": tokens - 1}[budget]
    ref, _ = per_token(trainer, inputs, trl=True, batch_size=G)
    ours, _ = per_token(trainer, inputs, trl=False, batch_size=G)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    assert (trainer.last_packed_pass.forwards, trainer.last_packed_pass.tokens) == (forwards, tokens)


def test_chunks_hold_whole_groups_up_to_their_bound():
    from types import SimpleNamespace

    def group(prompt, rows):
        return SimpleNamespace(prompt=torch.zeros(prompt), rows=rows)

    groups = [group(5, [0, 1]), group(3, [2, 3, 4]), group(2, [5])]
    lengths = [10, 1, 4, 4, 4, 30]  # group tokens: 4 + 11 = 15, 2 + 12 = 14, 1 + 30 = 31

    def sizes(chunks):
        return [[len(g.rows) for g in chunk] for chunk in chunks]

    assert sizes(chunk_groups(groups, lengths, None, None)) == [[2, 3, 1]]  # the training pass: one forward
    assert sizes(chunk_groups(groups, lengths, 5, None)) == [[2, 3], [1]]  # TRL's rows
    assert sizes(chunk_groups(groups, lengths, 4, None)) == [[2], [3, 1]]
    assert sizes(chunk_groups(groups, lengths, 5, 29)) == [[2, 3], [1]]  # tokens instead of rows: 15 + 14 = 29
    assert sizes(chunk_groups(groups, lengths, 5, 28)) == [[2], [3], [1]]
    assert sizes(chunk_groups(groups, lengths, 1, 60)) == [[2, 3, 1]]
    assert sizes(chunk_groups(groups, lengths, 1, 10)) == [[2], [3], [1]]  # a group over the bound: its own forward


def test_packed_chunk_tokens_must_be_positive(tmp_path):
    from vlm_grpo.configs import VLMGRPOConfig

    with pytest.raises(ValueError, match="packed_chunk_tokens=0: give a positive number"):
        VLMGRPOConfig(output_dir=str(tmp_path), packed_chunk_tokens=0)
    assert VLMGRPOConfig(output_dir=str(tmp_path)).packed_chunk_tokens is None


@pytest.mark.parametrize("stand_in", [True, False], ids=["varlen", "no_varlen"])
def test_rows_that_share_no_prompt_are_packed_only_where_that_drops_padding(stand_in, tiny_models, rows_file,
                                                                             tmp_path, monkeypatch):  # fmt: skip
    """A micro-batch of rows from different groups (TRL shuffles before cutting micro-batches of 4 from groups of
    5): with the varlen kernel each row is its own group in one packed row, prompt + its own completion, at TRL's
    numbers; without it (nothing to gain) the pass is TRL's own."""
    trainer = trainer_for("qwen2_5_vl", "varlen" if stand_in else "blocks", tiny_models, rows_file, tmp_path,
                          monkeypatch)  # fmt: skip
    inputs = micro_batch_of_two_prompts(ragged_batch(trainer))
    packed = []
    real = sharing._packed_forward
    monkeypatch.setattr(sharing, "_packed_forward", lambda *a: packed.append(1) or real(*a))
    ref, _ = per_token(trainer, inputs, trl=True)
    ours, _ = per_token(trainer, inputs, trl=False)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    assert packed == ([1] if stand_in else [])
    if stand_in:
        assert trainer.last_packed_pass.tokens == trainer.last_packed_pass.slots == expected_pass(inputs)[0]


def micro_batch_of_two_prompts(inputs):
    """A micro-batch of 2 rows, cut as TRL cuts them after its shuffle, whose rows have different prompts."""
    from trl.trainer.utils import (
        shuffle_sequence_dict,
        split_pixel_values_by_grid,
        split_tensor_dict,
        unsplit_pixel_values_by_grid,
    )

    for seed in range(100):
        torch.manual_seed(seed)
        for batch in split_tensor_dict(shuffle_sequence_dict(split_pixel_values_by_grid(inputs)), 3):
            if batch["prompt_mask"].sum(1).unique().numel() == 2:
                return unsplit_pixel_values_by_grid(batch)
    raise AssertionError("no micro-batch of two prompts")


RAGGED = PackedLayout(
    ((PackedGroup(5, (3, 1, 6)), PackedGroup(0, (2,))), (PackedGroup(3, (4, 2)), PackedGroup(2, (1, 1))))
)
RAGGED_TOTAL = 5 + 10 + 2 + 2  # row 0: its groups, then 2 padding tokens; row 1: 9 + 4 tokens, then 6


def _attention_and_grads(fn, layout):
    """Outputs at every prefix / block token (padding is read by nothing) and q / k / v gradients of their sum."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn((2, 4, RAGGED_TOTAL, 8), generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn((2, 2, RAGGED_TOTAL, 8), generator=g, dtype=torch.float64, requires_grad=True) for _ in "kv")
    read = torch.zeros(2, RAGGED_TOTAL, 1, 1, dtype=torch.float64)
    for row, groups in enumerate(layout.rows):
        read[row, : sum(x.length for x in groups)] = 1
    out = fn(q, k, v) * read
    (out * torch.randn(out.shape, generator=g, dtype=out.dtype)).sum().backward()
    return out.detach(), [x.grad for x in (q, k, v)]


def _mask(layout):
    """(rows, 1, total, total), built token by token: a token sees earlier tokens of its own group's prefix and of its
    own block (a prefix token: of the prefix); padding sees itself."""
    masks = []
    for groups in layout.rows:
        ids = []  # per token: (group, block), block -1 in a prefix
        for g, group in enumerate(groups):
            ids += [(g, -1)] * group.prefix + [(g, b) for b, n in enumerate(group.blocks) for _ in range(n)]
        ids += [(None, None)] * (RAGGED_TOTAL - len(ids))
        mask = torch.eye(RAGGED_TOTAL, dtype=torch.bool)
        for i, (qg, qb) in enumerate(ids):
            for j, (kg, kb) in enumerate(ids[: i + 1]):
                mask[i, j] |= qg is not None and qg == kg and kb in (-1, qb)
        masks.append(mask)
    return torch.stack(masks)[:, None]


def _dense_reference(layout):
    """sdpa with a dense mask per packed row, as (rows, total, heads, dim)."""

    def attend(q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=_mask(layout), enable_gqa=True)
        return out.transpose(1, 2)

    return attend


def test_the_dense_block_mask_is_built_as_the_layout_says():
    """The eager / ``packed_attention=dense`` path's mask, against the token-by-token one (boolean and additive)."""
    mask = torch.cat([build_mask(row, RAGGED_TOTAL, None, "cpu") for row in RAGGED.rows])
    assert torch.equal(mask, _mask(RAGGED))
    additive = build_mask(RAGGED.rows[0], RAGGED_TOTAL, torch.float32, "cpu")
    assert torch.equal(additive == 0, _mask(RAGGED)[:1])


@pytest.mark.parametrize("kernel", ["per_group", "varlen"])
def test_ragged_blocks_and_groups_sharing_a_row_attend_as_the_dense_mask_says(kernel):
    """Blocks of different lengths, several groups (one without a prefix) per packed row: the per-group calls and
    the varlen call (its CPU stand-in) give the dense mask's outputs and gradients. Control: the same tokens cut into
    other blocks differ."""
    import vlm_grpo.fastpath.block_attention as ba

    if kernel == "varlen":
        plan = ba.VarlenLayout(RAGGED, RAGGED_TOTAL, varlen.varlen_reference, torch.device("cpu"))

        def ours(q, k, v):
            return ba._varlen_sdpa(q, k, v, plan, None)
    else:

        def ours(q, k, v):
            return ba._packed_sdpa(q, k, v, RAGGED, 0.0, None)

    out, grads = _attention_and_grads(ours, RAGGED)
    ref, ref_grads = _attention_and_grads(_dense_reference(RAGGED), RAGGED)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for mine, theirs in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-12)
    other = PackedLayout(((PackedGroup(5, (4, 1, 5)), PackedGroup(0, (2,))), RAGGED.rows[1]))
    assert not torch.allclose(_attention_and_grads(_dense_reference(other), other)[0], ref)
