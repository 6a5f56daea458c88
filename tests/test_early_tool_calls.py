"""A rollout's tool calls start as soon as its turn has ended, while the other rollouts still decode
(``early_tool_calls``), with the tokens, masks and metrics of TRL's own loop and each call run once.

Scripted rollouts, forced token by token through the tiny model's LM head (so the decode itself writes them, and its
host checks see the rows end): rollout 0 calls a slow tool after a short turn, then answers; rollout 1 calls a fast
tool after long turns in every round and runs into ``max_tool_calling_iterations``; rollout 2 calls the slow tool
twice after short turns, then answers; rollout 3 calls the fast tool after a long turn, then writes past
``max_completion_length`` mid-turn. Every tool call is logged by the tool itself.

Three runs of one GRPO step: TRL's loop with ``generate`` (``share_prefill`` off), the speed path with the calls
started after each round (``early_tool_calls`` off), and with them started as each turn ends. Rollouts (tokens, tool
masks), logged metrics and the tool's own log of calls must be equal; each (rollout, turn) runs once. The speed: the
time the generation waits outside its turns is well under the lockstep run's (the slow tool runs while the long turns
decode; measured outside the turns, a busy machine's slower decodes do not blur it). Control: a rollout whose calls
are started again after the round (the "already started" mark ignored) runs its calls twice, and the test sees it.
"""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch

from e2e_utils import base_args, make_dataset
from test_early_calls_unit import fresh_tool_threads  # noqa: F401  (autouse: each test its own tool threads)
from test_generation_parity import sharp_model_getter
from vlm_grpo.fastpath import decode, decode_compact
from vlm_grpo.grpo_jsonl import main, parse_args
from vlm_grpo.tools import TOOLS
from vlm_grpo.tools.base import ToolEnvironment
from vlm_grpo.tools.early_calls import EarlyCalls
from vlm_grpo.tools.protocols import PROTOCOLS, HermesProtocol
from vlm_grpo.trainer import VLMGRPOTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ITERATIONS = 3  # max_tool_calling_iterations
MAX_COMPLETION = 400
SLOW = 0.25  # seconds the slow tool sleeps (rollouts 0 and 2)
LONG = 45  # filler words of a long turn
# Per rollout, per turn: (filler words, "call" or "answer"); rollout 1 keeps calling, rollout 3's last turn runs long.
SCRIPT = {
    0: [(2, "call"), (2, "answer")],
    1: [(LONG, "call")] * (ITERATIONS + 1),
    2: [(2, "call"), (2, "call"), (2, "answer")],
    3: [(LONG, "call"), (8 * LONG, "answer")],
}
CALLS: list[tuple[int, int]] = []
STARTS: dict[tuple[int, int], float] = {}  # when each call started (time.perf_counter)
_LOCK = threading.Lock()


def sleepy(env: ToolEnvironment, rollout: int, turn: int) -> str:
    """Wait for a while.

    Args:
        rollout: the rollout's number.
        turn: the turn's number.
    """
    with _LOCK:
        CALLS.append((rollout, turn))
        STARTS[rollout, turn] = time.perf_counter()
    time.sleep(SLOW if rollout % 2 == 0 else 0.0)
    return f"waited {rollout}.{turn}"


sleepy.parallel = True  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("early_calls"), kinds=("single",))


@pytest.fixture(scope="module")
def sharp_models(tmp_path_factory):
    return sharp_model_getter(tmp_path_factory.mktemp("early_models"))


class StopProtocol(HermesProtocol):
    """Hermes calls, the turn cut after ``</tool_call>`` (as PyVision's after ``</code>``): what the model writes
    after it is dropped."""

    name = "hermes_stop"
    stop = ("</tool_call>",)


def turn_text(rollout: int, turn: int, stop: bool = False) -> str:
    """The scripted turn; with ``stop``, a call turn goes on writing after the call, to about a long turn's length
    (every row then ends its decode at about the same step: only the stop string tells the short calls apart)."""
    words, kind = SCRIPT[rollout][min(turn, len(SCRIPT[rollout]) - 1)]
    filler = " step" * words
    if kind == "answer":
        return f"{filler}<answer>{rollout}</answer><|im_end|>"
    call = {"name": "sleepy", "arguments": {"rollout": rollout, "turn": turn}}
    after = " more" * (LONG + 2 - words) if stop else ""
    return f"{filler}<tool_call>\n{json.dumps(call)}\n</tool_call>{after}<|im_end|>"


def run(family, model_dir, dataset, out, share: bool, early: bool, rerun=False, stop=False, blind=False) -> dict:
    """One GRPO step with the scripted rollouts; returns the rollouts, the tool metrics, the tool's log of calls,
    the turn statistics and the generation's wall time."""
    data, plugin = dataset
    state: dict = {"script": None, "n": 0, "eos": None, "decoding": False}
    seen: dict = {}
    generate = VLMGRPOTrainer._generate_single_turn
    fast_decode = decode.fast_decode

    def head_hook(module, args, output):
        script = state["script"]
        if script is None or output.size(0) != len(script):
            return output  # not a generation of these rows (the shared first prefill, the log-prob passes)
        n = state["n"]
        state["n"] += 1
        if seen["decodes"] and state["decoding"]:
            seen["decodes"][-1]["times"].append(time.perf_counter())  # when the decode wrote each row's token n
        forced = torch.tensor([row[n] if n < len(row) else state["eos"] for row in script])
        output = output.clone()  # (rows, vocab) in a decode step, (rows, positions, vocab) in a forward
        last = output if output.dim() == 2 else output[:, -1]
        last[:] = -1e4
        last[torch.arange(len(script)), forced] = 1e4
        return output

    def scripted(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        tokenizer = self._tokenizer
        if not getattr(self, "_hooked", False):
            self._hooked = True
            base = self.accelerator.unwrap_model(self.model)
            base.get_output_embeddings().register_forward_hook(head_hook)
            state["eos"] = tokenizer.convert_tokens_to_ids("<|im_end|>")
        script = []
        for k, ids in enumerate(prompt_ids):
            text = tokenizer.decode(ids)
            found = re.search(r'"rollout": (\d+)', text)
            rollout = int(found.group(1)) if found else k
            turn = len(re.findall(r'"turn": \d+', text))
            script.append(tokenizer.encode(turn_text(rollout, turn, stop), add_special_tokens=False))
        state["script"], state["n"] = script, 0
        start = time.perf_counter()
        try:
            return generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        finally:
            state["script"] = None
            seen["decoding_seconds"] += time.perf_counter() - start

    def counted_decode(*args, **kwargs):
        state["n"] = 0  # the decode's steps give the turn's tokens (a prefill before it gave none)
        seen["decodes"].append({"times": [], "lengths": [len(row) for row in state["script"]]})
        state["decoding"] = True
        try:
            return fast_decode(*args, **kwargs)
        finally:
            state["decoding"] = False

    real_generate = VLMGRPOTrainer._generate

    def timed(self, prompts):
        start = time.perf_counter()
        result = real_generate(self, prompts)
        seen["seconds"] = time.perf_counter() - start
        seen["waiting_seconds"] = seen["seconds"] - seen["decoding_seconds"]  # the tool calls TRL's loop waited for
        seen["rollouts"] = (result[1], result[2])
        return result

    argv = base_args(model_dir, data, plugin, out, steps=1)
    argv += ["--generation_kwargs", '{"do_sample": false}', "--share_prefill", str(share)]
    argv += ["--tools", "sleepy", "--max_tool_calling_iterations", str(ITERATIONS)]
    argv += ["--max_completion_length", str(MAX_COMPLETION), "--early_tool_calls", str(early)]
    argv += ["--fuse_decode_projections", "false"]  # the forcing hook sits on the LM head itself
    argv += ["--tool_protocol", "hermes_stop"] if stop else []
    CALLS.clear()
    STARTS.clear()
    seen["decodes"] = []
    seen["decoding_seconds"] = 0.0
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(TOOLS._entries, "sleepy", sleepy)
        mp.setitem(PROTOCOLS._entries, "hermes_stop", StopProtocol)
        mp.setattr(VLMGRPOTrainer, "_generate_single_turn", scripted)
        mp.setattr(VLMGRPOTrainer, "_generate", timed)
        mp.setattr(decode, "fast_decode", counted_decode)
        mp.setattr(decode_compact, "COMPACT", False)  # the forcing hook reads rows in batch order
        if blind:  # the control: rows still decoding never tell that they wrote the stop string
            mp.setattr(EarlyCalls, "_decided", lambda self, tail: False)
        if rerun:  # the control: the mark that a rollout's calls already started is never kept
            ignored = property(lambda self: False, lambda self, value: None)
            mp.setattr(ToolEnvironment, "_ahead", ignored, raising=False)
        trainer = main(*parse_args(argv))
    logged = trainer.state.log_history[0]
    seen["metrics"] = {k: v for k, v in logged.items() if k.startswith(("tools/", "completions/"))}
    seen["calls"] = sorted(CALLS)
    seen["starts"] = dict(STARTS)
    seen["stats"] = trainer.last_turn_stats
    return seen


def long_turn_end(seen: dict, decode: int) -> float:
    """When decode ``decode`` (0: the first turns, 1: the loop's first round) wrote rollout 1's last token (rollout 1
    writes a long turn in both, and is row 1 of both)."""
    record = seen["decodes"][decode]
    return record["times"][record["lengths"][1] - 1]


def started_while_long_rows_decode(seen: dict) -> bool:
    """The slow calls of rollouts 0 and 2 (after their short turns 0, and 2's turn 1) started before the long turns of
    their round were written."""
    starts = seen["starts"]
    first, second = long_turn_end(seen, 0), long_turn_end(seen, 1)
    return starts[0, 0] < first and starts[2, 0] < first and starts[2, 1] < second


def expected_calls() -> list[tuple[int, int]]:
    """The calls TRL's loop makes: each call turn's, up to max_tool_calling_iterations rounds."""
    calls = []
    for rollout, turns in SCRIPT.items():
        for turn, (_, kind) in enumerate(turns[:ITERATIONS]):
            if kind != "call":
                break
            calls.append((rollout, turn))
    return sorted(calls)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_early_calls_give_trls_rollouts_each_call_once(family, sharp_models, dataset, tmp_path):
    model = sharp_models(family)
    trl = run(family, model, dataset, tmp_path / "trl", share=False, early=False)
    early = run(family, model, dataset, tmp_path / "early", share=True, early=True)
    runs = [early]
    if family == "qwen2_5_vl":  # the speed path with the calls started after each round
        lock = run(family, model, dataset, tmp_path / "lock", share=True, early=False)
        runs.append(lock)
    # The scripted rollouts happened: rollout 3 was cut at the completion budget, rollout 1 by the iterations.
    ids = trl["rollouts"][0]
    assert len(ids[3]) == MAX_COMPLETION and ids[3][-1] != ids[0][-1]
    assert sum(1 for c in trl["calls"] if c[0] == 1) == ITERATIONS
    assert trl["calls"] == expected_calls()
    for other in runs:
        assert other["rollouts"] == trl["rollouts"]  # every token of every rollout, and its tool mask
        assert other["metrics"] == trl["metrics"]
        assert other["calls"] == trl["calls"]  # each call once (the tool's own log)
    stats = early["stats"]
    assert stats.early_calls == len(expected_calls()) and stats.early_unmatched == 0
    # Rollouts 0 and 2 end their short call turns while 1 and 3 still decode theirs: the slow calls start before
    # the decode of their turn has ended (the first decode: the first turns; the second: turn 1 of the loop).
    assert started_while_long_rows_decode(early)
    if family == "qwen2_5_vl":
        assert lock["stats"].early_calls == 0
        assert not started_while_long_rows_decode(lock)
        # The slow tool ran while the long turns decoded: outside its turns, the generation waits well over SLOW / 2
        # less (about 0.3 s: the slow calls of rounds 0 and 1, less what overlapped other work in lockstep too).
        # Measured outside the turns, so a busy machine (slower decodes) does not blur it.
        waited = (early["waiting_seconds"], lock["waiting_seconds"])
        print(f"generation: {early['seconds']:.2f} s early, {lock['seconds']:.2f} s lockstep; outside turns {waited}")
        assert waited[0] < waited[1] - SLOW / 2, waited
        rerun = run(family, model, dataset, tmp_path / "rerun", share=True, early=True, rerun=True)
        assert rerun["calls"] != trl["calls"]  # the control: calls started early ran again after the round
        assert len(rerun["calls"]) > len(set(rerun["calls"]))


def test_a_stop_string_starts_the_calls_before_the_row_ends(sharp_models, dataset, tmp_path):
    """With a protocol that cuts the turn at a stop string, a row's calls start once it has written the stop string,
    though its decode goes on (here to about the long turns' length): the rollouts are TRL's, each call runs once."""
    model = sharp_models("qwen2_5_vl")
    trl = run("qwen2_5_vl", model, dataset, tmp_path / "trl", share=False, early=False, stop=True)
    early = run("qwen2_5_vl", model, dataset, tmp_path / "early", share=True, early=True, stop=True)
    assert trl["calls"] == expected_calls()
    assert early["rollouts"] == trl["rollouts"] and early["metrics"] == trl["metrics"]
    assert early["calls"] == trl["calls"]
    assert early["stats"].early_calls == len(expected_calls())
    assert started_while_long_rows_decode(early)
    blind = run("qwen2_5_vl", model, dataset, tmp_path / "blind", share=True, early=True, stop=True, blind=True)
    assert blind["calls"] == trl["calls"] and not started_while_long_rows_decode(blind)


def test_rows_in_doubt_start_nothing():
    """A loop round's rows are TRL's rollouts waiting on tool replies, in order (less those cut at the completion
    budget); each row's history starts with its rollout's. A row gets the rollout every such assignment gives it;
    rows whose history several rollouts share, one of which is not in the round, start nothing."""

    class Trainer:
        _tool_turns = None
        _tokenizer = None
        environments = ()

    stats = type("Stats", (), {"early_unmatched": 0})()
    early = EarlyCalls(Trainer(), stats)
    tool = {"role": "tool", "content": "x"}
    answered = {"role": "assistant", "content": "done"}
    prompt_ids = [[1, 2], [1, 2], [1, 3], [1, 4]]
    completion_ids = [[5], [5], [6], [7]]
    completions = [[{}, tool], [{}, tool], [{}, tool], [answered]]
    early.enter_loop(prompt_ids, completion_ids, completions)
    # Rollouts 0 and 1 share their history and are both in the round: in order, row 0 is 0's and row 1 is 1's.
    assert early._match([[1, 2, 5, 9, 9], [1, 2, 5, 9, 8], [1, 3, 6, 9]]) == [0, 1, 2]
    # Only one of them is in the round: which one is in doubt.
    assert early._match([[1, 2, 5, 9], [1, 3, 6, 9]]) == [None, 2]
    assert stats.early_unmatched == 1
    completion_ids[1] = [8]  # rollout 1 went another way: no doubt left
    assert early._match([[1, 2, 5, 9], [1, 3, 6, 9]]) == [0, 2]
    assert early._match([[1, 2, 8, 9]]) == [1]
    assert early._match([[1, 4, 7, 9]]) == [None]  # rollout 3 answered: it waits on no tool


def test_a_call_over_the_image_budget_never_runs():
    """A parallel tool's call that ``--max_tool_images`` refuses is not started ahead of TRL's loop either (it would
    run, its result never read). Control: started without the budget, the tool runs though the call is refused."""
    from vlm_grpo.tools.base import make_environment_factory
    from vlm_grpo.tools.rollouts import ToolTurns, prefetch_tool_calls

    turns = ToolTurns(HermesProtocol(), None, max_tool_images=1)
    call = {"type": "function", "function": {"name": "sleepy", "arguments": {"rollout": 1, "turn": 0}}}
    for budget in (True, False):
        env = make_environment_factory([sleepy])()
        env.reset()
        tools = turns.tools_for({"sleepy": env.sleepy}, env, 0)
        turns.image_counts[id(env)]["images"] = 1  # the rollout holds its one tool image
        CALLS.clear()
        started = prefetch_tool_calls(
            [env], [[{"role": "assistant", "tool_calls": [call]}]], set(), turns if budget else None
        )
        with pytest.raises(ValueError, match="--max_tool_images 1"):  # Hermes' error reply (TRL's loop words it)
            tools["sleepy"](rollout=1, turn=0)
        env.reset()  # waits for calls started and never collected
        assert (started, CALLS) == ((0, []) if budget else (1, [(1, 0)]))


def test_only_runs_with_a_parallel_tool_read_the_decodes_ended_rows():
    """Tools that run in TRL's order (zoom_in) start nothing early, so their decodes hand no rows to a listener (no
    host work at every check); the python sandbox is parallel and its decodes do."""
    from vlm_grpo.tools.early_calls import _parallel_tools
    from vlm_grpo.tools.rollouts import build_tool_environment

    assert not _parallel_tools(build_tool_environment(["zoom_in"]))
    assert _parallel_tools(build_tool_environment(["zoom_in", "python"]))
