"""--report_to tensorboard / wandb (offline) write the reward curves; a missing integration is refused first."""

from __future__ import annotations

import pytest

from e2e_utils import base_args, make_dataset
from vlm_grpo.grpo_jsonl import cli, main, parse_args

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_tensorboard_and_offline_wandb_hold_the_reward_curves(tiny_models, tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_root"))
    monkeypatch.setenv("WANDB_PROJECT", "vlm-grpo-test")
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb_root").mkdir()
    data, plugin = make_dataset(tmp_path / "data")
    out = tmp_path / "out"
    argv = base_args(tiny_models["qwen2_5_vl"], data, plugin, out)
    i = argv.index("--report_to")
    argv[i : i + 2] = ["--report_to", "tensorboard,wandb"]
    trainer = main(*parse_args(argv))
    assert trainer.state.global_step == 2

    events = list(out.rglob("events.out.tfevents.*"))
    assert events, f"no TensorBoard event file under {out}"
    accumulator = EventAccumulator(str(events[0].parent))
    accumulator.Reload()
    tags = accumulator.Tags()["scalars"]
    for tag in ("train/reward", "train/rewards/text_shape/mean", "train/loss"):
        assert tag in tags, tags
    assert [e.step for e in accumulator.Scalars("train/reward")] == [1, 2]

    runs = list((tmp_path / "wandb_root" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "no offline wandb run directory"
    history = b"".join(p.read_bytes() for p in runs[0].glob("run-*.wandb"))
    for key in (b"train/reward", b"train/rewards/text_shape/mean", b"train/global_step"):
        assert key in history


def test_missing_integration_is_refused_before_anything_loads(tmp_path, monkeypatch, capsys):
    import vlm_grpo.recipe

    monkeypatch.setattr(vlm_grpo.recipe, "_installed", lambda module: module != "wandb")
    argv = ["--model_name_or_path", str(tmp_path / "no_model_here"), "--data_file_paths", str(tmp_path / "none.jsonl")]
    argv += ["--output_dir", str(tmp_path / "out"), "--report_to", "tensorboard,wandb"]
    with pytest.raises(SystemExit) as info:
        cli(argv)  # neither the (absent) model nor the (absent) data is touched
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --report_to wandb: the 'wandb' package is not installed; pip install wandb "
                   "(or 'vlm-grpo[wandb]'), or pass --report_to none"]  # fmt: skip
