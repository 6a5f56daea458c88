"""torchrun entry of the family matrix and the distributed tests: several training runs in turn, in one process
group (one launch: the ranks start, import and join once).

``matrix_dist_entry.py PLAN.json``: each plan entry (``out``, ``argv``) is one run of the command line's ``main``;
after it, what each rank holds goes into ``out`` (``dist_entry.dump``). A run that fails writes its
error into ``error<rank>.txt``; the next run starts when both ranks failed alike (e.g. loading the model), else the
launch ends (the other rank waits in a collective of the failed run). Accelerate's state
(its DeepSpeed plugin above all) is reset between runs; the process group stays, so one launch serves every family.
"""

import json
import os
import sys
import time
import traceback
from pathlib import Path

from accelerate.state import AcceleratorState

from dist_entry import dump
from vlm_grpo.grpo_jsonl import main, parse_args
from vlm_grpo.recipe import end_distributed


def run_one(argv: list[str], out: Path, rank: int) -> None:
    trainer = main(*parse_args(argv))
    dump(trainer, out, rank)
    for sync in getattr(trainer, "_vision_syncs", []):
        sync.remove()


def _both_failed() -> bool:
    """Whether the other rank failed here too (then the next run can start): a rank that did not is inside a
    collective of the failed run, which the barrier does not meet within its timeout."""
    import datetime

    import torch.distributed as dist

    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    except RuntimeError:
        return False
    return True


if __name__ == "__main__":
    rank = int(os.environ.get("RANK", 0))
    for entry in json.loads(Path(sys.argv[1]).read_text()):
        out = Path(entry["out"])
        out.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        try:
            run_one(entry["argv"], out, rank)
        except Exception:  # one family's failure must not hide the others'
            (out / f"error{rank}.txt").write_text(traceback.format_exc())
            if not _both_failed():
                end_distributed(synchronize=False)
                raise
        AcceleratorState._reset_state(reset_partial_state=True)
        print(f"[matrix] rank {rank}: {out} in {time.perf_counter() - start:.1f} s", flush=True)
    end_distributed(synchronize=True)
