"""Token selection inside the decode step (``vlm_grpo.fastpath.decode_select``): on a GPU the step's CUDA graph
captures the processors, the draw and the EOS bookkeeping with the forward, so a token is one replay.

CPU has no graphs; ``_SELECT_IN_STEP_WITHOUT_GRAPH`` runs the same in-step code eagerly, with attention windows on
(``test_decode_windows``), so each window's warm-up passes run the selection too, as they do before a capture.
Tokens must be generate's under the same seed, and the sampler must be left where generate leaves it (checked by
``_generate_both``).
"""

from __future__ import annotations

import contextlib
import logging
import math

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList, MinNewTokensLengthLogitsProcessor

import test_group_sharing
from test_decode_windows import STEPS, _windows_on
from test_group_sharing import _generate_both, make_trainer
from vlm_grpo.fastpath import decode, decode_select
from vlm_grpo.testing.tiny import FAMILIES

pytestmark = pytest.mark.usefixtures("one_torch_thread")
rows_file = test_group_sharing.rows_file  # the fixture: two rows, one and two images


def _in_step(monkeypatch) -> list[int]:
    """Windows and the in-step selection on the CPU path; returns [tokens the steps selected themselves]."""
    _windows_on(monkeypatch)
    monkeypatch.setattr(decode, "_SELECT_IN_STEP_WITHOUT_GRAPH", True)
    selected = [0]
    real = decode_select.InStep.after

    def after(self, logits):
        selected[0] += 1
        return real(self, logits)

    monkeypatch.setattr(decode_select.InStep, "after", after)
    return selected


def _sampled(trainer, min_new_tokens: bool = True) -> None:
    """TRL's sampling settings a user may set, none of them reading the generated ids."""
    config = trainer.generation_config
    config.temperature, config.top_k, config.top_p, config.repetition_penalty = 0.7, 50, 0.9, 1.0
    config.min_new_tokens = config.max_new_tokens if min_new_tokens else None


@pytest.mark.parametrize("family", FAMILIES)
def test_in_step_selection_samples_what_generate_samples(family, tiny_models, rows_file, tmp_path, monkeypatch):
    selected = _in_step(monkeypatch)
    trainer = make_trainer(tiny_models[family], rows_file, tmp_path, max_completion_length=STEPS)
    _sampled(trainer)
    assert trainer.generation_config.suppress_tokens  # TRL's image-token suppression: in the graph as well
    ours, plain, used = _generate_both(trainer, monkeypatch, seed=5)
    assert used == ["fast"] and ours == plain
    assert len({tuple(c) for c in ours}) > 2 and all(len(c) == STEPS for c in ours)
    assert selected[0] >= STEPS + 2  # every token (and the warm-ups) chosen inside the steps


@pytest.mark.parametrize("fork", [True, False], ids=["sampler_restored", "control_warm_ups_draw"])
def test_warm_ups_draw_nothing_the_decode_draws(fork, tiny_models, rows_file, tmp_path, monkeypatch):
    """Warm-up passes (before each window's capture) select a token too; the sampler is put back after them.
    Control: without that, the warm-ups' draws shift the decode's and the tokens leave generate's."""
    from trl import GRPOTrainer

    from test_group_sharing import G, _tokenized_batch

    selected = _in_step(monkeypatch)
    if not fork:
        monkeypatch.setattr(torch.random, "fork_rng", lambda **kw: contextlib.nullcontext())
    trainer = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path, max_completion_length=STEPS)
    _sampled(trainer)
    prompt_ids, images, fields = _tokenized_batch(trainer)
    torch.manual_seed(5)
    ours, _ = trainer._generate_single_turn(prompt_ids, images, fields, G)
    torch.manual_seed(5)
    plain, _ = GRPOTrainer._generate_single_turn(trainer, prompt_ids, images, fields, G)
    assert selected[0] >= STEPS
    assert (ours == plain) is fork


def test_in_step_selection_stops_rows_at_eos_like_generate(tiny_models, rows_file, tmp_path, monkeypatch):
    """Rows end mid-decode at an EOS some rows draw and others never: the device counters give generate's widths."""
    _in_step(monkeypatch)
    trainer = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path, max_completion_length=STEPS)
    _sampled(trainer, min_new_tokens=False)
    first, _, _ = _generate_both(trainer, monkeypatch, seed=5)

    def cut(row, tok):
        return row.index(tok) + 1 if tok in row else len(row)

    eos = next(t for row in first for t in row if len({cut(r, t) for r in first}) > 1 and cut(row, t) > 4)
    trainer.generation_config.eos_token_id = [eos]
    trainer.eos_token_ids = [eos]
    ours, plain, used = _generate_both(trainer, monkeypatch, seed=5)
    assert used == ["fast"] and ours == plain
    assert sorted(len(c) for c in ours) == sorted(cut(r, eos) for r in first)
    assert len({len(c) for c in ours}) > 1


def test_processors_that_read_the_ids_select_after_the_step(tiny_models, rows_file, tmp_path, monkeypatch, caplog):
    """A repetition penalty reads the ids so far: the loop selects after each step (one info line says why), and
    the tokens are still generate's."""
    selected = _in_step(monkeypatch)
    trainer = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path, max_completion_length=STEPS)
    _sampled(trainer)
    trainer.generation_config.repetition_penalty = 1.3
    with caplog.at_level(logging.INFO, logger="vlm_grpo.fastpath.decode"):
        ours, plain, used = _generate_both(trainer, monkeypatch, seed=5)
    assert used == ["fast"] and ours == plain
    assert selected[0] == 0
    assert any("RepetitionPenaltyLogitsProcessor" in r.getMessage() for r in caplog.records)


def _processors(**settings) -> LogitsProcessorList:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=1, hidden_size=8, intermediate_size=8, vocab_size=16,
                                         num_attention_heads=2, num_key_value_heads=2))  # fmt: skip
    config, _ = model._prepare_generation_config(GenerationConfig(do_sample=True, eos_token_id=[2], **settings))
    model._prepare_special_tokens(config, True, device="cpu")
    return model._get_logits_processor(
        generation_config=config, input_ids_seq_length=7, encoder_input_ids=torch.zeros(1, 7, dtype=torch.long),
        prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(), device="cpu", model_kwargs={},
    )  # fmt: skip


def test_which_processors_run_in_the_graph():
    trl_defaults = _processors(temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0, suppress_tokens=[5])
    assert decode_select.in_graph_blocker(trl_defaults) is None
    tuned = _processors(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, min_new_tokens=3, suppress_tokens=[5])
    assert decode_select.in_graph_blocker(tuned) is None
    assert "RepetitionPenalty" in decode_select.in_graph_blocker(_processors(repetition_penalty=1.2))
    assert "NoRepeatNGram" in decode_select.in_graph_blocker(_processors(no_repeat_ngram_size=2))
    # A kept graph is keyed on the settings, not on the prompt length min_new_tokens counts from.
    assert decode_select.signature(_processors(temperature=0.7)) != decode_select.signature(trl_defaults)


def test_min_new_tokens_on_the_device_masks_eos_like_transformers():
    """Hand case: prompt of 4, min 3 new tokens, EOS ids 2 and 5. At 4, 5, 6 ids the EOS scores are -inf, at 7 and
    8 (3 and 4 new tokens) nothing changes; transformers' processor, fed the ids, says the same."""
    sel = decode_select.Selection(rows=2, width=10, eos_count=2, device=torch.device("cpu"))
    original = MinNewTokensLengthLogitsProcessor(4, 3, [2, 5])
    ours = decode_select._MinNewTokensOnDevice(original, sel)
    sel.start.fill_(4)
    scores = torch.randn(2, 8)
    for length in range(4, 9):
        sel.column.fill_(length)
        got = ours(None, scores)
        expected = original(torch.zeros(2, length, dtype=torch.long), scores)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        masked = got[:, [2, 5]].eq(-math.inf).all().item()
        assert masked == (length - 4 < 3), length
        torch.testing.assert_close(got[:, [0, 1, 3, 4, 6, 7]], scores[:, [0, 1, 3, 4, 6, 7]])


def test_a_kept_workspace_selects_in_its_steps_for_every_prompt_length(tiny_models, monkeypatch):
    """keep_decode_graphs: the second call (another prompt length, the same settings) reuses the workspace and its
    steps, processors included; both calls draw generate's tokens."""
    from transformers import DynamicCache

    from test_decode_keep import _kept
    from test_decode_speed import G, _tiny_qwen
    from vlm_grpo.fastpath.sharing import _generation_positions, _next_positions

    selected = _in_step(monkeypatch)
    model = _tiny_qwen(tiny_models)
    config = model.generation_config
    config.do_sample, config.temperature, config.top_k, config.top_p = True, 0.7, 50, 0.9
    config.max_new_tokens = config.min_new_tokens = 5
    spaces, steps = [], []
    for prompt_len in (20, 18):
        ids = torch.randint(100, 1000, (2, prompt_len), generator=torch.Generator().manual_seed(prompt_len))
        mask, index = torch.ones_like(ids), torch.arange(2).repeat_interleave(G)
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            prefill = {"attention_mask": mask[:, :-1]}
            prefill["position_ids"] = positions = _generation_positions(model, ids[:, :-1], prefill)
            model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True, **prefill)
            nxt = _next_positions(positions, model.model.rope_deltas)
            torch.manual_seed(1)
            ours = decode.fast_decode(model, cache, index, ids[index], mask[index], nxt, config, False, keep=True)
            torch.manual_seed(1)
            plain = model.generate(input_ids=ids[index], attention_mask=mask[index], generation_config=config)
        assert ours.tolist() == plain[:, prompt_len:].tolist(), prompt_len
        assert len({tuple(r) for r in ours.tolist()}) > 2
        spaces.append(_kept(model))
        steps.append(dict(spaces[-1].steps))
    assert spaces[1] is spaces[0] and steps[1] == steps[0]  # no new step: on a GPU, no new capture
    assert selected[0] >= 10


@pytest.mark.parametrize("vocab", [700, 2048, 3001])  # under one slice, whole slices, a padded last slice
def test_sample_one_draws_what_multinomial_draws(vocab):
    """The compiled selection's draw, spelled out: the same token as ``torch.multinomial(softmax)`` under every
    seed, with part of the vocabulary masked as top-k / top-p leave it; and multinomial's error for scores that
    make no distribution. The draws are random (not the argmax), so a draw that ignored the sampler would fail."""
    scores = torch.randn(6, vocab, generator=torch.Generator().manual_seed(vocab)) * 2
    scores[:3, : vocab // 2] = -math.inf
    drawn = []
    for seed in range(12):
        torch.manual_seed(seed)
        expected = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        torch.manual_seed(seed)
        drawn.append(decode_select.sample_one(scores))
        assert drawn[-1].tolist() == expected.tolist(), seed
    assert any(d.tolist() != scores.argmax(-1).tolist() for d in drawn)
    nothing = scores.clone()
    nothing[1] = -math.inf  # softmax of a row without a finite score: nan
    with pytest.raises(RuntimeError, match="probability tensor contains either `inf`, `nan` or element < 0"):
        decode_select.sample_one(nothing)


def _select_tokens(compiled: bool, logits: list[torch.Tensor], prompt: torch.Tensor) -> torch.Tensor:
    """Tokens the in-step selection (``compiled``: through compiled_select) chooses from ``logits``, one per step,
    on a fresh Selection with fresh tuned processors (EOS id 2, min 3 new tokens), seeded the same way each time."""
    rows, prompt_len = prompt.shape  # 7: the prompt length _processors' min_new_tokens counts from
    processors = _processors(temperature=0.7, top_k=40, top_p=0.9, min_new_tokens=3, suppress_tokens=[5])
    config = GenerationConfig()
    config._eos_token_tensor, config._pad_token_tensor = torch.tensor([2]), torch.tensor(0)
    width = prompt_len + len(logits) + 1
    sel = decode_select.Selection(rows, width, eos_count=1, device=torch.device("cpu"))
    sel.load(prompt, prompt_len, config, processors)
    fed, positions = torch.zeros(rows, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
    step = decode_select.InStep(sel, torch.zeros(rows, 1, 1, width), 0.0, True, fed, positions, compile=compiled)
    torch.manual_seed(3)
    for scores in logits:
        step.after(scores)
    return sel.out[:, prompt_len : prompt_len + len(logits)].clone()


def test_the_compiled_selection_draws_the_eager_tokens(monkeypatch):
    """A compiled step's selection goes through torch.compile (inductor, on CPU here): tuned processors, the draw
    spelled out (sample_one) and the EOS bookkeeping choose the eager selection's tokens under one seed, and a
    second call (new selection, new processors) reuses the compiled graph. Control: without ``fallback_random``
    inductor draws its own random numbers, and the tokens change."""
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(4, 300, generator=g) * 3 for _ in range(10)]
    for scores in logits[4:]:
        scores[:2, 2] += 12  # rows 0 and 1 end (EOS, id 2) once min_new_tokens allows it; pad (0) after that
    logits = [scores.to(torch.bfloat16) for scores in logits]
    prompt = torch.randint(10, 20, (4, 7), generator=g)
    monkeypatch.setattr(decode_select, "_compiled_select", None)
    eager = _select_tokens(False, logits, prompt)
    assert eager[:2, -1].tolist() == [0, 0] and 2 in eager[0].tolist() and 2 not in eager[2:, :3].tolist()
    compiled = _select_tokens(True, logits, prompt)
    assert decode_select._compiled_select.compiled  # it did not fall back to eager
    assert compiled.tolist() == eager.tolist()
    graphs = counters["stats"]["unique_graphs"]
    assert _select_tokens(True, logits, prompt).tolist() == eager.tolist()
    assert counters["stats"]["unique_graphs"] == graphs  # the second call compiled nothing

    torch._dynamo.reset()
    monkeypatch.setattr(decode_select, "_compiled_select", None)
    monkeypatch.setattr(decode_select, "SELECT_OPTIONS", {})
    assert _select_tokens(True, logits, prompt).tolist() != eager.tolist()
    torch._dynamo.reset()


@pytest.mark.parametrize("compile", [False, True], ids=["eager_step", "compiled_step"])
def test_a_compiled_step_selects_through_compiled_select(compile, tiny_models, rows_file, tmp_path, monkeypatch):
    """The plumbing: a compiled decode step's in-graph selection goes through compiled_select, an eager step's does
    not. Both compilations are stood in for by the eager functions (seconds, not minutes, on CPU); the tokens stay
    generate's."""
    _in_step(monkeypatch)
    monkeypatch.setattr(decode, "_compiled", lambda: decode._decode_forward)
    selections = []

    def recording():
        def select(*args):
            selections.append(args[0])
            return decode_select.Selection.select(*args)

        return select

    monkeypatch.setattr(decode_select, "compiled_select", recording)
    trainer = make_trainer(
        tiny_models["qwen2_5_vl"], rows_file, tmp_path, max_completion_length=STEPS, compile_decode=compile
    )
    _sampled(trainer)
    ours, plain, used = _generate_both(trainer, monkeypatch, seed=5)
    assert used == ["fast"] and ours == plain
    if compile:
        assert len(selections) >= STEPS  # every token (and the warm-ups) through compiled_select
    else:
        assert not selections
