"""Kill a real training process (SIGKILL) anywhere in a save or between steps, resume, and end with the
weights of a run that was never interrupted (bit-identical on CPU)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from e2e_utils import base_args, make_dataset
from vlm_grpo.grpo_jsonl import main, parse_args
from vlm_grpo.resume import COMPLETE_MARKER

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ENTRY = Path(__file__).parent / "crash_entry.py"
REPO = Path(__file__).resolve().parents[1]

# Where each run is killed (all at the checkpoint of step 2 of 3, or as step 3 begins), and the checkpoint
# the next run must resume from: a kill inside the save leaves checkpoint-2 unfinished, so checkpoint-1.
# (A kill as the folder appears or mid-way through model.safetensors leaves files that test_resume.py's
# DAMAGE cases judge the same way; crash_entry.py still offers those phases.)
KILLS = [("optimizer", "checkpoint-1"), ("marker", "checkpoint-1"), ("step", "checkpoint-2")]


def _args(tiny_models, tmp_path, out):
    # 2 rows, one prompt a step: an epoch is 2 steps, so the last resume (from checkpoint-2) starts epoch 2,
    # where TRL's sampler alone would shuffle differently from the uninterrupted run (EpochSeededSampler).
    data, plugin = make_dataset(tmp_path / "data", kinds=("single",), n=2)
    save = ["--save_strategy", "steps", "--save_steps", "1", "--resume_from_checkpoint", "true"]
    return [*base_args(tiny_models["qwen2_5_vl"], data, plugin, out, steps=3), *save]


def test_sigkill_anywhere_then_resume_gives_the_uninterrupted_weights(tiny_models, tmp_path):
    reference = main(*parse_args(_args(tiny_models, tmp_path, tmp_path / "reference")))
    assert reference.state.global_step == 3

    out = tmp_path / "crashed"
    argv = _args(tiny_models, tmp_path, out)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    resumed_from = None
    for phase, next_resume in KILLS:
        result = subprocess.run(
            [sys.executable, str(ENTRY), *argv],
            env={**env, "CRASH_AT": f"{phase}:2"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == -9, f"{phase}: not killed (rc {result.returncode})\n{result.stderr[-3000:]}"
        if resumed_from is None:
            assert "no checkpoint in" in result.stderr and "starting a fresh run" in result.stderr
        else:
            assert f"Resuming from {out / resumed_from}" in result.stderr, result.stderr[-3000:]
        if phase != "step":  # the next run must see checkpoint-2 unfinished and say so
            assert not (out / "checkpoint-2" / COMPLETE_MARKER).exists()
        resumed_from = next_resume

    final = main(*parse_args(argv))
    assert final.state.global_step == 3
    expected = load_file(tmp_path / "reference" / "model.safetensors")
    got = load_file(out / "model.safetensors")
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0, msg=f"{name} differs after the kills")
    assert (out / "checkpoint-3" / COMPLETE_MARKER).is_file()


def test_disk_full_during_a_save_stops_clearly_and_keeps_the_previous_checkpoint(
    tiny_models, tmp_path, monkeypatch, capsys, caplog
):
    import errno

    import vlm_grpo.trainer as trainer_module
    from vlm_grpo.grpo_jsonl import cli
    from vlm_grpo.resume import checkpoint_problem, list_checkpoints, resolve_resume

    class DiskFillsAtStep3(trainer_module.VLMGRPOTrainer):
        def _save_optimizer_and_scheduler(self, output_dir):
            if self.state.global_step == 3:
                (Path(output_dir) / "optimizer.pt").write_bytes(b"PK\x03\x04 half")
                raise RuntimeError(
                    "[enforce fail at inline_container.cc:626] . unexpected pos 256 vs 128: file write failed"
                ) from OSError(errno.ENOSPC, "No space left on device")
            super()._save_optimizer_and_scheduler(output_dir)

    monkeypatch.setattr(trainer_module, "VLMGRPOTrainer", DiskFillsAtStep3)
    out = tmp_path / "out"
    argv = [*_args(tiny_models, tmp_path, out), "--save_total_limit", "1"]
    with caplog.at_level(logging.INFO, logger="vlm_grpo"), pytest.raises(SystemExit) as info:
        cli(argv)
    err = capsys.readouterr().err
    # Each step's metrics are one log line (not a dict printed into the progress bar).
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [m.split(":")[0] for m in steps] == ["step 1", "step 2", "step 3"] and "loss=" in steps[0], steps
    assert info.value.code == 2 and "Traceback" not in err
    assert f"error: no space left on the device while saving {out / 'checkpoint-3'}" in err
    assert f"the newest complete checkpoint, {out / 'checkpoint-2'}, is intact" in err
    # save_total_limit=1 removed checkpoint-1 once checkpoint-2 was complete, and nothing removed checkpoint-2.
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-2"]
    assert checkpoint_problem(out / "checkpoint-2") is None
    assert resolve_resume(out, "true") == str(out / "checkpoint-2")


class Killed(BaseException):
    """Stands in for SIGKILL in-process: nothing of the trainer catches it."""


def test_save_total_limit_1_never_leaves_the_run_without_a_complete_checkpoint(tiny_models, tmp_path, monkeypatch):
    """Rotation runs only after the marker: killed before marking checkpoint-2, checkpoint-1 is still there and
    complete; killed after marking but before rotation, both are there and checkpoint-2 is the one resumed."""
    import vlm_grpo.trainer_common as common
    from vlm_grpo.resume import checkpoint_problem, list_checkpoints, resolve_resume

    out = tmp_path / "out"
    argv = [*_args(tiny_models, tmp_path, out), "--save_total_limit", "1"]
    real_mark, real_rotate = common.mark_complete, common.rotate_checkpoints

    def kill_before_marking(folder):
        if Path(folder).name == "checkpoint-2":
            raise Killed
        real_mark(folder)

    monkeypatch.setattr(common, "mark_complete", kill_before_marking)
    with pytest.raises(Killed):
        main(*parse_args(argv))
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-1", "checkpoint-2"]
    assert checkpoint_problem(out / "checkpoint-1") is None
    assert resolve_resume(out, "true") == str(out / "checkpoint-1")

    monkeypatch.setattr(common, "mark_complete", real_mark)
    marked_before_rotation = []

    def kill_before_rotating(run_dir, *args, **kwargs):
        marked_before_rotation.append((Path(run_dir) / "checkpoint-2" / COMPLETE_MARKER).is_file())
        raise Killed

    monkeypatch.setattr(common, "rotate_checkpoints", kill_before_rotating)
    with pytest.raises(Killed):
        main(*parse_args(argv))  # resumes from checkpoint-1, saves checkpoint-2 again
    assert marked_before_rotation == [True]
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-1", "checkpoint-2"]
    assert resolve_resume(out, "true") == str(out / "checkpoint-2")

    monkeypatch.setattr(common, "rotate_checkpoints", real_rotate)
    assert main(*parse_args(argv)).state.global_step == 3
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-3"]
    assert checkpoint_problem(out / "checkpoint-3") is None
