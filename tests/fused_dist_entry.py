"""torchrun entry of test_fused_update's DDP test: the same two optimizer steps with TRL's micro-batches and fused,
on 2 ranks; each rank dumps its gradients, logs and the micro-steps at which DDP all-reduced."""

import json
import os
import sys
from pathlib import Path

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from transformers import TrainerCallback

from test_fused_update import run, write_rows


class AllReduces(TrainerCallback):
    """The trainer's micro-step (TRL's ``_step``) at every all-reduce of a gradient bucket."""

    def __init__(self, trainer) -> None:
        self.trainer, self.at = trainer, []

    def on_train_begin(self, args, state, control, **kwargs):
        def hook(process_group, bucket):
            self.at.append(self.trainer._step)
            return allreduce_hook(process_group, bucket)

        self.trainer.model_wrapped.register_comm_hook(None, hook)


if __name__ == "__main__":
    model_dir, root, budget = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    rank = int(os.environ["RANK"])
    rows = write_rows(root, text_only=True) if rank == 0 else root / "rows.jsonl"
    torch.distributed.init_process_group("gloo")
    torch.distributed.barrier()  # rank 0 has written the rows
    out = {}
    for name, tokens in (("plain", None), ("fused", budget)):
        hooks = []

        def setup(trainer, hooks=hooks):
            hooks.append(AllReduces(trainer))
            trainer.add_callback(hooks[0])

        trainer = run({"qwen2_5_vl": model_dir}, rows, root / name, tokens, setup=setup, loss_type="bnpo")
        grads = trainer.grads.steps
        torch.save(grads, root / f"{name}_grads{rank}.pt")
        logs = [e for e in trainer.state.log_history if "grad_norm" in e]
        out[name] = {
            "allreduce_steps": hooks[0].at,
            "logs": logs,
            "world": trainer.accelerator.num_processes,
            "forwards": trainer.forwards.count,
            "last_forwards": trainer.fused_update.last_forwards,
            "planned": trainer.fused_update.last_planned,
        }
    (root / f"rank{rank}.json").write_text(json.dumps(out))
