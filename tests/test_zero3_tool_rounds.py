"""Tool rollouts under DeepSpeed ZeRO-3 where ranks run different numbers of tool rounds (2 ranks, gloo on CPU).

Every generation call under ZeRO-3 gathers the parameters (a collective), and TRL's tool loop runs as many rounds as
the rank's own rollouts need: a rank whose rollouts all answered in their first turn would leave the loop while
another rank gathers for its next round. The trainer keeps the ranks' rounds paired (see
``vlm_grpo.tools.rounds``); here rank 0's rollouts call ``zoom_in`` and rank 1's answer at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_utils import base_args, make_dataset
from test_distributed import _free_port

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # torchrun, two ranks under DeepSpeed
def test_zero3_ranks_with_different_tool_rounds_finish(tiny_models, tmp_path):
    data, plugin = make_dataset(tmp_path / "data", kinds=("single",))
    out = tmp_path / "out"
    argv = [
        *base_args(tiny_models["qwen2_5_vl"], data, plugin, out, steps=1),
        "--deepspeed", str(REPO / "local_scripts" / "zero3.json"),
        "--tools", "zoom_in", "--max_tool_calling_iterations", "1", "--max_completion_length", "200",
        "--generation_kwargs", '{"max_new_tokens": 8}',
    ]  # fmt: skip
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(_free_port()), str(REPO / "tests" / "zero3_rounds_entry.py"), *argv,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    try:
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the ranks hung: {(exc.stderr or b'')[-3000:]!r}")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    ranks = [json.loads((out / f"rounds{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["rounds"] == [4] and ranks[1]["rounds"] == []  # rank 0 ran one round for its 4 rollouts
    assert ranks[0]["joined"] == 0 and ranks[1]["joined"] == 1  # ... and rank 1 took part in it
    assert ranks[0]["logs"][0]["tools/calls_per_rollout"] == 0.5  # metrics gathered over both ranks' rollouts
    assert ranks[0]["steps"] == ranks[1]["steps"] == 1


def _simulated_ranks(rounds: list[int], drain: bool) -> list[list[str]]:
    """Each rank's sequence of collectives in one tool loop, with threads for ranks and a barrier for the
    all-reduce: a rank with ``rounds[r]`` rounds votes and generates (``gen``) per round, then drains."""
    import threading

    from vlm_grpo.tools.rounds import RoundSync

    barrier, lock = threading.Barrier(len(rounds), timeout=2), threading.Lock()
    total = {"sum": 0}
    logs: list[list[str]] = [[] for _ in rounds]

    def make_reduce(rank: int):
        def reduce(flag):
            logs[rank].append("vote")
            with lock:
                total["sum"] += int(flag.item())
            barrier.wait()
            result = total["sum"]
            if barrier.wait() == 0:
                total["sum"] = 0
            barrier.wait()
            return flag.new_tensor([result])

        return reduce

    def run(rank: int) -> None:
        sync = RoundSync(make_reduce(rank))
        try:
            for _ in range(rounds[rank]):
                sync.vote(True)
                logs[rank].append("gen")
            if drain:
                sync.drain(lambda: logs[rank].append("gen"))
        except threading.BrokenBarrierError:
            logs[rank].append("broken")

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(rounds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return logs


def test_round_votes_pair_every_ranks_collectives():
    """Ranks with 3, 0 and 1 rounds issue the same collectives in the same order; without the drain (control) the
    rank without rounds leaves while the others still vote and generate."""
    logs = _simulated_ranks([3, 0, 1], drain=True)
    assert logs[0] == logs[1] == logs[2] == ["vote", "gen"] * 3 + ["vote"]
    control = _simulated_ranks([3, 0, 1], drain=False)
    assert control[1] == [] and "broken" in control[0]
