"""User errors end as `error: ...` with exit status 2 and no traceback, found before anything slow runs;
bugs keep their traceback; VLM-R1 command lines (bare boolean flags) parse."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_utils import base_args, make_dataset
from vlm_grpo.cli_errors import UserError, is_user_error, run_cli
from vlm_grpo.grpo_jsonl import cli, parse_args
from vlm_grpo.resume import mark_complete

SRC = Path(__file__).resolve().parents[1] / "src"


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


def test_an_ambiguous_or_partial_flag_is_one_line_naming_the_flags(dataset, tmp_path, capsys):
    """argparse printed the whole usage (hundreds of lines) for an ambiguous prefix, and silently took a unique
    one for the flag it starts; here both are unknown flags with the candidates, on one line."""
    argv = _args(dataset, tmp_path)
    line = _fails([*argv, "--num_generation", "4"], capsys)
    assert line.startswith("error: unknown flag --num_generation:")
    assert "--num_generations" in line and "--num_generations_eval" in line
    line = _fails([*argv, "--report", "wandb"], capsys)  # a unique prefix of --report_to: not taken for it
    assert "error: unknown flag --report:" in line
    line = _fails([*argv, "--max_steps"], capsys)  # argparse's own errors: one line too
    assert "--max_steps/--max-steps: expected one argument" in line


def test_the_usage_is_not_printed_for_a_flag_error(dataset, tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli([*_args(dataset, tmp_path), "--num_generation", "4"])
    captured = capsys.readouterr()
    assert "usage:" not in captured.err + captured.out
    assert len([ln for ln in captured.err.splitlines() if ln.strip()]) == 1


def test_a_fresh_run_into_a_folder_with_files_needs_overwrite_output_dir(dataset, tmp_path, capsys):
    """Another run's model or logs would be written over without a word; with the flag the run goes on (here to
    the missing model: the control that the check itself passed)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_text("an earlier run's model")
    line = _fails(_args(dataset, tmp_path), capsys)
    assert f"--output_dir {out} is not empty (model.safetensors)" in line and "--overwrite_output_dir" in line
    assert "no/such/model" in _fails([*_args(dataset, tmp_path), "--overwrite_output_dir"], capsys)
    assert (out / "model.safetensors").exists()
    (out / "model.safetensors").unlink()  # an empty folder is a fresh run's
    assert "no/such/model" in _fails(_args(dataset, tmp_path), capsys)


def test_a_fresh_sft_run_into_a_folder_with_files_needs_overwrite_output_dir(dataset, tmp_path, capsys):
    from vlm_grpo.sft_jsonl import cli as sft_cli

    data, _ = dataset
    out = tmp_path / "sft"
    out.mkdir()
    (out / "notes.txt").write_text("x")
    argv = ["--model_name_or_path", "no/such/model", "--data_file_paths", str(data), "--image_folders",
            str(data.parent / "images"), "--output_dir", str(out), "--report_to", "none"]  # fmt: skip
    with pytest.raises(SystemExit):
        sft_cli(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"--output_dir {out} is not empty (notes.txt)" in err


@pytest.fixture
def wandb_home(tmp_path):
    """Where wandb finds no API key (no ~/.netrc, no settings): the environment to set beside no WANDB_API_KEY."""
    if importlib.util.find_spec("wandb") is None:
        pytest.fail("wandb is needed: pip install 'vlm-grpo[wandb]'")
    home = tmp_path / "home"
    home.mkdir()
    return {"HOME": str(home), "WANDB_DIR": str(tmp_path), "WANDB_CONFIG_DIR": str(home / ".config" / "wandb")}


def test_wandb_without_a_key_is_one_warning_before_the_model_load(dataset, tmp_path, monkeypatch, capsys, wandb_home):
    """The warning comes with the cheap checks; WANDB_MODE=offline (the control) says so without a warning."""
    monkeypatch.delenv("WANDB_MODE", raising=False)  # restored after the test: the check sets it
    for name in [k for k in os.environ if k.startswith("WANDB_") or k in ("NETRC", "XDG_CONFIG_HOME")]:
        monkeypatch.delenv(name)
    for name, value in wandb_home.items():
        monkeypatch.setenv(name, value)
    argv = _args(dataset, tmp_path)
    argv[argv.index("--report_to") + 1] = "wandb"
    with pytest.raises(SystemExit):
        cli(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err and "no/such/model" in err  # got past the checks to the model
    (warning,) = [ln for ln in err.splitlines() if ln.startswith("warning:")]
    assert "--report_to wandb: no W&B API key" in warning and "logging offline" in warning
    assert os.environ["WANDB_MODE"] == "offline"
    with pytest.raises(SystemExit):
        cli(argv)
    assert "warning:" not in capsys.readouterr().err


@pytest.mark.slow
def test_wandb_without_a_key_is_one_warning_and_an_offline_run(dataset, tiny_models, tmp_path, wandb_home):
    """VLM-R1's scripts pass --report_to wandb: the first run on a machine where wandb is not logged in trains,
    logging offline, after one warning line (it stopped after the model load with wandb's traceback)."""
    data, plugin = dataset
    argv = base_args(tiny_models["qwen2_vl"], data, plugin, tmp_path / "out", steps=1)
    argv[argv.index("--report_to") + 1] = "wandb"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k not in ("NETRC", "XDG_CONFIG_HOME")}
    env.update(wandb_home, PYTHONPATH=str(SRC), OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-m", "vlm_grpo.grpo_jsonl", *argv], env=env, capture_output=True, text=True, timeout=600,
        cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    assert "Traceback" not in run.stderr
    (warning,) = [ln for ln in run.stderr.splitlines() if ln.startswith("warning:")]
    assert "--report_to wandb: no W&B API key" in warning and "offline" in warning and "wandb sync" in warning
    assert list((tmp_path / "wandb").glob("offline-run-*")), "the run logged nothing offline"


def test_a_malformed_wandb_key_is_an_error_before_the_model_load(dataset, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_API_KEY", "abc")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    argv = _args(dataset, tmp_path)
    argv[argv.index("--report_to") + 1] = "wandb"
    line = _fails(argv, capsys)
    assert line.startswith("error: --report_to wandb:") and "WANDB_API_KEY" in line


@pytest.mark.parametrize("module", ["vlm_grpo.grpo_jsonl", "vlm_grpo.sft_jsonl", "vlm_grpo.evaluate"])
def test_a_broken_or_missing_config_file_is_one_error_line(module, tmp_path, capsys, monkeypatch):
    """`--config` of a YAML with a syntax error, or of a path that is not there: the file and the line, no traceback
    (PyYAML's error went up as a traceback in vlm-grpo-sft and vlm-grpo-eval)."""
    import importlib

    entry = importlib.import_module(module).cli
    broken = tmp_path / "run.yaml"
    broken.write_text("learning_rate: 1.0e-6\nreward_funcs: [accuracy\n")
    for path, expected in (
        (broken, "not valid YAML: line 3, column 1: expected ','"),
        (tmp_path / "no.yaml", "cannot read it"),
    ):
        monkeypatch.setattr("sys.argv", ["prog", "--config", str(path)])
        with pytest.raises(SystemExit) as info:
            entry() if module == "vlm_grpo.evaluate" else entry(["--config", str(path)])
        err = capsys.readouterr().err
        assert info.value.code == 2 and "Traceback" not in err, err
        (line,) = [ln for ln in err.splitlines() if ln.strip()]
        assert line.startswith(f"error: --config {path}: {expected}"), line


def test_a_misspelt_flag_is_named_before_the_value_it_was_meant_to_set_is_checked(dataset, tmp_path, capsys):
    """`--num_genrations 4` with a batch of 4: TRL's own check (4 is not divisible by the default 8) spoke first and
    hid the typo; the unknown flag, or YAML key, is the error."""
    argv = _args(dataset, tmp_path)
    i = argv.index("--num_generations")
    del argv[i : i + 2]  # the default, 8, does not divide the batch of 4
    line = _fails([*argv, "--num_genrations", "4"], capsys)
    assert line.startswith("error: unknown flag --num_genrations: did you mean --num_generations")
    config = tmp_path / "run.yaml"
    config.write_text("num_genrations: 4\n")
    line = _fails([*argv, "--config", str(config)], capsys)
    assert "unknown key in the --config file: num_genrations: did you mean --num_generations" in line


def test_overwrite_output_dir_removes_the_old_checkpoints_only_once_every_check_passed(
    dataset, tiny_models, tmp_path, capsys
):
    """A misspelt reward (or a missing model, a bad row) found after the old run's checkpoints were removed cost
    them for nothing; they go only when the run really starts."""
    out = tmp_path / "out"
    old = out / "checkpoint-5"
    old.mkdir(parents=True)
    (old / "trainer_state.json").write_text('{"global_step": 5}')
    argv = [*_args(dataset, tmp_path, model=tiny_models["qwen2_vl"]), "--overwrite_output_dir", "--max_steps", "1"]
    i = argv.index("--reward_funcs")
    bad = [*argv[: i + 1], "accurcy", *argv[i + 3 :]]
    assert "Unknown reward 'accurcy'" in _fails(bad, capsys)
    assert old.is_dir()
    cli(argv)  # the same run with its rewards right: a fresh run, the old checkpoint gone
    assert not old.exists() and (out / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--reward_funcs", "iou"], "--reward_funcs"),
        (["--reward_kwargs", '{"iou": {"threshold": 0.7}}'], "--reward_kwargs"),
        (["--reward_max_failed_batches", "1"], "--reward_max_failed_batches"),
    ],
)
def test_sft_refuses_reward_flags_it_would_ignore(extra, named, dataset, tmp_path, capsys):
    """vlm-grpo-sft computes no rewards: a reward flag was silently dropped. The defaults (what a GRPO YAML or
    command line without reward flags gives) still pass, up to the missing model."""
    from vlm_grpo.sft_jsonl import cli as sft_cli

    data, _ = dataset
    argv = ["--model_name_or_path", "no/such/model", "--data_file_paths", str(data), "--image_folders",
            str(data.parent / "images"), "--output_dir", str(tmp_path / "sft"), "--report_to", "none"]  # fmt: skip
    refused = f"error: {named}: vlm-grpo-sft trains on the rows' solutions"
    defaults = [*argv, "--reward_funcs", "accuracy", "format"]
    for args, expected in (([*argv, *extra], refused), (defaults, "error: --model_name_or_path no/such/model")):
        with pytest.raises(SystemExit):
            sft_cli(args)
        err = capsys.readouterr().err
        assert "Traceback" not in err and expected in err, err
