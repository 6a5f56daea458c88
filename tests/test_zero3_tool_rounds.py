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
import time
from pathlib import Path

import psutil
import pytest
import torch

from e2e_utils import base_args, make_dataset
from test_distributed import _free_port

REPO = Path(__file__).resolve().parents[1]


JOINING = "rank 1: joining with TRL's one-token generation"


def _launch_rounds(tmp_path: Path, tiny_models, env: dict[str, str], hang_after: str | None = None):
    """One 2-rank ZeRO-3 launch of ``zero3_rounds_entry.py`` (greedy, so that paths can be compared): its return code
    and its output. ``hang_after``: a line of the output after which the launch counts as hung (return code None,
    launcher and ranks ended) when it has not finished within 20 s (a healthy run ends in a few)."""
    data, plugin = make_dataset(tmp_path / "data", kinds=("single",))
    out = tmp_path / "out"
    argv = [
        *base_args(tiny_models["qwen2_5_vl"], data, plugin, out, steps=1),
        "--deepspeed", str(REPO / "local_scripts" / "zero3.json"),
        "--tools", "zoom_in", "--max_tool_calling_iterations", "2", "--max_completion_length", "600",
        "--generation_kwargs", '{"max_new_tokens": 8, "do_sample": false}',
    ]  # fmt: skip
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(_free_port()), str(REPO / "tests" / "zero3_rounds_entry.py"), *argv,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", **env}
    log_path = tmp_path / "launch.log"
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(cmd, env=env, stdout=log_file, stderr=subprocess.STDOUT, text=True)
    start, seen = time.monotonic(), None
    while proc.poll() is None:
        time.sleep(0.5)
        if seen is None and hang_after is not None and hang_after in log_path.read_text():
            seen = time.monotonic()
        if time.monotonic() - start > 300 or (seen is not None and time.monotonic() - seen > 20):
            for child in [*psutil.Process(proc.pid).children(recursive=True), proc]:  # ranks: their own sessions
                child.kill()
            proc.wait()
            return None, log_path.read_text(), out
    return proc.returncode, log_path.read_text(), out


@pytest.mark.slow  # torchrun, two ranks under DeepSpeed
def test_zero3_tool_rounds_take_the_held_path_paired(tiny_models, tmp_path):
    """Rank 0's rollouts call a tool twice (two rounds), rank 1's once (they answer after round 1): both rounds continue
    the rollouts' held caches (only the tokens new to each rollout prefilled), rank 1 joins round 2 with the same
    collectives, nobody hangs, and every round's tokens equal TRL's path's for the same model (greedy; each rank runs
    both paths in the same round)."""
    returncode, log, out = _launch_rounds(tmp_path, tiny_models, {"Z3_COMPARE": "1"}, "rank 0: round starts")
    assert returncode == 0, log[-6000:]  # (None: hung in a round)
    ranks = [json.loads((out / f"rounds{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["rounds"] == [4, 4] and ranks[1]["rounds"] == [4]  # each rank's 4 rollouts
    # rank 1 joined rank 0's round 2 and its comparison through TRL's path; rounds 1 and 2 were held on both ranks
    assert ranks[0]["joined"] == 0 and ranks[1]["joined"] == 2
    assert ranks[0]["held_rounds"] == ranks[1]["held_rounds"] == 2
    assert ranks[0]["logs"][0]["tools/calls_per_rollout"] == 1.5  # metrics gathered over both ranks' rollouts
    assert ranks[0]["steps"] == ranks[1]["steps"] == 1
    for rank in ranks:  # later turns prefill only what is new to each rollout
        held_before = [rank["first_prompt_lengths"], *rank["histories"][:-1]]  # what the previous decode held
        before = [0, 0]
        for histories, held, after in zip(rank["histories"], held_before, rank["stats_after"], strict=True):
            prefilled, reused = after[0] - before[0], after[1] - before[1]
            before = after
            assert prefilled + reused == sum(n - 1 for n in histories)  # the last token: the decode's first input
            assert reused >= sum(held) > 0
        assert rank["held"] == rank["trl"] and all(all(row) for row in rank["held"])  # the held path = TRL's tokens


@pytest.mark.slow  # torchrun, two ranks under DeepSpeed
def test_zero3_old_joiner_does_not_pair_with_the_held_path(tiny_models, tmp_path):
    """Control: a joiner that makes TRL's one-token generation (``synced_gpus`` steps) while rank 0 takes the held
    path in its round 2 (one gather, one forward, a local decode) leaves the ranks' collectives apart: the launch
    fails or hangs."""
    returncode, log, _ = _launch_rounds(tmp_path, tiny_models, {"Z3_OLD_JOIN": "1"}, hang_after=JOINING)
    assert JOINING in log, log[-6000:]  # it reached the round
    assert returncode != 0, log[-3000:]  # (None: hung, ended at the timeout)


def _simulated_ranks(can_hold: list[list[bool]], drain: bool = True, control: str | None = None) -> list[list[str]]:
    """Each rank's sequence of collectives in one tool loop, with threads for ranks and barriers for the all-reduce.

    Rank ``r`` runs ``len(can_hold[r])`` rounds; in its round ``k`` it can take the held path when ``can_hold[r][k]``.
    A round on the held path is ``gather`` + ``forward`` (the prefill; the decode is local), on TRL's path ``gather``
    + ``generate`` (``synced_gpus`` steps); a joiner makes what :meth:`VLMGRPOTrainer._join_round` makes. Controls:
    ``old_join``: the joiner always generates (TRL's one-token generation); ``local``: a rank picks its path from
    its own ``can_hold`` rather than the vote."""
    import threading

    from vlm_grpo.tools.rounds import RoundSync

    ranks = len(can_hold)
    barrier, lock = threading.Barrier(ranks, timeout=2), threading.Lock()
    total: dict[str, torch.Tensor | None] = {"sum": None}
    logs: list[list[str]] = [[] for _ in can_hold]

    def make_reduce(rank: int):
        def reduce(flag):
            logs[rank].append("vote")
            with lock:
                total["sum"] = flag.clone() if total["sum"] is None else total["sum"] + flag
            barrier.wait()
            result = total["sum"].clone()
            if barrier.wait() == 0:
                total["sum"] = None
            barrier.wait()
            return result

        return reduce

    def make_round(rank: int, held: bool) -> None:
        logs[rank] += ["gather", "forward" if held else "generate"]

    def run(rank: int) -> None:
        sync = RoundSync(make_reduce(rank))
        try:
            for ok in can_hold[rank]:
                _, held = sync.vote(True, ok)
                make_round(rank, ok if control == "local" else held)
            if drain:
                sync.drain(lambda held: make_round(rank, False if control == "old_join" else held))
        except threading.BrokenBarrierError:
            logs[rank].append("broken")

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return logs


def test_round_votes_pair_every_ranks_collectives():
    """Ranks with 2, 0 and 2 rounds issue the same collectives in the same order: round 1 on the held path (every
    rank can), round 2 on TRL's (rank 2 cannot), then all leave. Controls: without the drain the rank without rounds
    leaves while the others still vote; a joiner that always generates, or a rank that picks its path alone (not by
    the vote), makes other collectives than the ranks it should pair with."""
    can_hold = [[True, True], [], [True, False]]
    logs = _simulated_ranks(can_hold)
    expected = ["vote", "gather", "forward", "vote", "gather", "generate", "vote"]
    assert logs[0] == logs[1] == logs[2] == expected
    no_drain = _simulated_ranks(can_hold, drain=False)
    assert no_drain[1] == [] and "broken" in no_drain[0]
    old_join = _simulated_ranks(can_hold, control="old_join")
    assert old_join[0] == expected and old_join[1] != old_join[0]  # round 1: generate against forward
    local = _simulated_ranks(can_hold, control="local")
    assert local[2] == expected and local[0] != local[2]  # round 2: rank 0 forwards, rank 2 generates


def _zero3_trainer(processes: int, gather: bool, model):
    """What ``trl_generation_reason`` reads of a trainer under ZeRO-3 (``processes`` ranks)."""
    from types import SimpleNamespace

    state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3))
    accelerator = SimpleNamespace(state=state, num_processes=processes, unwrap_model=lambda m: m)
    args = SimpleNamespace(share_prefill=True, ds3_gather_for_generation=gather)
    return SimpleNamespace(
        args=args, accelerator=accelerator, use_vllm=False, use_transformers_continuous_batching=False,
        is_fsdp_enabled=False, model_wrapped=model, generation_config=model.generation_config,
    )  # fmt: skip


def test_zero3_tool_turns_take_the_held_path_only_in_a_paired_round_with_gathered_parameters(tiny_models):
    """Tool turns under ZeRO-3 take the held path in a round the ranks vote on, with the parameters gathered once;
    outside such a round (several ranks) or with partitioned parameters they go through TRL's generate."""
    from transformers import AutoModelForImageTextToText

    from vlm_grpo.fastpath.route import trl_generation_reason

    model = AutoModelForImageTextToText.from_pretrained(tiny_models["qwen2_5_vl"])
    assert trl_generation_reason(_zero3_trainer(2, True, model), own_history=True, paired=True) is None
    assert trl_generation_reason(_zero3_trainer(1, True, model), own_history=True) is None  # one process: no peers
    assert "outside a tool round" in trl_generation_reason(_zero3_trainer(2, True, model), own_history=True)
    partitioned = trl_generation_reason(_zero3_trainer(2, False, model), own_history=True, paired=True)
    assert "without ds3_gather_for_generation" in partitioned
    assert trl_generation_reason(_zero3_trainer(2, False, model)) is None  # the first turn: decided elsewhere
