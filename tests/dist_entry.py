"""torchrun entry for the distributed tests: train, then dump what each rank holds (``dump``, also used by
``matrix_dist_entry.py``, which runs several trainings in one launch)."""

import json
import os
import sys
from pathlib import Path

import torch

from vlm_grpo.grpo_jsonl import main, parse_args
from vlm_grpo.recipe import end_distributed


def dump(trainer, out: Path, rank: int) -> None:
    """What a rank holds after its run: weights, world size and step, per-step metrics, dummy vision passes."""
    torch.save({n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()}, out / f"rank{rank}.pt")
    with open(out / f"rank{rank}.json", "w") as f:
        json.dump({"world_size": trainer.args.world_size, "step": trainer.state.global_step}, f)
    # Per-step training metrics that depend on every log-prob and gradient (the loss alone is ~0 on-policy).
    keys = ("loss", "grad_norm", "entropy")
    losses = [[entry[k] for k in keys] for entry in trainer.state.log_history if "grad_norm" in entry]
    with open(out / f"losses{rank}.json", "w") as f:
        json.dump(losses, f)
    # Dummy vision passes this rank ran to stay in step with ranks that had images (vlm_grpo.fastpath.vision_sync).
    with open(out / f"vision{rank}.json", "w") as f:
        syncs = getattr(trainer, "_vision_syncs", [])
        json.dump({"dummy_passes": sum(s.dummy_passes for s in syncs), "reused": trainer.vision_reused_passes}, f)
    with open(out / f"history{rank}.json", "w") as f:
        json.dump(trainer.state.log_history, f)


if __name__ == "__main__":
    trainer = main(*parse_args(sys.argv[1:]))
    dump(trainer, Path(trainer.args.output_dir), int(os.environ.get("RANK", 0)))
    end_distributed(synchronize=True)  # as the command line ends a run that ended normally
