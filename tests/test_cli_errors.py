"""User errors end as `error: ...` with exit status 2 and no traceback, found before anything slow runs;
bugs keep their traceback; VLM-R1 command lines (bare boolean flags) parse."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from e2e_utils import base_args, make_dataset
from vlm_grpo.cli_errors import UserError, is_user_error, run_cli
from vlm_grpo.grpo_jsonl import cli, parse_args
from vlm_grpo.resume import mark_complete


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("cli_data"), kinds=("single",), n=2)


def _fails(argv, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        cli(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert "Traceback" not in err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    return line


def _args(dataset, tmp_path, model="no/such/model"):
    """A model path that does not exist: the checks below must all fire before any model is looked at."""
    data, plugin = dataset
    return base_args(model, data, plugin, tmp_path / "out")


def test_output_dir_that_is_a_file(dataset, tmp_path, capsys):
    argv = _args(dataset, tmp_path)
    (tmp_path / "taken").write_text("x")
    argv[argv.index("--output_dir") + 1] = str(tmp_path / "taken")
    assert "is a file, not a folder" in _fails(argv, capsys)


def test_report_to_an_integration_that_is_not_installed(dataset, tmp_path, capsys):
    missing = next(n for n in ("wandb", "mlflow", "clearml", "swanlab") if importlib.util.find_spec(n) is None)
    argv = _args(dataset, tmp_path)
    argv[argv.index("--report_to") + 1] = missing
    line = _fails(argv, capsys)
    assert f"--report_to {missing}" in line and f"pip install {missing}" in line and "--report_to none" in line


def test_deepspeed_config_missing_or_broken(dataset, tmp_path, capsys):
    assert "no such file" in _fails([*_args(dataset, tmp_path), "--deepspeed", str(tmp_path / "z.json")], capsys)
    (tmp_path / "bad.json").write_text("{'zero_optimization': ")
    line = _fails([*_args(dataset, tmp_path), "--deepspeed", str(tmp_path / "bad.json")], capsys)
    assert "bad.json: not valid JSON" in line


@pytest.mark.parametrize("flag", ["--keep_decode_graphs", "--compile_layers"])
def test_speed_settings_zero3_refuses_are_named_before_the_model_load(flag, dataset, tmp_path, capsys):
    """Both are refused under ZeRO-3 when set to true; said from the flags, before the (missing) model is looked
    at. Unset, the same command gets past them to the model (the control)."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    zero3 = str(Path(__file__).resolve().parents[1] / "local_scripts" / "zero3.json")
    try:
        line = _fails([*_args(dataset, tmp_path), "--deepspeed", zero3, flag, "true"], capsys)
        assert f"{flag[2:]}=True does not work with DeepSpeed ZeRO-3" in line and f"{flag[2:]}=False" in line
        assert "no/such/model" in _fails([*_args(dataset, tmp_path), "--deepspeed", zero3], capsys)
    finally:
        unset_hf_deepspeed_config()  # the parsed --deepspeed sets transformers' process-wide ZeRO-3 switch


def test_missing_data_file(dataset, tmp_path, capsys):
    argv = _args(dataset, tmp_path)
    argv[argv.index("--data_file_paths") + 1] = str(tmp_path / "nope.jsonl")
    assert "nope.jsonl' does not exist" in _fails(argv, capsys)


def test_misspelled_reward_is_named_before_the_data_is_checked(dataset, tiny_models, tmp_path, capsys):
    data, plugin = dataset
    bad_data = tmp_path / "bad.jsonl"
    bad_data.write_text(data.read_text() + "{not json\n")  # the data check would stop on line 3
    argv = base_args(tiny_models["qwen2_vl"], bad_data, plugin, tmp_path / "out")
    argv[argv.index("--image_folders") + 1] = str(data.parent / "images")
    argv[argv.index("format")] = "fromat"
    line = _fails(argv, capsys)
    assert "Unknown reward 'fromat'" in line and "format" in line


def test_broken_checkpoint_asked_for_by_path(dataset, tmp_path, capsys):
    out = tmp_path / "out"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    (out / "checkpoint-2" / "model.safetensors").write_bytes(b"")
    mark_complete(out / "checkpoint-2")
    (out / "checkpoint-4").mkdir()
    line = _fails([*_args(dataset, tmp_path), "--resume_from_checkpoint", str(out / "checkpoint-4")], capsys)
    assert "checkpoint-4 is empty" in line or "checkpoint-4 has no" in line
    assert f"newest complete checkpoint beside it is {out / 'checkpoint-2'}" in line


def test_bare_debug_shows_the_traceback(dataset, tmp_path):
    argv = _args(dataset, tmp_path)
    argv[argv.index("--data_file_paths") + 1] = str(tmp_path / "nope.jsonl")
    with pytest.raises(UserError, match="does not exist"):
        cli([*argv, "--debug"])


def test_bugs_keep_their_traceback():
    def buggy(args):
        return int("not a number")  # a ValueError raised outside vlm_grpo: a bug, not the user's input

    with pytest.raises(ValueError, match="invalid literal"):
        run_cli(buggy, [])
    with pytest.raises(TypeError):
        run_cli(lambda args: len(None), [])
    assert is_user_error(FileNotFoundError("x")) and is_user_error(UserError("x"))


def test_bare_boolean_flags_mean_true(tmp_path):
    # VLM-R1 scripts pass --bf16 bare; it is `bool | None` in TrainingArguments, so argparse wanted a value.
    argv = ["--model_name_or_path", "m", "--output_dir", str(tmp_path), "--bf16", "--gradient_checkpointing",
            "--use_peft", "--freeze_vision_modules", "--skip_bad_rows", "--disable_tqdm",
            "--logging_steps", "1"]  # fmt: skip
    script_args, training_args, model_args = parse_args(argv)
    assert training_args.bf16 and training_args.gradient_checkpointing and training_args.disable_tqdm
    assert model_args.use_peft and model_args.freeze_vision_modules and script_args.skip_bad_rows
    assert training_args.logging_steps == 1
    # negative control: an explicit false still means false
    _, training_args, model_args = parse_args([*argv[:4], "--bf16", "false", "--use_peft", "false"])
    assert training_args.bf16 is False and model_args.use_peft is False


def test_help_is_served_without_importing_torch_the_second_time(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "src" / "vlm_grpo" / "grpo_jsonl.py"
    env = {**__import__("os").environ, "XDG_CACHE_HOME": str(tmp_path)}
    runs = [
        subprocess.run([sys.executable, "-X", "importtime", str(script), "--help"], capture_output=True, text=True,
                       timeout=120, env=env, cwd=tmp_path)
        for _ in range(2)
    ]  # fmt: skip
    first, second = runs
    assert first.returncode == second.returncode == 0, first.stderr[-2000:]
    assert "--data_file_paths" in first.stdout and second.stdout == first.stdout
    imported = lambda run: {line.split("|")[-1].strip() for line in run.stderr.splitlines() if "|" in line}  # noqa: E731
    assert "torch" in imported(first)  # built the help: the configs need torch, TRL, transformers
    assert "torch" not in imported(second) and "trl" not in imported(second)


def test_missing_model_folder(dataset, tmp_path, capsys):
    line = _fails(_args(dataset, tmp_path, model=str(tmp_path / "no_model")), capsys)
    assert f"--model_name_or_path {tmp_path / 'no_model'}: no such folder" in line


def test_a_reward_that_raises_on_every_sample_stops_the_run_naming_it(dataset, tiny_models, tmp_path, capsys):
    """Hours of GPU time with all rewards None must not end in exit status 0."""
    data, _ = dataset
    broken = tmp_path / "broken_reward.py"
    broken.write_text("def score(completions, answer_key, **kwargs):\n    return [1.0] * len(completions)\n")
    argv = base_args(tiny_models["qwen2_vl"], data, broken, tmp_path / "out")
    i = argv.index("--reward_funcs")
    argv[i + 1 : i + 3] = [f"{broken}:score"]
    line = _fails(argv, capsys)
    assert "reward 'score' raised on every sample of its first batch" in line
    assert "answer_key" in line and "--reward_kwargs" in line  # the exception and the likely fix


def test_unknown_flags_say_what_to_pass_instead(dataset, tmp_path, capsys):
    """Another project's flag names its replacement, a typo gets the nearest flag, a stray value says so."""
    argv = _args(dataset, tmp_path)
    line = _fails([*argv, "--image_root", "coco/"], capsys)
    assert line.startswith("error: unknown flag --image_root:") and "--image_folders DIR" in line
    assert "did you mean --learning_rate?" in _fails([*argv, "--learnig_rate", "1e-6"], capsys)
    assert "no such flag" in _fails([*argv, "--zzz_not_a_flag", "1"], capsys)
    assert "unexpected values ['stray']" in _fails([*argv, "stray"], capsys)
    config = tmp_path / "run.yaml"  # a YAML key is not rewritten as its command-line alias is: say what to write
    config.write_text("torch_dtype: bfloat16\nlearnig_rate: 1.0e-6\n")
    line = _fails([*argv, "--config", str(config)], capsys)
    assert "unknown key in the --config file: torch_dtype: write dtype:" in line
    assert "learnig_rate: did you mean --learning_rate?" in line


def test_dataset_name_is_never_silently_taken_for_data(dataset, tmp_path, capsys, caplog):
    """VLM-R1's grpo_rec.py passed its data config as --dataset_name: without --data_file_paths that is an error
    saying what to pass; beside it (VLM-R1's grpo_jsonl.py scripts: `this_is_not_used`) a logged no-op."""
    argv = _args(dataset, tmp_path)
    i = argv.index("--data_file_paths")
    without_data = argv[:i] + argv[i + 2 :]
    line = _fails([*without_data, "--dataset_name", "data_config/rec.yaml"], capsys)
    assert "--dataset_name data_config/rec.yaml: not read here" in line and "--data_file_paths" in line
    with caplog.at_level("INFO", logger="vlm_grpo"):
        assert "no/such/model" in _fails([*argv, "--dataset-name", "this_is_not_used"], capsys)  # got past it
    assert "--dataset_name this_is_not_used is not read" in caplog.text
