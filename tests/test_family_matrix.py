"""The family matrix: the same feature rows for every model family with a tiny build (``TINY_FAMILIES``).

Per-feature tests run on the four core families (``FAMILIES``); this file runs each feature once per family, so a
new family is checked for everything a user relies on. Rows, per family:

* the speed path at TRL's numbers on one real batch of mixed prompts (one image, two images, text only; two rows
  that differ only in their image, two that differ only in their question): grouping by image and by text, the
  packed log-prob pass (log-probs and gradients, 1e-5), fast decode (every step's log-softmax, 1e-5), each with a
  negative control that must fail; where the speed path does not serve a family it must say why in the log and
  still match TRL;
* two GRPO steps through the command line's ``main``, LoRA on the language model and the vision tower, every
  batch holding a two-image row and a text-only row (a reward that fails on the two-image row still scores the
  text row), then a resume from the first step's checkpoint that
  reaches the same adapter weights;
* a multi-turn tool step (a ``zoom_in`` call, then the model's own turn after the tool image) with TRL's tokens, or,
  for a family that cannot take tool images (``TOOLS_REFUSED``), the clear error that refuses ``--tools``;
* ZeRO-2 and ZeRO-3 on 2 CPU processes, one rank text-only while the other has images: ONE launch covers every
  family and both stages (a launch per family would cost the suite minutes); in ``test_family_matrix_dist.py``, so
  the suite's workers run it beside these rows.

Costs are kept per family: one sharp tiny checkpoint per family for this file (``sharp_models``, the generation
parity tests' fixture) and the session's tiny one, one batch for all speed-path rows, one training run (plus the
resumed step) for the training rows.
"""

from __future__ import annotations

import json
import logging
import re
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import vlm_grpo.fastpath.sharing as sharing
import vlm_grpo.utils
from e2e_utils import base_args, make_dataset, original_params
from test_generation_parity import _by_prompt_tokens_alone, _full_length, generation_gap, sharp_models  # noqa: F401
from test_group_sharing import G, assert_parity, make_trainer, real_batch
from test_tool_turns_fast import run as tool_run
from vlm_grpo.cli_errors import UserError
from vlm_grpo.fastpath import decode
from vlm_grpo.grpo_jsonl import cli, main, parse_args
from vlm_grpo.modules import get_vlm_module
from vlm_grpo.testing.presets import TINY_FAMILIES

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-5
EACH_FAMILY = pytest.mark.parametrize("family", TINY_FAMILIES)


def _step_aside_logged(caplog: pytest.LogCaptureFixture, what: str) -> list[str]:
    """Log lines of the speed path that name ``what`` (the reason it does not serve this run)."""
    return [r.getMessage() for r in caplog.records if r.name.startswith("vlm_grpo") and what in r.getMessage()]


# ----------------------------------------------------------------------------- speed path at TRL's numbers
@pytest.fixture(scope="module")
def mixed_rows(tmp_path_factory):
    """Five prompts: a look-alike pair by image (same question, different same-size images), a pair by question
    (same image), a two-image prompt and a text-only one."""
    root = tmp_path_factory.mktemp("matrix_rows")
    rng = np.random.default_rng(0)
    for name in ("p.png", "q.png"):
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(root / name)
    Image.new("RGB", (56, 90), (30, 30, 200)).save(root / "b.png")

    def row(question, image=None):
        r = {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": "1"}]}
        return {**({"image": image} if image else {}), **r}

    rows = [
        row("<image>What colour is the large shape?", "p.png"),
        row("<image>What colour is the large shape?", "q.png"),
        row("<image>How many squares?", "p.png"),
        row("Compare <image> with <image> and tell which one is larger, please.", ["p.png", "b.png"]),
        row("What is two plus three? Answer with a number."),
    ]
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@EACH_FAMILY
def test_speed_path_matches_trl_on_mixed_prompts(family, sharp_models, mixed_rows, tmp_path, monkeypatch, caplog):  # noqa: F811
    caplog.set_level(logging.INFO, logger="vlm_grpo")
    monkeypatch.setattr(vlm_grpo.utils, "_warned", set())  # each family's step-aside line is logged anew
    trainer = make_trainer(sharp_models(family), mixed_rows, tmp_path, per_device_train_batch_size=5 * G)
    _full_length(trainer)
    inputs = real_batch(trainer)
    assert inputs["num_images"] is not None and sorted(set(inputs["num_images"])) == [0, 1, 2], "a mixed batch"

    # Grouping: by image and by text (five prompts, G rollouts each).
    groups = sharing.plan_groups(
        inputs["prompt_ids"], inputs["prompt_mask"], inputs["pixel_values"], inputs["num_images"],
        trainer.vlm_module.units_per_sample(inputs),
    )  # fmt: skip
    assert sorted(len(g.rows) for g in groups) == [G] * 5

    # The packed log-prob pass (or TRL's, with a line saying why).
    packed = []
    real_forward = sharing._packed_forward
    monkeypatch.setattr(sharing, "_packed_forward", lambda *a, **k: packed.append(1) or real_forward(*a, **k))
    assert_parity(trainer, inputs)
    if not packed:
        assert _step_aside_logged(caplog, "share_prompt"), f"{family}: the packed pass stepped aside silently"

    # Fast decode after the shared prefill (or generate, with a line saying why).
    fast = []
    real_decode = decode.fast_decode
    monkeypatch.setattr(decode, "fast_decode", lambda *a, **k: fast.append(1) or real_decode(*a, **k))
    same_tokens, gap = generation_gap(trainer)
    assert same_tokens and gap <= TOL, gap
    if not fast:
        assert _step_aside_logged(caplog, "fast_decode"), f"{family}: fast decode stepped aside silently"

    # Negative controls: grouping blind to the pixels must fail the comparisons of what it serves; decode positions
    # off by one must fail fast decode's.
    real_plan = sharing.plan_groups
    monkeypatch.setattr(sharing, "plan_groups", _by_prompt_tokens_alone(real_plan))
    if packed:
        with pytest.raises(AssertionError):
            assert_parity(trainer, inputs)
    if fast:
        assert generation_gap(trainer)[1] > 1000 * TOL
    monkeypatch.setattr(sharing, "plan_groups", real_plan)
    if fast:
        real = sharing._next_positions
        monkeypatch.setattr(sharing, "_next_positions", lambda *a: None if real(*a) is None else real(*a) + 1)
        assert generation_gap(trainer)[1] > 1000 * TOL


# ----------------------------------------------------------------------------- training: LoRA, mixed batches, resume
def _base_name(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


@EACH_FAMILY
def test_two_lora_steps_on_mixed_batches_then_resume(family, tiny_models, tmp_path):
    """LoRA on the language model and the vision tower; each step's batch holds a two-image and a text-only row, and
    a reward that fails on the two-image row: its samples get no score, the text row's theirs."""
    data, plugin = make_dataset(tmp_path / "data", kinds=("multi", "text"), n=1)
    model_dir = tiny_models[family]
    argv = base_args(model_dir, data, plugin, tmp_path / "full")
    argv[argv.index("--per_device_train_batch_size") + 1] = "8"
    argv[argv.index("--reward_funcs") + 2] = f"{plugin}:flaky"
    argv[argv.index("--save_strategy") + 1] = "steps"
    argv += ["--save_steps", "1", "--use_peft", "true", "--lora_r", "4", "--lora_alpha", "8"]
    argv += ["--lora_include_vision", "true"]
    full = main(*parse_args(argv))
    assert full.state.global_step == 2
    logs = [entry for entry in full.state.log_history if "rewards/flaky/failures" in entry]
    assert logs and sum(entry["rewards/flaky/failures"] for entry in logs) > 0
    assert all(entry["rewards/flaky/mean"] == 1.0 for entry in logs)  # text rows still scored

    module = get_vlm_module(str(model_dir))
    before = original_params(model_dir)
    after = {_base_name(n): p.detach() for n, p in full.model.named_parameters() if "lora_" not in n}
    assert before.keys() == after.keys()
    assert all(torch.equal(before[n], after[n]) for n in before), "LoRA changed base weights"
    moved = {_base_name(n) for n, p in full.model.named_parameters() if "lora_B" in n and p.abs().sum() > 0}
    assert any(module.is_vision_parameter(n) for n in moved), "no vision-tower LoRA weight moved"
    assert any(not module.is_vision_parameter(n) for n in moved), "no language-model LoRA weight moved"
    assert (tmp_path / "full" / "adapter_config.json").is_file()

    # An interrupted run: only checkpoint-1 exists; resuming it reaches the uninterrupted run's weights.
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-1", resumed_dir / "checkpoint-1")
    out = argv.index("--output_dir") + 1
    resumed = main(*parse_args([*argv[:out], str(resumed_dir), *argv[out + 1 :], "--resume_from_checkpoint", "true"]))
    assert resumed.state.global_step == 2
    expected = dict(full.model.named_parameters())
    for name, param in resumed.model.named_parameters():
        torch.testing.assert_close(param, expected[name], rtol=0, atol=1e-7, msg=f"{name} differs after resume")


# ----------------------------------------------------------------------------- a multi-turn tool step
#: Families whose tool runs are refused with an error (none today; Idefics3 / SmolVLM, whose tool images TRL's loop
#: lays out as one sample, are regrouped per row by their adapter).
TOOLS_REFUSED: set[str] = set()


@pytest.fixture(scope="module")
def tool_dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("matrix_tools"), kinds=("single",))


@EACH_FAMILY
def test_a_tool_step_decodes_trls_tokens(family, sharp_models, tool_dataset, tmp_path, monkeypatch, caplog):  # noqa: F811
    caplog.set_level(logging.INFO, logger="vlm_grpo")
    monkeypatch.setattr(vlm_grpo.utils, "_warned", set())
    model = sharp_models(family)
    module = get_vlm_module(str(model))
    processor = module.load_processor(str(model))
    with Image.open(tool_dataset[0].parent / "images" / "img0.png") as image:
        w, h = module.coord_size(processor, *image.size)  # the box in the family's own frame (LLaVA: fractions)
    box = [w // 10, h // 10, w * 8 // 10, h * 8 // 10] if w >= 10 else [0.1 * w, 0.1 * h, 0.8 * w, 0.8 * h]
    models = {family: model}
    if family in TOOLS_REFUSED:  # refused up front, naming the family: never a run that drops the tool images
        with pytest.raises(UserError, match=rf"--tools: the '{family}' family cannot take tool replies with images"):
            tool_run(family, models, tool_dataset, tmp_path / "trl", share=False, box=box)
        return
    # Room for the call, the tool's image (the largest the processor makes of it) and the next turn.
    budget = 200 + module.num_image_tokens(processor, 4096, 4096)
    trl = tool_run(family, models, tool_dataset, tmp_path / "trl", share=False, box=box, budget=budget)
    ours = tool_run(family, models, tool_dataset, tmp_path / "ours", share=True, box=box, budget=budget)
    assert trl["tool_images"] == ours["tool_images"] == 1  # one tool round, the zoomed view in the conversation
    assert len(ours["later"]) == 4 and all(ours["later"])
    assert ours["later"] == trl["later"]
    assert len({tuple(ids) for ids in ours["later"]}) > 1  # the rows' own histories: not one repeated answer
    assert trl["fast_rows"] == 0
    if ours["fast_rows"] != 4:
        assert _step_aside_logged(caplog, "generate"), f"{family}: tool turns left fast decode silently"


# ----------------------------------------------------------------------------- the registry names every family
def test_an_unknown_model_type_names_every_family(tiny_models, tmp_path, capsys):
    odd = tmp_path / "odd_model"
    shutil.copytree(tiny_models["qwen2_vl"], odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**config, "model_type": "llava_next"}))
    data, plugin = make_dataset(tmp_path / "data", kinds=("text",), n=1)
    with pytest.raises(SystemExit) as exited:
        cli(base_args(odd, data, plugin, tmp_path / "out"))
    assert exited.value.code not in (0, None)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = next(line for line in err.splitlines() if line.startswith("error: "))
    assert "Unknown model_type 'llava_next'" in line and "--vlm_module" in line
    available = re.search(r"Available: ([\w, ]+)\.", line)
    assert available, line
    assert set(TINY_FAMILIES) <= set(available.group(1).split(", ")), line
