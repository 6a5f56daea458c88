"""TRL's GRPO options through ``VLMGRPOTrainer`` with the speed features on (the defaults).

Each test trains 2 steps in-process on a tiny Qwen2.5-VL and asserts what TRL's own tests assert for that option
(a loss was logged, parameters changed, the option's metrics are there) plus that the option visibly acted (the
completions it allows, the path generation took). Where the option reaches our code, the completions, losses and
gradient norms also match TRL's per-row path (speed features off) step by step.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Callable
from typing import Any, NamedTuple
from unittest import mock

import pytest
import torch
from PIL import Image
from transformers import GenerationMixin

import vlm_grpo.fastpath.route as route
import vlm_grpo.fastpath.sharing as sharing
from test_group_sharing import G, make_trainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    """Four prompts (a generation batch of steps_per_generation=2 needs four): one, two and no images."""
    root = tmp_path_factory.mktemp("options")
    Image.new("RGB", (64, 48), (200, 30, 30)).save(root / "a.png")
    Image.new("RGB", (56, 90), (30, 30, 200)).save(root / "b.png")

    def row(image, question):
        return {"image": image, "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": "1"}]}

    rows = [
        row("a.png", "<image>Red?"),
        row(["a.png", "b.png"], "Compare <image> with <image> and tell which one is larger, please."),
        row("b.png", "How many shapes are in <image>?"),
        {"conversations": [{"from": "human", "value": "Count to three."}, {"from": "gpt", "value": "1 2 3"}]},
    ]
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


PLAIN = {"share_prompt": False, "share_prefill": False, "fast_decode": False}
FAMILY = "qwen2_5_vl"


class Recorder:
    """A reward that depends on the text (so gradients are not zero) and remembers what it was shown."""

    __name__ = "recorder"

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, completions, completion_ids, prompts, **kwargs):
        self.calls.append({"completion_ids": [list(c) for c in completion_ids]})
        return [
            float(len(str(c)) % 3) + 0.1 * (sum(ids[:1]) % 7)
            for c, ids in zip(completions, completion_ids, strict=True)
        ]

    @property
    def completions(self) -> list[list[int]]:
        return [c for call in self.calls for c in call["completion_ids"]]


def _ragged(trainer) -> None:
    """Many end tokens: random tiny models would otherwise fill every completion to the limit, and loss types
    that differ only in how they normalise by length would give the same numbers."""
    eos = sorted({trainer._tokenizer.eos_token_id, *range(200, 520)})
    trainer.generation_config.eos_token_id = eos
    trainer.eos_token_ids = eos


def train(
    tiny_models,
    rows_file,
    tmp_path,
    reward=None,
    ragged=True,
    trainer_kwargs=None,
    rewards=(),
    setup=None,
    **overrides,
):
    """Train 2 steps; ``rewards`` replace the recording reward, ``setup(trainer)`` runs before training."""
    reward = reward or Recorder()
    # Plain SGD: Adam's first update is ~lr * sign(g), so entries whose gradient is at rounding level would move
    # by up to lr one way or the other, and the second step of two exact paths would no longer agree.
    args = {"max_steps": 2, "learning_rate": 0.1, "optim": "sgd", "logging_steps": 1, "max_completion_length": 8}
    args.update(overrides)
    trainer = make_trainer(
        tiny_models[FAMILY],
        rows_file,
        tmp_path,
        reward_funcs=list(rewards) or [reward],
        trainer_kwargs=trainer_kwargs,
        **args,
    )
    if ragged:
        _ragged(trainer)
    if setup is not None:
        setup(trainer)
    trainer.recorder = reward
    trainer.before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    return trainer


def assert_trl_checks(trainer) -> None:
    """What TRL's tests assert after training: a loss, and changed parameters (the language model's here)."""
    assert trainer.state.log_history[-1]["train_loss"] is not None
    changed = {n: not torch.equal(p, trainer.model.get_parameter(n)) for n, p in trainer.before.items()}
    text = {n: c for n, c in changed.items() if ".language_model." in n}
    assert text and all(text.values()), [n for n, c in text.items() if not c]


def step_logs(trainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "grad_norm" in entry]


# ----------------------------------------------------------------------------- loss variants
LOSS_VARIANTS = {
    "grpo": {"loss_type": "grpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "dapo": {"loss_type": "dapo"},
    "bnpo": {"loss_type": "bnpo"},
    "cispo": {"loss_type": "cispo"},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    "sapo": {"loss_type": "sapo"},
    "luspo": {"loss_type": "luspo", "importance_sampling_level": "sequence"},  # TRL: sequence level only
    "vespo": {"loss_type": "vespo"},
}
# Two iterations per generation: the second step is off-policy, so ratios, clipping and the sequence-level
# weights of each variant enter the loss (on-policy every ratio is 1).
OFF_POLICY = {"num_iterations": 2, "learning_rate": 0.02}


@pytest.fixture(scope="module")
def grpo_fast_losses(tiny_models, rows_file, tmp_path_factory):
    trainer = train(tiny_models, rows_file, tmp_path_factory.mktemp("grpo"), **OFF_POLICY, loss_type="grpo")
    return [e[k] for e in step_logs(trainer) for k in ("loss", "grad_norm")]


@pytest.mark.parametrize("variant", list(LOSS_VARIANTS))
def test_loss_variant_matches_the_per_row_path(variant, tiny_models, rows_file, tmp_path, grpo_fast_losses):
    options = {**OFF_POLICY, **LOSS_VARIANTS[variant]}
    fast = train(tiny_models, rows_file, tmp_path / "fast", **options)
    plain = train(tiny_models, rows_file, tmp_path / "plain", **options, **PLAIN)
    assert_trl_checks(fast)
    fast_logs, plain_logs = step_logs(fast), step_logs(plain)
    assert len(fast_logs) == 2
    assert fast.recorder.completions == plain.recorder.completions  # the same samples on both paths
    assert len({len(c) for c in fast.recorder.completions}) > 1, "completions should differ in length"
    for ours, theirs in zip(fast_logs, plain_logs, strict=True):
        for key in ("loss", "grad_norm", "entropy"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (key, ours, theirs)
    assert all(e["grad_norm"] > 0 for e in fast_logs)
    if variant != "grpo":  # the option acted: the numbers are not plain GRPO's (TRL's default loss_type is dapo)
        ours = [e[k] for e in fast_logs for k in ("loss", "grad_norm")]
        assert ours != pytest.approx(grpo_fast_losses, rel=1e-4), (variant, ours, grpo_fast_losses)


# ----------------------------------------------------------------------------- TRL's options
class Case(NamedTuple):
    overrides: dict[str, Any]
    check: Callable | None = None  # the option's visible effect
    compare: bool = True  # the same completions, losses and gradient norms as TRL's per-row path
    learns: bool = True  # TRL's "parameters changed" (false where the option removes the learning signal)
    trl_generates: bool = False  # the shared prefill cannot honour it: TRL's generate runs, whole
    ragged: bool = True
    compare_steps: int = 2  # steps whose loss and gradient norm must match the per-row path
    raises: str | None = None  # TRL itself refuses the option: the speed path must raise the same error
    setup: Callable | None = None  # runs on the trainer before training (patches, hooks)
    rewards: tuple = ()  # reward functions instead of the recording reward


def _groups(trainer) -> list[list[list[int]]]:
    """The recorded completions cut into GRPO groups (TRL deals out a prompt's G copies consecutively)."""
    done = trainer.recorder.completions
    return [done[i : i + G] for i in range(0, len(done), G)]


def _one_generation(trainer) -> None:
    assert len(trainer.recorder.calls) == 1, "both steps should train on one generation"


def _kl_and_synced_reference(trainer) -> None:
    assert all(math.isfinite(e["kl"]) for e in step_logs(trainer))
    ref = trainer.ref_model
    assert any(not torch.equal(p, ref.get_parameter(n)) for n, p in trainer.before.items() if ".language_model." in n)


def _metric(name):
    def check(trainer) -> None:
        assert all(name in e for e in step_logs(trainer)), name

    return check


def _greedy(trainer) -> None:  # the G samples of each prompt agree, so no group has a reward spread
    assert all(all(c == group[0] for c in group) for group in _groups(trainer))
    assert all(e["frac_reward_zero_std"] == 1.0 for e in step_logs(trainer))


def _never_emits_banned(trainer) -> None:
    emitted = {t for c in trainer.recorder.completions for t in c}
    assert emitted and not emitted & set(range(BANNED_FROM, len(trainer._tokenizer))), sorted(emitted)[-5:]


def _no_token_twice(trainer) -> None:  # no_repeat_ngram_size=1: no token already in the prompt or the completion
    for prompt, completion in zip(trainer.prompts_seen, trainer.recorder.completions, strict=True):
        assert len(set(completion)) == len(completion) and not set(completion) & set(prompt)


def _one_token_each(trainer) -> None:  # max_time ~0: generate stops after the first token
    assert {len(c) for c in trainer.recorder.completions} == {1}


BANNED_FROM = 500  # suppress_tokens / bad_words_ids: every id from here on (EOS and the image token included)
BANNED = "banned ids"  # placeholder: the ids depend on the tokenizer

OPTIONS = {
    "num_iterations": Case({"num_iterations": 2}, _one_generation),
    "steps_per_generation": Case({"steps_per_generation": 2}, _one_generation),
    "beta_sync_ref_model": Case(
        {"beta": 0.1, "sync_ref_model": True, "ref_model_sync_steps": 2}, _kl_and_synced_reference
    ),
    "delta": Case({"delta": 1.5, "num_iterations": 2, "epsilon": 0.05}),
    "epsilon_high": Case({"epsilon_high": 0.28, "num_iterations": 2}, _metric("clip_ratio/high_mean")),
    "top_entropy_quantile": Case({"top_entropy_quantile": 0.2}),
    "scale_rewards_group": Case({"scale_rewards": "group"}, _metric("reward_std"), compare=False),
    "scale_rewards_batch": Case({"scale_rewards": "batch"}, _metric("reward_std"), compare=False),
    "scale_rewards_none": Case({"scale_rewards": "none"}, _metric("reward_std"), compare=False),
    # TRL's own sampling test values; then each knob pushed until its effect shows in the completions.
    "sampling_kwargs": Case(
        {"generation_kwargs": {"top_k": 10, "top_p": 0.9, "min_p": 0.01, "repetition_penalty": 1.1}}
    ),
    "top_k": Case({"generation_kwargs": {"top_k": 1}}, _greedy, learns=False),
    "top_p": Case({"generation_kwargs": {"top_p": 1e-6}}, _greedy, learns=False),
    "min_p": Case({"generation_kwargs": {"min_p": 0.999}}, _greedy, learns=False),
    "repetition_penalty": Case({"generation_kwargs": {"repetition_penalty": 1.5}}),
    "suppress_tokens": Case({"generation_kwargs": {"suppress_tokens": BANNED}}, _never_emits_banned, ragged=False),
    "bad_words_ids": Case({"generation_kwargs": {"bad_words_ids": BANNED}}, _never_emits_banned, ragged=False),
    "no_repeat_ngram_size": Case({"generation_kwargs": {"no_repeat_ngram_size": 1}}, _no_token_twice, ragged=False),
    "num_beams": Case({"generation_kwargs": {"num_beams": 2}}, trl_generates=True),
    # The crash reported: the prefill shared for 3 rows, then generate's beam search expanding them to 6.
    "num_beams_shared_prefill": Case(
        {"generation_kwargs": {"num_beams": 2}, "fast_decode": False}, trl_generates=True, compare=False
    ),
    # TRL calls generate without a tokenizer, which stop strings need: TRL refuses them, and so must we.
    "stop_strings": Case(
        {"generation_kwargs": {"stop_strings": ["e"]}}, trl_generates=True, raises="we could not locate a tokenizer"
    ),
    "max_time": Case({"generation_kwargs": {"max_time": 1e-9}}, _one_token_each, trl_generates=True),
    "cache_implementation": Case({"cache_implementation": "static"}, trl_generates=True),
}


# --- options that replace or wrap generation: TRL's test for mask_truncated_completions patches generate itself
FAKE = [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, "eos"], [31, 32, 33, 34, 35, 36, 37, "eos"]]  # 1 of 3 cut


def _fake_generate(self, input_ids=None, generation_config=None, **kwargs):
    eos = generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    width = max(len(f) for f in FAKE)
    rows = [[eos if t == "eos" else t for t in FAKE[i % 3]] for i in range(input_ids.size(0))]
    rows = [r + [generation_config.pad_token_id] * (width - len(r)) for r in rows]
    return torch.cat([input_ids, torch.tensor(rows, device=input_ids.device)], dim=1)


def _patch_generate(trainer, monkeypatch) -> None:
    monkeypatch.setattr(GenerationMixin, "generate", _fake_generate)


def _trained_on_the_fake_completions(trainer) -> None:
    eos = trainer._tokenizer.eos_token_id
    expected = [[eos if t == "eos" else t for t in FAKE[i % 3]] for i in range(len(trainer.recorder.completions))]
    assert trainer.recorder.completions == expected
    assert all(e["completions/clipped_ratio"] == pytest.approx(1 / 3) for e in step_logs(trainer))


def _wrap_generate(trainer, monkeypatch) -> None:
    trainer.generate_spy = mock.MagicMock(wraps=trainer.model.generate)
    monkeypatch.setattr(trainer.model, "generate", trainer.generate_spy)


def _wrapper_called_each_step(trainer) -> None:
    assert trainer.generate_spy.call_count == 2


class Rollout:
    """A user's rollout: the trainer's own generation (so the speed path), then its own rule (keep 3 tokens)."""

    def __init__(self) -> None:
        self.completions: list[list[int]] = []

    def __call__(self, prompts, trainer):
        prompt_ids, images, fields = trainer._tokenize_prompts(prompts)
        completion_ids, _ = trainer._generate_single_turn(prompt_ids, images, fields, trainer.num_generations)
        completion_ids = [c[:3] for c in completion_ids]
        self.completions.extend(completion_ids)
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def _use_rollout(trainer, monkeypatch) -> None:
    trainer.rollout_func = Rollout()


def _trained_on_the_rollouts(trainer) -> None:
    assert trainer.recorder.completions == trainer.rollout_func.completions
    assert max(len(c) for c in trainer.recorder.completions) == 3


def _one(completions, **kwargs):
    return [1.0] * len(completions)


def _zero(completions, **kwargs):
    return [0.0] * len(completions)


def _weighted_reward(trainer) -> None:  # TRL: the logged reward is 0.7 * 1 + 0.3 * 0, not the plain sum
    assert all(e["reward"] == pytest.approx(0.7) for e in step_logs(trainer))


OPTIONS.update(
    {
        "mask_truncated_completions": Case(
            {"mask_truncated_completions": True, "loss_type": "dapo"},
            _trained_on_the_fake_completions,
            trl_generates=True,
            ragged=False,
            setup=_patch_generate,
        ),
        "wrapped_generate": Case({}, _wrapper_called_each_step, trl_generates=True, setup=_wrap_generate),
        "rollout_func": Case({}, _trained_on_the_rollouts, setup=_use_rollout),
        **{
            f"reward_weights_{how}": Case(
                {"reward_weights": [0.7, 0.3], "multi_objective_aggregation": how},
                _weighted_reward,
                compare=False,
                learns=False,
                rewards=(_one, _zero),
            )
            for how in ("sum_then_normalize", "normalize_then_sum")
        },
    }
)


def _resolve(overrides: dict[str, Any], vocab: int) -> dict[str, Any]:
    kwargs = dict(overrides.get("generation_kwargs") or {})
    banned = list(range(BANNED_FROM, vocab))
    if kwargs.get("suppress_tokens") == BANNED:
        kwargs["suppress_tokens"] = banned
    if kwargs.get("bad_words_ids") == BANNED:
        kwargs["bad_words_ids"] = [[t] for t in banned]
    return {**overrides, "generation_kwargs": kwargs} if kwargs else overrides


def train_with_spies(tiny_models, rows_file, tmp_path, monkeypatch, **overrides):
    """``train``, recording each generated row's prompt and how many generations the shared prefill made."""
    import vlm_grpo.trainer as trainer_module

    shared = []
    real = sharing.shared_prefill_generate
    monkeypatch.setattr(trainer_module, "shared_prefill_generate", lambda *a, **k: shared.append(1) or real(*a, **k))
    prompts: list[list[int]] = []

    def spy_on_prompts(trainer):
        tokenize = trainer._tokenize_prompts

        def spy(batch):
            out = tokenize(batch)
            prompts.extend(out[0])
            return out

        trainer._tokenize_prompts = spy
        if overrides.get("setup"):
            overrides["setup"](trainer)

    trainer = train(tiny_models, rows_file, tmp_path, **{**overrides, "setup": spy_on_prompts})
    trainer.prompts_seen, trainer.shared_generations = prompts, len(shared)
    return trainer


def assert_same_as_per_row_path(fast, plain, steps: int = 2) -> None:
    assert fast.recorder.completions == plain.recorder.completions
    for ours, theirs in list(zip(step_logs(fast), step_logs(plain), strict=True))[:steps]:
        for key in ("loss", "grad_norm"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (key, ours, theirs)


def routed_messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "vlm_grpo.fastpath.route"]


@pytest.mark.parametrize("option", list(OPTIONS))
def test_trl_option_trains_with_the_speed_path(option, tiny_models, rows_file, tmp_path, monkeypatch, caplog):
    case = OPTIONS[option]
    from transformers import AutoTokenizer

    overrides = _resolve(case.overrides, len(AutoTokenizer.from_pretrained(tiny_models[FAMILY])))
    common = {"ragged": case.ragged, "rewards": case.rewards, **overrides}
    setup = functools.partial(case.setup, monkeypatch=monkeypatch) if case.setup else None
    route._logged.clear()
    if case.raises:
        with pytest.raises(Exception, match=case.raises):
            train(tiny_models, rows_file, tmp_path / "plain", **common, **PLAIN)
    with caplog.at_level(logging.INFO, logger="vlm_grpo.fastpath.route"):
        if case.raises:
            with pytest.raises(Exception, match=case.raises):
                train_with_spies(tiny_models, rows_file, tmp_path / "fast", monkeypatch, setup=setup, **common)
        else:
            fast = train_with_spies(tiny_models, rows_file, tmp_path / "fast", monkeypatch, setup=setup, **common)
    routed = routed_messages(caplog)
    if not case.raises:
        assert fast.state.log_history[-1]["train_loss"] is not None and len(step_logs(fast)) == 2
        if case.learns:
            assert_trl_checks(fast)
        if case.check is not None:
            case.check(fast)
        assert (fast.shared_generations == 0) if case.trl_generates else (fast.shared_generations > 0)
    if case.trl_generates:  # one line, and no generation (not even half of one) on the shared path
        assert len(routed) == 1 and "generation goes through TRL's generate" in routed[0], routed
    else:
        assert not routed, routed
    if case.compare and not case.raises:
        plain = train(tiny_models, rows_file, tmp_path / "plain", setup=setup, **common, **PLAIN)
        assert_same_as_per_row_path(fast, plain, case.compare_steps)


def test_every_way_of_replacing_generate_is_seen(tiny_models, monkeypatch):
    """Instance patch, class patch (a functools.wraps wrapper keeps the name and module, not the code), a mock, a
    subclass override: each makes TRL's generate call the only honest one. Stock models, PEFT-wrapped too, pass."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(tiny_models[FAMILY])
    assert route.patched_generate(model) is None
    assert route.patched_generate(get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))) is None
    model = AutoModelForImageTextToText.from_pretrained(tiny_models[FAMILY])

    with mock.patch.object(model, "generate", wraps=model.generate):
        assert "patched on the model instance" in route.patched_generate(model)
    stock = type(model).generate

    @functools.wraps(stock)
    def wrapper(self, *args, **kwargs):
        return stock(self, *args, **kwargs)

    for replacement, where in ((wrapper, __file__), (mock.MagicMock(), "MagicMock")):
        with mock.patch.object(GenerationMixin, "generate", replacement):
            assert where in route.patched_generate(model)

    class Custom(type(model)):
        def generate(self, *args, **kwargs):
            return super().generate(*args, **kwargs)

    model.__class__ = Custom
    assert "Custom.generate is wrapped or replaced" in route.patched_generate(model)
