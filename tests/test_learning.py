"""Training makes a model better at something a user can check: greedy accuracy on held-out rows of the colour
task (data/demo/colour), whose answer depends only on the image. A smaller ``make demo``, on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlm_grpo import demo, grpo_jsonl, plot, sft_jsonl
from vlm_grpo.testing.tiny import build_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[1]
SEED = 0
GRPO_STEPS = 100
MARGIN = 0.20  # what the demo claims; the SFT policy sits at 0.5 (wrong on red and blue shapes)


def recipe(out: Path, **overrides: object) -> object:
    argv = ["--out", str(out), "--data", str(ROOT / demo.DATA), "--seed", str(SEED), "--grpo_steps", str(GRPO_STEPS)]
    for key, value in overrides.items():
        argv += [f"--{key}", str(value)]
    return demo.parse_args(argv)


def accuracy(model: Path, out: Path) -> float:
    data = ROOT / demo.DATA
    return demo.held_out_accuracy(model, data / "val.jsonl", data / "images", out, SEED)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return build_tiny_model("qwen2_5_vl", tmp_path_factory.mktemp("learning") / "model", seed=SEED)


@pytest.fixture(scope="module")
def true_sft(base, tmp_path_factory) -> tuple[Path, object]:
    """The demo's first stage: SFT on the true answers (the model learns to read the colour)."""
    out = tmp_path_factory.mktemp("true_sft") / "sft"
    a = recipe(out.parent)
    trainer = sft_jsonl.main(*sft_jsonl.parse_args(demo.sft_argv(a, base, out, "train.jsonl", a.sft_true_steps)))
    return out, trainer


@pytest.fixture(scope="module")
def weak_sft(true_sft, tmp_path_factory) -> tuple[Path, float]:
    """The demo's starting point: then SFT on the weak labeller's rows; and its held-out greedy accuracy."""
    out = tmp_path_factory.mktemp("weak_sft")
    a = recipe(out)
    sft_jsonl.main(*sft_jsonl.parse_args(demo.sft_argv(a, true_sft[0], out / "sft", "sft.jsonl", a.sft_steps)))
    return out / "sft", accuracy(out / "sft", out / "eval")


def test_sft_on_true_labels_raises_held_out_accuracy(base, true_sft, tmp_path):
    """Held-out accuracy, not only the loss: from 0 (a random model names no colour) to well above the 0.25 of
    always naming one colour and the 0.5 of naming the right pair (warm / cool): the model reads the pixels."""
    model, trainer = true_sft
    before = accuracy(base, tmp_path / "eval_before")
    after = accuracy(model, tmp_path / "eval_after")
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses[-1] < losses[0]
    assert before == 0.0
    assert after >= 0.8, after
    # the end-of-run hook wrote the curves and the state vlm-grpo-plot reads
    assert (model / "curves.png").stat().st_size > 10_000
    assert json.loads((model / "trainer_state.json").read_text())["log_history"]


def test_grpo_lifts_held_out_accuracy_over_start_and_lr0_control(weak_sft, tmp_path):
    sft_model, start = weak_sft
    # the weak labels leave the policy clearly imperfect: it calls red shapes yellow and blue ones green
    assert 0.35 <= start <= 0.65, start

    runs = {}
    for name, lr, draw in (("grpo", demo.parse_args([]).grpo_lr, "true"), ("control", 0.0, "false")):
        argv = [*demo.grpo_argv(recipe(tmp_path, grpo_lr=lr), sft_model, tmp_path / name), "--plot", draw]
        trainer = grpo_jsonl.main(*grpo_jsonl.parse_args(argv))
        assert trainer.state.global_step == GRPO_STEPS
        runs[name] = accuracy(tmp_path / name, tmp_path / f"eval_{name}")
    # --plot (default true) drew the run's curves; --plot false did not; vlm-grpo-plot redraws from the run folder
    assert (tmp_path / "grpo" / "curves.png").stat().st_size > 10_000
    assert not (tmp_path / "control" / "curves.png").exists()
    assert plot.main([str(tmp_path / "control"), "--out", str(tmp_path / "control.png")]) == 0
    assert (tmp_path / "control.png").stat().st_size > 10_000
    # the control ran the same steps on the same samples and changed nothing: its accuracy is the start's
    assert runs["control"] == start
    assert runs["grpo"] - start >= MARGIN, (start, runs)
    assert runs["grpo"] - runs["control"] >= MARGIN, runs


def test_demo_without_its_data_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "train.jsonl").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--data", str(tmp_path), "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path} lacks sft.jsonl, val.jsonl") and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_demo_prints_the_promised_last_line_and_writes_curves(tmp_path, capsys):
    """What `make demo` is checked by, on a 2-step run: its last line parses, curves.png is a PNG."""
    import re

    from PIL import Image

    (tmp_path / "notes.txt").write_text("kept")  # --out may hold other files: only the demo's folders are replaced
    argv = ["--out", str(tmp_path), "--data", str(ROOT / demo.DATA), "--sft_true_steps", "2", "--sft_steps", "2"]
    demo.main([*argv, "--grpo_steps", "2"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(r"demo: held-out accuracy [01]\.\d{3} -> [01]\.\d{3} \(GRPO steps 2\)", last), last
    with Image.open(tmp_path / "curves.png") as im:
        assert im.format == "PNG"
    summary = json.loads((tmp_path / "summary.json").read_text())
    a0, a1 = summary["held_out_accuracy_sft"], summary["held_out_accuracy_grpo"]
    assert last.endswith(f"{a0:.3f} -> {a1:.3f} (GRPO steps 2)")
    assert (tmp_path / "notes.txt").read_text() == "kept"
