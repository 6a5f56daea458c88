"""Training entry for the kill-anywhere test: grpo_jsonl's CLI, SIGKILLed at one named point of a save.

``CRASH_AT=phase:step`` picks where, at the checkpoint of ``step``: ``folder`` (the folder has just
appeared), ``model`` (model.safetensors half written), ``optimizer`` (optimizer.pt half written),
``marker`` (every file written, the completion marker not yet), ``step`` (between steps: after the
checkpoint, as the next step begins). Without ``CRASH_AT`` it is the plain CLI.
"""

import os
import signal
import sys
from pathlib import Path

from transformers import TrainerCallback

import vlm_grpo.trainer as trainer_module
import vlm_grpo.trainer_common as common
from vlm_grpo.grpo_jsonl import cli
from vlm_grpo.trainer import VLMGRPOTrainer

PHASE, _, STEP = os.environ.get("CRASH_AT", "").partition(":")
STEP = int(STEP or -1)


def die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def half_written(path: Path) -> None:
    """What a kill in the middle of writing ``path`` leaves on disk."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


class KillBetweenSteps(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if PHASE == "step" and state.global_step == STEP:
            die()


class CrashingTrainer(VLMGRPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_callback(KillBetweenSteps())

    def _save(self, output_dir=None, state_dict=None):
        at = self.state.global_step == STEP
        if at and PHASE == "folder":
            os.makedirs(output_dir, exist_ok=True)
            die()
        super()._save(output_dir, state_dict)
        if at and PHASE == "model":
            half_written(Path(output_dir) / "model.safetensors")
            die()

    def _save_optimizer_and_scheduler(self, output_dir):
        super()._save_optimizer_and_scheduler(output_dir)
        if self.state.global_step == STEP and PHASE == "optimizer":
            half_written(Path(output_dir) / "optimizer.pt")
            die()


_mark_complete = common.mark_complete


def mark_complete_or_die(folder):
    if PHASE == "marker" and Path(folder).name == f"checkpoint-{STEP}":
        die()
    _mark_complete(folder)


if __name__ == "__main__":
    common.mark_complete = mark_complete_or_die
    trainer_module.VLMGRPOTrainer = CrashingTrainer  # the recipe imports it when it runs
    cli(sys.argv[1:])
