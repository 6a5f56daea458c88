"""The shared prefill and fast decode against TRL's ``generate``: greedy and sampled tokens, EOS, compiled steps.

The same batch, the same RNG state for both paths (``_generate_both``); helpers and the two-row file come from
``test_group_sharing.py``.
"""

from __future__ import annotations

import json

import pytest
import torch

import test_group_sharing
from test_group_sharing import _generate_both, assert_samples_like_generate, make_trainer
from vlm_grpo.testing.tiny import FAMILIES

rows_file = test_group_sharing.rows_file  # the fixture: two rows, one and two images


@pytest.mark.parametrize("fast", [True, False], ids=["fast_decode", "generate"])
@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prefill_generation_gives_the_same_greedy_tokens(family, fast, tiny_models, rows_file, tmp_path,
                                                                monkeypatch):  # fmt: skip
    trainer = make_trainer(tiny_models[family], rows_file, tmp_path)
    trainer.args.fast_decode = fast
    trainer.generation_config.do_sample = False
    trainer.generation_config.min_new_tokens = trainer.generation_config.max_new_tokens  # no early stop
    trainer.generation_config.repetition_penalty = 5.0  # tiny random models repeat one token otherwise
    calls = []
    handle = trainer.vlm_module  # count prefill work through the vision tower
    tower = dict(trainer.model.named_modules())[handle.vision_prefixes[0]]
    hook = tower.register_forward_hook(lambda m, a, o: calls.append(1))
    try:
        ours, plain, used = _generate_both(trainer, monkeypatch)
    finally:
        hook.remove()
    assert ours == plain
    assert all(len(set(c)) > 2 for c in ours)  # varied tokens: a sequence the comparison can tell apart
    assert used == (["fast"] if fast else [])
    assert len(calls) == 2  # ours: one vision pass over the unique images; the plain path: one more


@pytest.mark.parametrize("family", ["qwen2_5_vl", "internvl"])
def test_compiled_decode_step_gives_generates_greedy_tokens(family, tiny_models, rows_file, tmp_path, monkeypatch):
    """compile_decode: the decode step runs through torch.compile (forced on here; GPU-only by default)."""
    from torch._dynamo.utils import counters

    import vlm_grpo.fastpath.decode as decode

    trainer = make_trainer(tiny_models[family], rows_file, tmp_path, compile_decode=True)
    steps = []
    real_init = decode._Step.__init__

    def spy(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        steps.append(self)

    monkeypatch.setattr(decode._Step, "__init__", spy)
    monkeypatch.setattr(decode, "_compiled_forward", None)  # a step an earlier test compiled may fit these shapes
    torch._dynamo.reset()
    counters.clear()
    ours, plain, used = _generate_both(trainer, monkeypatch)
    assert used == ["fast"] and steps and all(step.compiled for step in steps)
    assert counters["stats"]["unique_graphs"] >= 1, "dynamo compiled nothing"
    assert ours == plain and len({tuple(c) for c in ours}) > 1


def test_a_decode_step_that_fails_to_compile_warns_and_runs_eagerly(
    tiny_models, rows_file, tmp_path, monkeypatch, caplog
):
    import vlm_grpo.fastpath.decode as decode

    def broken(*args, **kwargs):
        raise RuntimeError("inductor is unhappy")

    monkeypatch.setattr(decode, "_compiled", lambda: broken)
    trainer = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path, compile_decode=True)
    with caplog.at_level("WARNING", logger="vlm_grpo.fastpath.decode"):
        ours, plain, used = _generate_both(trainer, monkeypatch)
    assert used == ["fast"] and ours == plain
    assert "compiling the decode step failed (RuntimeError: inductor is unhappy)" in caplog.text


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_decode_samples_what_generate_samples(family, tiny_models, rows_file, tmp_path, monkeypatch):
    """Same RNG state, same logits processors: the sampled tokens are the same as generate's."""
    assert_samples_like_generate(make_trainer(tiny_models[family], rows_file, tmp_path), monkeypatch)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_fast_decode_stops_rows_at_eos_like_generate(attn, tiny_models, rows_file, tmp_path, monkeypatch):
    trainer = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path, attn=attn)
    trainer.generation_config.repetition_penalty = 2.0  # sampled rows that differ from each other
    first, _, _ = _generate_both(trainer, monkeypatch)

    # Make a token that some rows emit and others do not an EOS: those rows end there, the others go on.
    def cut(row, tok):
        return row.index(tok) + 1 if tok in row else len(row)

    eos = next(t for row in first for t in row if len({cut(r, t) for r in first}) > 1)
    trainer.generation_config.eos_token_id = [eos]
    trainer.eos_token_ids = [eos]
    ours, plain, used = _generate_both(trainer, monkeypatch)
    assert used == ["fast"] and ours == plain
    assert sorted(len(c) for c in ours) == sorted(cut(r, eos) for r in first)


def test_fast_decode_returns_generates_width_when_every_row_ends_early(tiny_models, rows_file, tmp_path, monkeypatch):
    """The host checks for "all rows ended" only every few tokens; the output must still stop where generate's does."""
    import vlm_grpo.fastpath.decode as decode

    trainer = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path)
    trainer.generation_config.repetition_penalty = 2.0
    first, _, _ = _generate_both(trainer, monkeypatch)
    eos = sorted({row[1] for row in first})  # every row ends at its second token
    trainer.generation_config.eos_token_id = eos
    trainer.eos_token_ids = eos
    widths = []
    real = decode.fast_decode  # the shared prefill calls decode.fast_decode

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        widths.append(out.size(1))
        return out

    monkeypatch.setattr(decode, "fast_decode", spy)
    ours, plain, _ = _generate_both(trainer, monkeypatch)
    assert ours == plain and {len(c) for c in ours} <= {1, 2}
    assert widths == [max(len(c) for c in plain)], (widths, decode._CHECK_EVERY)


@pytest.mark.parametrize("family", FAMILIES)
def test_fast_decode_on_text_only_prompts_of_different_lengths(family, tiny_models, tmp_path, monkeypatch):
    """No images: positions come from the attention mask (left padding), mrope deltas are zero."""
    rows = [
        {"conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "1"}]},
        {"conversations": [{"from": "human", "value": "Count the words in this longer question now."},
                           {"from": "gpt", "value": "2"}]},
    ]  # fmt: skip
    path = tmp_path / "text.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainer = make_trainer(tiny_models[family], path, tmp_path)
    trainer.generation_config.do_sample = False
    trainer.generation_config.min_new_tokens = trainer.generation_config.max_new_tokens
    trainer.generation_config.repetition_penalty = 5.0
    ours, plain, used = _generate_both(trainer, monkeypatch)
    assert used == ["fast"] and ours == plain
    assert all(len(set(c)) > 2 for c in ours)
