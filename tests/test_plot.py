"""vlm-grpo-plot: the panels a run's log history calls for, a valid PNG, and clear errors for a bad run folder."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from vlm_grpo.plot import find_state, main, panels, plot_run


def grpo_history(steps: int = 40, kl: float = 0.01) -> list[dict]:
    history = []
    for step in range(1, steps + 1):
        acc = step / steps
        history.append({
            "step": step, "loss": 0.01, "grad_norm": 0.5, "reward": acc + 0.5, "reward_std": 0.3,
            "rewards/accuracy/mean": acc, "rewards/accuracy/std": 0.4, "rewards/format/mean": 0.5,
            "rewards/iou/mean": float("nan"),  # a step where no row had a box
            "entropy": 1.0 - 0.5 * acc, "kl": kl * step, "completions/mean_length": 3.0,
            "completions/max_length": 4.0, "frac_reward_zero_std": 1.0 - acc,
        })  # fmt: skip
    history.append({"step": steps, "train_runtime": 12.0, "train_loss": 0.01})
    return history


def sft_history() -> list[dict]:
    return [
        {"step": s, "loss": 5.0 / s, "mean_token_accuracy": 0.1 * s, "entropy": 3.0 / s, "learning_rate": 1e-3}
        for s in range(1, 9)
    ]


def titles(history: list[dict]) -> list[str]:
    return [title for title, _, _ in panels(history)]


def keys(history: list[dict], title_start: str) -> list[str]:
    return next([key for _, key in lines] for title, _, lines in panels(history) if title.startswith(title_start))


def test_grpo_panels():
    history = grpo_history()
    assert titles(history) == [
        "Reward (training samples)",
        "Accuracy-like rewards (training samples)",
        "Entropy of the policy",
        "KL to the reference model",
        "Completion length",
        "frac_reward_zero_std: groups with one reward",
    ]
    # a reward logged only as NaN has nothing to draw; the format reward is not an accuracy
    assert keys(history, "Reward") == ["reward", "rewards/accuracy/mean", "rewards/format/mean"]
    assert keys(history, "Accuracy") == ["rewards/accuracy/mean"]


def test_kl_panel_only_when_beta_is_positive():
    assert "KL to the reference model" not in titles(grpo_history(kl=0.0))
    no_kl = [{k: v for k, v in e.items() if k != "kl"} for e in grpo_history()]
    assert "KL to the reference model" not in titles(no_kl)


def test_sft_panels():
    assert titles(sft_history()) == ["Loss", "Token accuracy", "Entropy of the policy"]


@pytest.mark.parametrize("history", [grpo_history(), sft_history()], ids=["grpo", "sft"])
def test_png_is_written(history, tmp_path):
    out = plot_run(history, tmp_path / "sub" / "curves.png", title="run", markers={"held-out": [(0, 0.2), (8, 0.9)]})
    with Image.open(out) as im:
        assert im.format == "PNG"
        width, height = im.size
        assert width >= 800 and height >= 300
        # not a blank canvas: lines and text were drawn
        assert len(im.convert("L").getcolors(1 << 16)) > 20


def test_empty_history_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="no step"):
        plot_run([{"step": 1, "train_runtime": 1.0}], tmp_path / "x.png")


def write_state(folder, history):
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"log_history": history}))


def test_cli_picks_the_newest_checkpoint(tmp_path, capsys):
    write_state(tmp_path / "checkpoint-9", sft_history()[:2])
    write_state(tmp_path / "checkpoint-10", sft_history())
    (tmp_path / "checkpoint-11").mkdir()  # no trainer_state.json: not a candidate
    assert find_state(tmp_path) == tmp_path / "checkpoint-10" / "trainer_state.json"
    assert main([str(tmp_path)]) == 0
    assert (tmp_path / "curves.png").is_file()
    assert str(tmp_path / "curves.png") in capsys.readouterr().out
    # the run folder's own trainer_state.json (written at the end of a run) wins over checkpoints
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": grpo_history()}))
    assert find_state(tmp_path) == tmp_path / "trainer_state.json"


@pytest.mark.parametrize(
    "content", [None, "{not json", json.dumps({"log_history": []}), "[1, 2]", '{"a": 1}\n{"b": 2}\n']
)
def test_cli_errors_are_one_line(content, tmp_path, capsys):
    if content is not None:
        (tmp_path / "trainer_state.json").write_text(content)
    assert main([str(tmp_path), "--out", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and err.count("\n") == 1
    assert not (tmp_path / "c.png").exists()


def test_a_file_that_is_not_a_trainer_state_is_named(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"  # a data file passed by mistake
    rows.write_text('{"image": "a.png"}\n{"image": "b.png"}\n')
    assert main([str(rows)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {rows}: not a trainer_state.json")


def test_single_reward_is_drawn_once():
    others = ("rewards/format", "rewards/iou")
    history = [{k: v for k, v in e.items() if not k.startswith(others)} for e in grpo_history()]
    assert keys(history, "Reward") == ["reward"]
    assert keys(history, "Accuracy") == ["rewards/accuracy/mean"]
