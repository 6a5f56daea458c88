"""Training curves as a PNG, from a run's ``trainer_state.json`` log history (GRPO or SFT).

    vlm-grpo-plot RUN_DIR [--out RUN_DIR/curves.png] [--title TEXT]
    python -m vlm_grpo.plot RUN_DIR

``RUN_DIR`` is a run's output folder (its ``trainer_state.json``, or else the newest ``checkpoint-*``'s) or a
``trainer_state.json`` file. One panel per quantity the run logged, against the optimizer step: GRPO runs get
reward (total and per reward function), accuracy-like rewards (every reward but format / shaping ones), entropy,
KL (when beta > 0), completion length and ``frac_reward_zero_std``; SFT runs get loss, token accuracy and
entropy. Drawn with matplotlib's Agg canvas (no display needed). The recipes call :func:`plot_run` at the end
of a run unless ``--plot false``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger("vlm_grpo")

# Rewards that shape the output rather than score the task; left out of the accuracy panel.
SHAPING_REWARDS = re.compile(r"^(format.*|length|repetition|overlong|one_sentence)$")
REWARD_MEAN = re.compile(r"^rewards/(.+)/mean$")


def _series(history: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of ``key`` over the log history; NaN / None entries skipped."""
    steps, values = [], []
    for entry in history:
        value = entry.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value) and "step" in entry:
            steps.append(entry["step"])
            values.append(float(value))
    return steps, values


def panels(history: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """The panels worth drawing for this history: (title, y label, [(legend label, log key), ...])."""
    keys = {k for entry in history for k in entry}
    rewards = sorted(m.group(1) for k in keys if (m := REWARD_MEAN.match(k)))
    per_reward = [(r, f"rewards/{r}/mean") for r in rewards]
    task = [(r, key) for r, key in per_reward if not SHAPING_REWARDS.match(r)]
    token_accuracy = [("train", "mean_token_accuracy"), ("eval", "eval_mean_token_accuracy")]
    wanted: list[tuple[str, str, list[tuple[str, str]]]] = [
        # one reward: the total is that reward, drawn once
        ("Reward (training samples)", "mean reward", [("total", "reward"), *(per_reward if len(rewards) > 1 else [])]),
        ("Accuracy-like rewards (training samples)", "mean reward", task),
        ("Loss", "loss", [("train", "loss"), ("eval", "eval_loss")]),
        ("Token accuracy", "mean token accuracy", token_accuracy),
        ("Entropy of the policy", "nats per token", [("entropy", "entropy")]),
        ("KL to the reference model", "KL", [("kl", "kl")]),
        ("Completion length", "tokens", [("mean", "completions/mean_length"), ("max", "completions/max_length")]),
        (
            "frac_reward_zero_std: groups with one reward",
            "fraction of groups",
            [("frac_reward_zero_std", "frac_reward_zero_std")],
        ),
    ]
    out = []
    for title, ylabel, lines in wanted:
        lines = [(label, key) for label, key in lines if _series(history, key)[0]]
        if title.startswith("Loss") and rewards:
            continue  # GRPO's loss is a surrogate with no level to read; the reward panels say more
        if title.startswith("KL") and not any(v != 0 for v in _series(history, "kl")[1]):
            continue  # beta = 0: TRL logs no KL (or zeros)
        if lines:
            out.append((title, ylabel, lines))
    return out


def _moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_run(
    history: Sequence[Mapping[str, Any]],
    out: str | Path,
    title: str | None = None,
    markers: Mapping[str, Sequence[tuple[float, float]]] | None = None,
) -> Path:
    """Write the curves of ``history`` (``trainer.state.log_history``) to the PNG ``out``; returns its path.

    ``markers`` adds labelled points to the accuracy panel (or the token accuracy panel), e.g. held-out greedy
    accuracy before and after training: ``{"held-out greedy accuracy": [(0, 0.5), (120, 0.9)]}``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    chosen = panels(history)
    if not chosen:
        raise ValueError("the log history holds no step with a loss, reward or accuracy to plot")
    ncols = 3 if len(chosen) > 4 else 2 if len(chosen) > 1 else 1
    nrows = math.ceil(len(chosen) / ncols)
    fig = Figure(figsize=(4.6 * ncols, 3.3 * nrows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    marker_panel = next((i for i, (t, _, _) in enumerate(chosen) if "ccuracy" in t), None)
    for i, (panel_title, ylabel, lines) in enumerate(chosen):
        ax = axes[i]
        for label, key in lines:
            steps, values = _series(history, key)
            if len(steps) < 30:
                ax.plot(steps, values, label=label, marker=".", linewidth=1.4)
            else:  # noisy per-step values faint, their moving average bold
                (raw,) = ax.plot(steps, values, linewidth=0.8, alpha=0.3)
                window = max(3, len(steps) // 15)
                ax.plot(steps, _moving_average(values, window), color=raw.get_color(), linewidth=1.8, label=label)
        if i == marker_panel and markers:
            for label, points in markers.items():
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, "o", color="black", label=label, markersize=7, zorder=5)
                for x, y in points:
                    right = x > (min(xs) + max(xs)) / 2
                    ax.annotate(
                        f"{y:.3f}", (x, y), textcoords="offset points", xytext=(-30 if right else 6, -14), fontsize=9
                    )
        ax.set_title(panel_title, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if "ccuracy" in panel_title or panel_title.startswith("frac_"):
            ax.set_ylim(-0.03, 1.06)
        if len([line for line in ax.get_lines() if not line.get_label().startswith("_")]) > 1:
            ax.legend(fontsize=8)
    for ax in axes[len(chosen) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=12)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out


def finish_run(trainer: Any, output_dir: str | Path, plot: bool) -> None:
    """End of a recipe run: ``trainer_state.json`` in ``output_dir`` (so ``vlm-grpo-plot`` finds the whole
    history) and, with ``plot``, ``output_dir/curves.png``. A failed plot is logged, the trained run kept."""
    trainer.save_state()
    if not plot or not trainer.is_world_process_zero():
        return
    try:
        path = plot_run(trainer.state.log_history, Path(output_dir) / "curves.png", title=str(output_dir))
    except Exception as exc:  # the model is saved; a plot must not turn a finished run into a failure
        logger.warning("Could not plot the training curves (%s: %s); the run is complete", type(exc).__name__, exc)
        return
    logger.info("Training curves: %s", path)
    print(f"[vlm-grpo] training curves: {path}", flush=True)


def find_state(run_dir: str | Path) -> Path:
    """``trainer_state.json`` of a run folder (or of its newest ``checkpoint-N``), or the file itself."""
    path = Path(run_dir)
    if path.is_file():
        return path
    if (path / "trainer_state.json").is_file():
        return path / "trainer_state.json"
    numbered = [p for p in path.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()]
    checkpoints = sorted((p for p in numbered if (p / "trainer_state.json").is_file()), key=lambda p: int(p.name[11:]))
    if checkpoints:
        return checkpoints[-1] / "trainer_state.json"
    raise FileNotFoundError(
        f"no trainer_state.json in {path} or its checkpoint-* folders: pass a run's output_dir (runs finished by "
        "vlm-grpo / vlm-grpo-sft write one there) or the path of a trainer_state.json"
    )


def read_history(state: Path) -> list[dict]:
    """The ``log_history`` of a ``trainer_state.json``; any other file is named as not one."""
    try:
        content = json.loads(state.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{state}: not a trainer_state.json (not one JSON object: {exc})") from None
    if not isinstance(content, dict):
        raise ValueError(f"{state}: not a trainer_state.json (a JSON {type(content).__name__}, not an object)")
    return content.get("log_history", [])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vlm-grpo-plot", description="Plot a run's training curves as a PNG.")
    parser.add_argument("run_dir", help="a run's output_dir, a checkpoint folder, or a trainer_state.json")
    parser.add_argument("--out", default=None, help="PNG to write (default: RUN_DIR/curves.png)")
    parser.add_argument("--title", default=None, help="figure title (default: the run folder)")
    args = parser.parse_args(argv)
    try:
        state = find_state(args.run_dir)
        history = read_history(state)
        folder = Path(args.run_dir) if Path(args.run_dir).is_dir() else state.parent
        out = plot_run(history, args.out or folder / "curves.png", title=args.title or str(folder))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"[vlm-grpo-plot] {out}")
    return 0


def cli() -> None:
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
