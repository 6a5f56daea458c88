"""End to end through grpo_jsonl.py's main, for every family: full, LoRA, frozen vision; resume. (Batches that mix a
two-image row and a text-only row, with a reward failing on some rows: ``test_family_matrix.py``, every family.)"""

from __future__ import annotations

import shutil

import pytest
import torch

from e2e_utils import base_args, make_dataset, original_params
from vlm_grpo.grpo_jsonl import main, parse_args
from vlm_grpo.modules import get_vlm_module
from vlm_grpo.resume import ResumeError
from vlm_grpo.testing.tiny import FAMILIES


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("e2e_data"))


def run(argv):
    return main(*parse_args(argv))


def _base_name(name: str) -> str:
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["full", "lora", "freeze"])
def test_two_steps_change_what_should_change(family, mode, tiny_models, dataset, tmp_path):
    data, plugin = dataset
    model_dir = tiny_models[family]
    argv = base_args(model_dir, data, plugin, tmp_path / "out")
    if mode == "lora":
        argv += ["--use_peft", "true", "--lora_r", "4", "--lora_alpha", "8"]
    if mode == "freeze":
        argv += ["--freeze_vision_modules", "true"]
    trainer = run(argv)
    assert trainer.state.global_step == 2
    module = get_vlm_module(str(model_dir))
    before = original_params(model_dir)
    after = {_base_name(n): p.detach() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    assert before.keys() == after.keys()

    vision = [n for n in before if module.is_vision_parameter(n)]
    language = [n for n in before if not module.is_vision_parameter(n) and "layers" in n]
    assert vision and language
    changed = {n for n in before if not torch.equal(before[n], after[n])}

    if mode == "full":
        assert set(language) & changed, "no language-model weight changed"
        assert set(vision) & changed, "no vision weight changed in full fine-tuning"
    elif mode == "freeze":
        assert set(language) & changed
        assert not set(vision) & changed, f"frozen vision weights changed: {sorted(set(vision) & changed)[:3]}"
    else:
        assert not changed, f"LoRA changed base weights: {sorted(changed)[:3]}"
        lora = {n: p for n, p in trainer.model.named_parameters() if "lora_B" in n}
        assert lora and any(p.abs().sum() > 0 for p in lora.values()), "LoRA weights did not move"
        assert not any(module.is_vision_parameter(_base_name(n)) for n in lora), "LoRA on the vision tower"
    # the final model is saved where the user asked
    assert (tmp_path / "out" / ("adapter_config.json" if mode == "lora" else "config.json")).is_file()


def test_resume_reaches_the_same_weights_as_an_uninterrupted_run(tiny_models, dataset, tmp_path):
    data, plugin = dataset
    model_dir = tiny_models["qwen2_5_vl"]
    save = ["--save_strategy", "steps", "--save_steps", "2"]
    full = run(base_args(model_dir, data, plugin, tmp_path / "full", steps=4) + save)
    assert full.state.global_step == 4

    # An interrupted run: only checkpoint-2 exists in its output_dir.
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "full" / "checkpoint-2", resumed_dir / "checkpoint-2")
    argv = base_args(model_dir, data, plugin, resumed_dir, steps=4) + save

    with pytest.raises(ResumeError, match="already holds 1 checkpoint"):
        run(argv)

    resumed = run([*argv, "--resume_from_checkpoint", "true"])
    assert resumed.state.global_step == 4
    expected = dict(full.model.named_parameters())
    for name, param in resumed.model.named_parameters():
        torch.testing.assert_close(param, expected[name], rtol=0, atol=0, msg=f"{name} differs after resume")


def test_bad_model_type_and_reward_name_fail_clearly(tiny_models, dataset, tmp_path):
    data, plugin = dataset
    model_dir = tiny_models["qwen2_vl"]
    argv = base_args(model_dir, data, plugin, tmp_path / "o")
    bad_reward = [a if a != "format" else "no_such_reward" for a in argv]
    with pytest.raises(KeyError, match=r"Unknown reward 'no_such_reward'\. Available: .*accuracy.*format"):
        run(bad_reward)

    odd = tmp_path / "odd_model"
    shutil.copytree(model_dir, odd)
    config = (odd / "config.json").read_text().replace('"model_type": "qwen2_vl"', '"model_type": "llava_next"', 1)
    (odd / "config.json").write_text(config)
    with pytest.raises(KeyError, match=r"Unknown model_type 'llava_next'.*Available: .*internvl.*qwen2_5_vl"):
        run(base_args(odd, data, plugin, tmp_path / "o2"))


def test_help_lists_vlm_r1_flags(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    for flag in (
        "--data_file_paths",
        "--image_folders",
        "--reward_funcs",
        "--reward_method",
        "--task_type",
        "--max_pixels",
        "--min_pixels",
        "--max_anyres_num",
        "--val_split_ratio",
        "--freeze_vision_modules",
        "--is_reward_customized_from_vlm_module",
        "--skip_bad_rows",
        "--max_prompt_length",
    ):
        assert flag in out, flag


def test_every_entry_point_starts(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    script = Path(sys.executable).parent / "vlm-grpo"
    for cmd in (
        [sys.executable, "-m", "vlm_grpo.grpo_jsonl", "--help"],
        [sys.executable, str(repo / "src" / "vlm_grpo" / "grpo_jsonl.py"), "--help"],  # what torchrun runs
        [str(script), "--help"],
    ):
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
        assert "--data_file_paths" in result.stdout
