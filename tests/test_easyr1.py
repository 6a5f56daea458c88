"""EasyR1's own command lines: its ``examples/config.yaml`` and two example scripts' override lines (paths changed
to tiny data and model; see tests/fixtures/easyr1/SOURCE.md), every key mapped or ignored with a reason, refusals,
warmup, reward kwargs, filter_key on a reward's dict, and reward plugins that fail to import."""

from __future__ import annotations

import io
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from datasets import Dataset, Features, Image, List, Value
from PIL import Image as PILImage

from vlm_grpo.cli_errors import UserError
from vlm_grpo.convert_config import convert
from vlm_grpo.dynamic_sampling import DynamicSamplingMixin
from vlm_grpo.easyr1_args import easyr1_argv
from vlm_grpo.easyr1_keys import ignore_reason
from vlm_grpo.registry import PluginImportError, load_object

FIXTURES = Path(__file__).parent / "fixtures" / "easyr1"
CONFIG = FIXTURES / "config.yaml"
TINY_SIZES = [  # the only overrides besides paths: a batch the tiny model trains in seconds
    "data.rollout_batch_size=2", "worker.actor.global_batch_size=2", "worker.rollout.n=2",
    "data.max_response_length=8", "worker.actor.micro_batch_size_per_device_for_update=2",
    "worker.actor.model.enable_gradient_checkpointing=false", "trainer.max_steps=1",
]  # fmt: skip


def script_overrides(name: str, paths: dict[str, str]) -> list[str]:
    """The ``key=value`` lines of an EasyR1 example script, with the paths in ``paths`` swapped in."""
    text = (FIXTURES / name).read_text().replace("\\\n", " ")
    command = next(line for line in text.splitlines() if "verl.trainer.main" in line)
    out = []
    for token in shlex.split(command)[3:]:
        key = token.partition("=")[0]
        if key == "config":
            token = f"config={CONFIG}"
        elif key in paths:
            token = f"{key}={paths[key]}"
        out.append(token)
    given = {token.partition("=")[0] for token in out}
    return out + [f"{key}={value}" for key, value in paths.items() if key not in given]  # the config's own paths


@pytest.fixture(scope="module")
def easyr1_data(tmp_path_factory) -> Path:
    """EasyR1's column names (problem / answer / images), images as bytes, as hiyouga/geometry3k ships them."""
    root = tmp_path_factory.mktemp("easyr1")
    pics = []
    for i, color in enumerate([(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30)]):
        buffer = io.BytesIO()
        PILImage.new("RGB", (48 + 8 * i, 40), color).save(buffer, format="PNG")
        pics.append([{"bytes": buffer.getvalue(), "path": None}])
    features = Features({"problem": Value("string"), "answer": Value("string"), "images": List(Image())})
    Dataset.from_dict(
        {"problem": [f"<image>What is {i} + {i}?" for i in range(4)], "answer": [str(2 * i) for i in range(4)],
         "images": pics}, features=features,
    ).to_parquet(str(root / "geo.parquet"))  # fmt: skip
    return root / "geo.parquet"


def paths(tiny_models, data: Path) -> dict[str, str]:
    return {
        "data.train_files": str(data),
        "data.val_files": str(data),
        "worker.actor.model.model_path": str(tiny_models["qwen2_5_vl"]),
        "data.format_prompt": str(FIXTURES / "math.jinja"),
        "worker.reward.reward_function": f"{FIXTURES / 'math.py'}:compute_score",
    }


def run(argv: list[str]):
    from vlm_grpo.grpo_jsonl import main, parse_args

    return main(*parse_args(argv))


def test_every_key_of_the_example_config_is_mapped_or_ignored_with_its_reason():
    config = yaml.safe_load(CONFIG.read_text())
    flags, notes = convert(config)
    assert flags["advantage_estimator"] == "grpo" and flags["beta"] == 0.01
    assert flags["lr_scheduler_type"] == "constant_with_warmup"  # EasyR1's constant schedule, not TRL's linear
    assert flags["epsilon"] == 0.2 and flags["epsilon_high"] == 0.3  # EasyR1's default clip_ratio_high
    assert "warmup_steps" not in flags  # lr_warmup_ratio 0.0
    assert flags["eval_on_start"] is True and flags["eval_steps"] == 5
    ignored = [n for n in notes if n.startswith("ignored: ")]
    for note in ignored:
        key = note.removeprefix("ignored: ").split("=")[0]
        assert ignore_reason(key) or "changes nothing" in note, note
    assert any("worker.ref.offload.offload_params" in n for n in ignored)


def test_an_unknown_key_or_override_is_an_error():
    with pytest.raises(UserError, match=r"unknown EasyR1 key worker\.actor\.optim\.lr_warmup_ratioo"):
        easyr1_argv([f"config={CONFIG}", "worker.actor.optim.lr_warmup_ratioo=0.1"])


def test_a_null_typo_is_an_error_too(tmp_path):
    path = tmp_path / "e.yaml"
    path.write_text(CONFIG.read_text() + "  max_stepz: null\n")  # under trainer:, the file's last section
    with pytest.raises(UserError, match=r"unknown EasyR1 key trainer\.max_stepz"):
        easyr1_argv([f"config={path}"])


def test_easyr1_overrides_with_a_vlm_grpo_config_are_an_error(tmp_path):
    ours = tmp_path / "ours.yaml"
    ours.write_text("learning_rate: 1.0e-6\n")
    with pytest.raises(UserError, match="apply to an EasyR1 config"):
        easyr1_argv(["--config", str(ours), "worker.rollout.n=8"])
    assert easyr1_argv(["--config", str(ours), "--seed", "1"]) == ["--config", str(ours), "--seed", "1"]


def test_overrides_win_and_values_read_as_omegaconf_does():
    argv = easyr1_argv([f"config={CONFIG}", "worker.rollout.n=8", "worker.actor.optim.lr=1e-5",
                        "algorithm.online_filtering=True", "--seed", "3"])  # fmt: skip
    assert argv[0] == "--config" and argv[2:] == ["--seed", "3"]
    flags = yaml.safe_load(Path(argv[1]).read_text())
    assert flags["num_generations"] == 8 and flags["learning_rate"] == 1e-5 and flags["dynamic_sampling"] is True


def test_the_reinforce_script_is_refused_for_its_kl_in_the_reward_unless_accepted(tiny_models, easyr1_data):
    line = script_overrides("qwen2_5_vl_7b_geo3k_reinforce.sh", paths(tiny_models, easyr1_data))
    with pytest.raises(UserError, match=r"use_kl_loss=false with kl_coef=0.001.*--accept_easyr1_differences"):
        easyr1_argv(line)
    flags = yaml.safe_load(Path(easyr1_argv([*line, "--accept_easyr1_differences"])[1]).read_text())
    assert flags["advantage_estimator"] == "reinforce_plus_plus" and flags["beta"] == 0.0


def test_gae_is_an_error_even_when_differences_are_accepted():
    with pytest.raises(UserError, match=r"algorithm\.adv_estimator=gae: GAE needs a value model \(a critic\)"):
        easyr1_argv([f"config={CONFIG}", "algorithm.adv_estimator=gae", "--accept_easyr1_differences"])


@pytest.mark.parametrize("name", ["rloo", "remax", "reinforce_plus_plus"])
def test_other_estimators_map_to_ours_not_to_grpo(name):
    flags = yaml.safe_load(Path(easyr1_argv([f"config={CONFIG}", f"algorithm.adv_estimator={name}"])[1]).read_text())
    assert flags["advantage_estimator"] == name


def test_warmup_ratio_means_a_ratio_of_the_total_steps():
    from vlm_grpo.grpo_jsonl import parse_args

    _, training, _ = parse_args([f"config={CONFIG}", "worker.actor.optim.lr_warmup_ratio=0.1", "--output_dir", "x"])
    assert training.warmup_steps == 0.1 and training.get_warmup_steps(200) == 20
    _, training, _ = parse_args(["--warmup_ratio", "0.03", "--output_dir", "x"])
    assert training.get_warmup_steps(100) == 3
    with pytest.raises(SystemExit, match=r"warmup_ratio 1\.5"):
        parse_args(["--warmup_ratio", "1.5", "--output_dir", "x"])


def test_reward_function_kwargs_reach_the_reward():
    from vlm_grpo.grpo_jsonl import parse_args
    from vlm_grpo.rewards import build_reward_funcs

    script, _, _ = parse_args([f"config={CONFIG}", "worker.reward.reward_function_kwargs={format_weight: 0.5}",
                               f"worker.reward.reward_function={FIXTURES / 'math.py'}:compute_score",
                               "--output_dir", "x"])  # fmt: skip
    (reward,) = build_reward_funcs(script.reward_funcs, reward_kwargs=script.reward_kwargs)
    inputs = ["<think>x</think> \\boxed{3}", "no"]
    assert reward(inputs, solution=["3", "3"]) == [1.0, 0.0]
    assert reward.last_outputs[0] == {"overall": 1.0, "format": 1.0, "accuracy": 1.0}
    assert reward(["<think>x</think> \\boxed{4}"], solution=["3"]) == [0.5]  # format_weight 0.5, not 0.1


def test_filter_key_names_a_key_of_the_dict_the_reward_returns():
    reward = SimpleNamespace(last_outputs=[{"overall": 0.9, "accuracy": 1.0}, {"overall": 0.1, "accuracy": 0.0}])
    other = SimpleNamespace(last_outputs=[{"accuracy": 0.5}, {}])
    trainer = SimpleNamespace(args=SimpleNamespace(filter_key="accuracy"), reward_func_names=["math"],
                              reward_funcs=[reward])  # fmt: skip
    column = DynamicSamplingMixin._filter_column(trainer, 2)
    assert column.tolist() == [1.0, 0.0]
    trainer.args.filter_key = "overall"  # the weighted sum of the rewards
    assert DynamicSamplingMixin._filter_column(trainer, 2) is None
    trainer.reward_func_names, trainer.reward_funcs = ["math", "b"], [reward, other]
    trainer.args.filter_key = "accuracy"
    with pytest.raises(ValueError, match="several rewards return it"):
        DynamicSamplingMixin._filter_column(trainer, 2)
    trainer.args.filter_key = "b/accuracy"
    assert torch.equal(DynamicSamplingMixin._filter_column(trainer, 2).isnan(), torch.tensor([False, True]))
    trainer.args.filter_key = "acuracy"
    with pytest.raises(ValueError, match=r"no reward returned it.*math/accuracy"):
        DynamicSamplingMixin._filter_column(trainer, 2)


def test_a_math_py_plugin_does_not_shadow_the_stdlib(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "math.py").write_text((FIXTURES / "math.py").read_text())
    import math

    fn = load_object("math.py:compute_score")
    assert sys.modules["math"] is math and math.sqrt(4) == 2.0
    assert fn([{"response": "<think>a</think> \\boxed{2}", "ground_truth": "2"}])[0]["overall"] == 1.0


@pytest.mark.slow  # a subprocess: python -m with a math.py in the working directory
def test_a_plugin_whose_import_fails_is_one_error_line(tmp_path, tiny_models):
    plugin = tmp_path / "math.py"
    plugin.write_text("from mathruler_not_installed.grader import grade_answer\n")
    with pytest.raises(PluginImportError, match=r"math.py: cannot import mathruler_not_installed \(pip install"):
        load_object(f"{plugin}:compute_score")
    missing = tmp_path / "needs_pylatexenc.py"
    # as if pylatexenc were not installed
    missing.write_text("raise ModuleNotFoundError(\"No module named 'pylatexenc'\", name='pylatexenc')\n")
    with pytest.raises(PluginImportError, match=r"cannot import pylatexenc .*vlm-grpo\[easyr1\]"):
        load_object(f"{missing}:fn")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src"), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "vlm_grpo.grpo_jsonl", "--reward_funcs", f"{plugin}:compute_score",
            "--model_name_or_path", str(tiny_models["qwen2_5_vl"]), "--output_dir", str(tmp_path / "o")]  # fmt: skip
    result = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert "math.py: cannot import mathruler_not_installed (pip install mathruler_not_installed" in errors[0]


@pytest.mark.usefixtures("one_torch_thread")
def test_the_example_config_with_the_grpo_script_line_trains(tiny_models, easyr1_data, tmp_path):
    line = script_overrides("qwen2_5_vl_3b_geo3k_grpo.sh", paths(tiny_models, easyr1_data))
    assert "trainer.n_gpus_per_node=2" in line and "trainer.experiment_name=qwen2_5_vl_3b_geo_grpo" in line
    trainer = run([*line, *TINY_SIZES, "--output_dir", str(tmp_path / "out"), "--report_to", "none",
                   "--eval_strategy", "no", "--save_strategy", "no", "--dataloader_num_workers", "0"])  # fmt: skip
    assert trainer.state.global_step == 1 and trainer.num_generations == 2
    assert trainer.eval_dataset is None  # data.val_files not loaded with --eval_strategy no
    logged = trainer.state.log_history[0]
    assert {"rewards/compute_score/accuracy", "rewards/compute_score/format", "reward"} <= set(logged)
    # EasyR1's names for the same numbers
    assert {"reward/overall", "reward/accuracy", "reward/format"} <= set(logged)
    assert logged["reward/accuracy"] == logged["rewards/compute_score/accuracy"]
    assert logged["reward/overall"] == pytest.approx(logged["rewards/compute_score/mean"])


@pytest.mark.usefixtures("one_torch_thread")
def test_the_reinforce_script_line_trains_with_reinforce_plus_plus(tiny_models, easyr1_data, tmp_path):
    line = script_overrides("qwen2_5_vl_7b_geo3k_reinforce.sh", paths(tiny_models, easyr1_data))
    trainer = run([*line, *TINY_SIZES, "trainer.max_steps=2", "--accept_easyr1_differences", "--output_dir",
                   str(tmp_path / "out"), "--report_to", "none", "--eval_strategy", "no", "--save_strategy", "no",
                   "--dataloader_num_workers", "0"])  # fmt: skip
    assert trainer.state.global_step == 2 and trainer.args.advantage_estimator == "reinforce_plus_plus"


def test_easyr1_metric_names_only_when_the_run_has_one_reward():
    from vlm_grpo.rewards import build_reward_funcs

    spec = f"{FIXTURES / 'math.py'}:compute_score"
    (single,) = build_reward_funcs([spec])
    assert single.easyr1_metric_names
    logged: dict[str, float] = {}
    single(["<think>a</think> \\boxed{2}", "x"], solution=["2", "2"], log_metric=logged.__setitem__)
    assert logged["reward/overall"] == pytest.approx(0.5) and logged["reward/format"] == 0.5
    assert logged["reward/accuracy"] == logged["rewards/compute_score/accuracy"] == 0.5
    two = build_reward_funcs([spec, "format"])  # two rewards' "reward/accuracy" would be ambiguous
    assert not any(f.easyr1_metric_names for f in two)


def test_the_guide_lists_every_key_the_converter_knows():
    from vlm_grpo.convert_config import DEFAULTS, DIRECT
    from vlm_grpo.easyr1_keys import IGNORED, REFUSED_UNLESS

    guide = (Path(__file__).parents[1] / "docs" / "guides" / "easyr1.md").read_text()
    missing = [key for key in [*DIRECT, *DEFAULTS, *IGNORED, *REFUSED_UNLESS] if f"`{key}`" not in guide]
    assert missing == []


def test_val_files_are_not_read_with_eval_strategy_no(tmp_path, easyr1_data):
    from vlm_grpo.grpo_jsonl import parse_args
    from vlm_grpo.recipe import preflight

    line = [f"config={CONFIG}", f"data.train_files={easyr1_data}", "data.val_files=missing.parquet",
            "--output_dir", str(tmp_path / "o")]  # fmt: skip
    script, _, _ = parse_args(line)
    assert script.eval_file_paths == "missing.parquet"  # control: the config names it
    script, training, _ = parse_args([*line, "--eval_strategy", "no"])
    preflight(script, training)  # a missing evaluation file would be an error here if it were read
    assert script.eval_file_paths is None and not training.eval_on_start


def test_a_converted_yaml_naming_absent_val_files_starts_with_eval_strategy_no(tmp_path, easyr1_data, monkeypatch):
    """The YAML vlm-grpo-convert-config writes names the eval files; a run that never evaluates neither checks
    nor reads them (control: the same YAML evaluating fails on the absent file before any model load)."""
    from vlm_grpo import recipe
    from vlm_grpo.grpo_jsonl import parse_args

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"data_file_paths": str(easyr1_data), "eval_file_paths": "absent.parquet",
                                      "eval_strategy": "steps", "eval_steps": 5}))  # fmt: skip
    line = ["--config", str(config), "--output_dir", str(tmp_path / "o")]
    script, training, _ = parse_args(line)
    with pytest.raises(UserError, match=r"absent\.parquet"):
        recipe.preflight(script, training)
    script, training, _ = parse_args([*line, "--eval_strategy", "no"])
    assert script.eval_file_paths == "absent.parquet" and not recipe.evaluates(training)
    recipe.preflight(script, training)
    read = []
    monkeypatch.setattr(recipe, "load_checked_rows", lambda *a, data_file_paths=None: read.append(data_file_paths))
    monkeypatch.setattr(recipe, "to_datasets", lambda rows, module, *a: ("train", None))
    assert recipe.load_datasets(script, None, None, 0, recipe.evaluates(training)) == ("train", None)
    assert read == [None]  # the training files only
    read.clear()
    recipe.load_datasets(script, None, None, 0, True)  # control: an evaluating run reads them
    assert read == [None, "absent.parquet"]


def test_sft_reads_warmup_ratio_too():
    from vlm_grpo.sft_jsonl import parse_args

    _, training, _ = parse_args(["--warmup_ratio", "0.03", "--output_dir", "x", "--model_name_or_path", "m"])
    assert training.warmup_steps == 0.03 and training.get_warmup_steps(1000) == 30
