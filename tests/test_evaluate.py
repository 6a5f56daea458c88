"""Evaluation: batched generation scored by registered rewards, predictions + summary, pass@k, adapters."""

from __future__ import annotations

import json

import pytest

from e2e_utils import make_dataset
from test_merge_lora import make_adapter
from vlm_grpo.evaluate import main as eval_main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("eval_data"), kinds=("single", "multi", "text"), n=2)


def eval_args(model, data, plugin, out, *extra):
    return [
        "--model_name_or_path", str(model),
        "--data_file_paths", str(data),
        "--image_folders", str(data.parent / "images"),
        "--reward_funcs", "accuracy", "format", f"{plugin}:flaky",
        "--output_dir", str(out),
        "--batch_size", "4",
        "--max_new_tokens", "4",
        "--progress", "false",
        *extra,
    ]  # fmt: skip


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sampled_pass_at_k_with_every_reward_per_task_and_failures(tiny_models, dataset, tmp_path):
    data, plugin = dataset
    rows = read_jsonl(data)
    for row in rows:  # task types to group by
        row["task_type"] = "vqa" if row["id"].startswith("text") else "counting"
    data = data.with_name("typed.jsonl")
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    out = tmp_path / "eval"
    summary = eval_main(eval_args(tiny_models["qwen2_5_vl"], data, plugin, out, "--num_samples", "2"))

    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["count"] == 6 and summary["samples"] == 12 and summary["num_samples"] == 2
    assert summary["generation"]["do_sample"] is True  # k > 1 samples
    assert set(summary["rewards"]) == {"accuracy", "format", "flaky"}
    for name, stats in summary["rewards"].items():
        assert {"mean", "scored", "missing", "pass@2"} <= set(stats), name
    # the flaky plugin raises on multi-image rows: those samples have no score and count as failures
    assert summary["rewards"]["flaky"]["scored"] == 8 and summary["rewards"]["flaky"]["missing"] == 4
    assert summary["rewards"]["flaky"]["mean"] == 1.0 and summary["rewards"]["flaky"]["pass@2"] == 1.0
    assert summary["failures"]["rewards"]["flaky"] > 0 and summary["failures"]["rewards"]["accuracy"] == 0
    assert summary["failures"]["generation"] == 0 and summary["failures"]["bad_rows"] == 0
    assert set(summary["per_task_type"]) == {"vqa", "counting"}
    assert summary["per_task_type"]["vqa"]["count"] == 2 and summary["per_task_type"]["counting"]["count"] == 4

    predictions = read_jsonl(out / "predictions.jsonl")
    assert [p["id"] for p in predictions] == [r["id"] for r in rows]
    for p in predictions:
        assert len(p["completions"]) == 2 and p["error"] is None
        assert set(p["rewards"]) == {"accuracy", "format", "flaky"}
        assert all(len(v) == 2 for v in p["rewards"].values())
        assert (p["rewards"]["flaky"] == [None, None]) is p["id"].startswith("multi")


def test_greedy_on_a_lora_adapter_matches_across_runs(tiny_models, dataset, tmp_path):
    data, plugin = dataset
    adapter = make_adapter(tiny_models["qwen2_5_vl"], tmp_path / "adapter")
    first = eval_main(eval_args(adapter, data, plugin, tmp_path / "a", "--max_samples", "3"))
    second = eval_main(eval_args(adapter, data, plugin, tmp_path / "b", "--max_samples", "3"))
    assert first["adapter"] is True and first["count"] == second["count"] == 3
    assert first["generation"]["do_sample"] is False
    assert "pass@1" in first["rewards"]["format"]
    completions = [p["completions"] for p in read_jsonl(tmp_path / "a" / "predictions.jsonl")]
    assert completions == [p["completions"] for p in read_jsonl(tmp_path / "b" / "predictions.jsonl")]
    assert all(len(c) == 1 for c in completions)


def test_bad_rows_stop_the_evaluation_unless_skipped(tiny_models, dataset, tmp_path):
    from vlm_grpo.data import DataValidationError

    data, plugin = dataset
    bad = data.with_name("bad.jsonl")
    bad.write_text(data.read_text().splitlines()[0] + "\n{not json\n")
    with pytest.raises(DataValidationError, match=r"bad\.jsonl:2"):
        eval_main(eval_args(tiny_models["qwen2_5_vl"], bad, plugin, tmp_path / "x"))
    summary = eval_main(eval_args(tiny_models["qwen2_5_vl"], bad, plugin, tmp_path / "y", "--skip_bad_rows", "true"))
    assert summary["count"] == 1 and summary["failures"]["bad_rows"] == 1


def test_help_lists_the_eval_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        eval_main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--num_samples", "--reward_funcs", "--batch_size", "--base_model", "--pass_threshold"):
        assert flag in out


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--bogus_flag"], "error: unknown flag --bogus_flag: no such flag"),
        (["--num_sample", "4"], "did you mean --num_samples"),
        (["--batch_size", "x"], "invalid int value: 'x'"),
    ],
)
def test_a_flag_error_is_one_error_line(argv, expected, monkeypatch, capsys):
    """An unknown, misspelt or badly typed flag ends as one `error:` line and status 2, not a traceback."""
    from vlm_grpo.evaluate import cli

    monkeypatch.setattr("sys.argv", ["vlm-grpo-eval", *argv])
    with pytest.raises(SystemExit) as exc:
        cli()
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err
    (line,) = [ln for ln in err.splitlines() if ln.strip()]
    assert line.startswith("error: ") and expected in line


def test_a_misspelt_reward_or_missing_data_is_reported_before_the_model_loads(tmp_path, dataset):
    """The model path does not exist: the error must be about the reward or the data, found first."""
    data, _ = dataset
    base = ["--model_name_or_path", str(tmp_path / "no_model"), "--output_dir", str(tmp_path / "out")]
    with pytest.raises(Exception, match=r"Unknown reward .accurcy."):
        eval_main([*base, "--data_file_paths", str(data), "--reward_funcs", "accurcy"])
    with pytest.raises(Exception, match=r"nope\.jsonl"):
        eval_main([*base, "--data_file_paths", str(tmp_path / "nope.jsonl"), "--reward_funcs", "accuracy"])
    with pytest.raises(ValueError, match=r"no_model: no such folder"):  # not the Hub's "Repo id must use ..."
        eval_main([*base, "--data_file_paths", str(data), "--reward_funcs", "accuracy"])
