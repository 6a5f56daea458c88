"""torchrun entry for the distributed tests: train, then dump what each rank holds."""

import json
import os
import sys

import torch

from vlm_grpo.grpo_jsonl import main, parse_args
from vlm_grpo.recipe import end_distributed

if __name__ == "__main__":
    trainer = main(*parse_args(sys.argv[1:]))
    rank = int(os.environ.get("RANK", 0))
    out = trainer.args.output_dir
    torch.save({n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()}, f"{out}/rank{rank}.pt")
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"world_size": trainer.args.world_size, "step": trainer.state.global_step}, f)
    # Per-step training metrics that depend on every log-prob and gradient (the loss alone is ~0 on-policy).
    keys = ("loss", "grad_norm", "entropy")
    losses = [[entry[k] for k in keys] for entry in trainer.state.log_history if "grad_norm" in entry]
    with open(f"{out}/losses{rank}.json", "w") as f:
        json.dump(losses, f)
    # Dummy vision passes this rank ran to stay in step with ranks that had images (vlm_grpo.fastpath.vision_sync).
    with open(f"{out}/vision{rank}.json", "w") as f:
        json.dump({"dummy_passes": sum(s.dummy_passes for s in getattr(trainer, "_vision_syncs", []))}, f)
    with open(f"{out}/history{rank}.json", "w") as f:
        json.dump(trainer.state.log_history, f)
    end_distributed(synchronize=True)  # as the command line ends a run that ended normally
