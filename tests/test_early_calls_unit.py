"""Early tool calls, piece by piece and fast: which ended turns start their calls ahead of TRL's loop (and which must
not), the turn budgets they are read with, and the decode's hand-over of ended rows (``row_ends``).

The end-to-end runs (tests/test_early_tool_calls.py) check the whole path against TRL's loop; these pin each rule
with inputs as the trainer hands them (rows in batch order, histories that start with the rollout's prompt, turns
that end in EOS) and a tool that logs every run, so a call run twice, run for a turn TRL cuts, or never started
shows in the log. The tokenizer is the tiny Qwen2.5-VL checkpoint's, with the project's tool-call parser.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import wait
from types import SimpleNamespace

import pytest
import torch

from vlm_grpo.fastpath import row_ends
from vlm_grpo.fastpath.turn_cache import TurnStats
from vlm_grpo.tools import rollouts
from vlm_grpo.tools.base import make_environment_factory
from vlm_grpo.tools.early_calls import EarlyCalls, turn_rooms
from vlm_grpo.tools.protocols import HermesProtocol
from vlm_grpo.tools.rollouts import ToolTurns

LOG: list[tuple[str, int]] = []  # every tool run: (tool, x)


def double(env, x: int) -> str:
    """Double a number.

    Args:
        x: the number.
    """
    LOG.append(("double", x))
    return str(2 * x)


double.parallel = True  # type: ignore[attr-defined]


def halve(env, x: int) -> str:
    """Halve a number.

    Args:
        x: the number.
    """
    LOG.append(("halve", x))
    return str(x // 2)


class StopHermes(HermesProtocol):
    """Hermes calls, the turn cut after ``</tool_call>``."""

    name = "hermes_stop"
    stop = ("</tool_call>",)


@pytest.fixture(autouse=True)
def fresh_tool_threads(monkeypatch):
    """Each test its own pool for calls started ahead (a pool made before a fork has no threads in the child)."""
    monkeypatch.setattr(rollouts, "_EXECUTOR", None)
    LOG.clear()
    yield
    if rollouts._EXECUTOR is not None:
        rollouts._EXECUTOR.shutdown(wait=True)


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models["qwen2_5_vl"])
    rollouts.prepare_for_tools(None, tok)
    return tok


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def prompt(tokenizer, k: int) -> list[int]:
    return encode(tokenizer, f"<|im_start|>user\nquestion {k}<|im_end|>\n<|im_start|>assistant\n")


def call_turn(x: int | str, tool: str = "double", after: str = "") -> str:
    """A turn that calls ``tool`` (``x`` as the model wrote it: ``"7"`` is typed by the tool's schema)."""
    return f"<tool_call>\n{json.dumps({'name': tool, 'arguments': {'x': x}})}\n</tool_call>{after}<|im_end|>"


def setup(
    tokenizer,
    n: int = 2,
    *,
    tools=(double,),
    protocol=None,
    iterations: int = 3,
    max_completion: int = 400,
    max_turn_tokens: int | None = None,
    max_context_tokens: int | None = None,
    max_tool_images: int | None = None,
):
    """A trainer as the early calls see it (TRL's environment factory: one environment per rollout, their tools in
    ``_env_tools``, each rollout's tool dict wrapped by the protocol), the environments and the stats."""
    cls = make_environment_factory(list(tools))
    envs = [cls() for _ in range(n)]
    for env in envs:
        env.reset()
    turns = ToolTurns(protocol or HermesProtocol(), tokenizer, max_context_tokens, max_tool_images)
    sync = [{fn.__name__: getattr(env, fn.__name__) for fn in tools} for env in envs]
    for env, tool_dict in zip(envs, sync, strict=True):
        turns.tools_for(tool_dict, env, 0)
    trainer = SimpleNamespace(
        _tool_turns=turns,
        _tokenizer=tokenizer,
        environments=envs,
        environment_factories=[cls],
        _env_tools={None: [getattr(envs[0], fn.__name__) for fn in tools]},
        _batch_environments=[None] * n,
        tools=[],
        _sync_tool_dicts=sync,
        max_turn_tokens=max_turn_tokens,
        max_completion_length=max_completion,
        max_tool_calling_iterations=iterations,
        _in_tool_loop=False,
    )
    stats = TurnStats()
    return trainer, envs, stats


def end_turns(early: EarlyCalls, rows: list[list[int]], ended: dict[int, list[int]]) -> bool:
    """One generation of ``rows`` whose decode hands ``ended`` (batch row -> tokens) to its listener, as
    ``fast_decode`` does; False where the decode would have no listener."""
    with early.generation(rows):
        watch = row_ends.watch(len(rows), 0)
        if watch is None:
            return False
        watch.listener(ended)
    wait([f for env in early.environments for futures in env._prefetched.values() for f in futures])  # ran
    return True


def collect(env, x: int) -> str:
    """TRL's call of ``double(x=x)`` for this rollout (a started call is collected, never run again)."""
    return env.double(x=x)


def test_a_first_turns_calls_start_as_it_ends_and_run_once(tokenizer):
    trainer, envs, stats = setup(tokenizer)
    early = EarlyCalls(trainer, stats)
    rows = [prompt(tokenizer, 0), prompt(tokenizer, 1)]
    assert end_turns(early, rows, {1: encode(tokenizer, call_turn("7"))})  # the model wrote "7": typed to 7
    assert envs[1]._ahead and not envs[0]._ahead
    assert (stats.early_calls, stats.early_turns) == (1, 1)
    assert collect(envs[1], 7) == "14"
    assert LOG == [("double", 7)]  # once, for rollout 1
    # Two calls in one turn: both start, counted as one turn.
    two = "<tool_call>\n" + json.dumps({"name": "double", "arguments": {"x": 2}}) + "\n</tool_call>\n"
    assert end_turns(early, rows, {0: encode(tokenizer, two + call_turn(3))})
    assert (stats.early_calls, stats.early_turns) == (3, 2)
    assert not envs[1]._ahead  # the next generation: the previous round's mark is cleared
    assert (collect(envs[0], 2), collect(envs[0], 3)) == ("4", "6")
    assert sorted(LOG) == [("double", 2), ("double", 3), ("double", 7)]


def test_turns_that_call_nothing_early_start_nothing(tokenizer):
    trainer, envs, stats = setup(tokenizer, tools=(double, halve))
    early = EarlyCalls(trainer, stats)
    rows = [prompt(tokenizer, 0), prompt(tokenizer, 1)]
    ended = {
        0: encode(tokenizer, "<answer>4</answer><|im_end|>"),  # an answer
        1: encode(tokenizer, call_turn(5, tool="halve")),  # a tool that runs in TRL's order
    }
    assert end_turns(early, rows, ended)
    assert LOG == [] and stats.early_calls == 0 and not any(env._prefetched for env in envs)
    assert not any(env._ahead for env in envs)


def test_only_runs_with_a_parallel_tool_listen_to_the_decode(tokenizer):
    trainer, _, stats = setup(tokenizer, tools=(halve,), protocol=StopHermes())
    rows = [prompt(tokenizer, 0), prompt(tokenizer, 1)]
    assert not end_turns(EarlyCalls(trainer, stats), rows, {})
    trainer, _, stats = setup(tokenizer, tools=(halve, double))
    assert end_turns(EarlyCalls(trainer, stats), rows, {})
    assert row_ends.watch(2, 0) is None  # the listener is gone after the generation


def test_first_turns_need_one_row_per_environment_and_a_tool_round(tokenizer):
    rows = [prompt(tokenizer, 0), prompt(tokenizer, 1)]
    turn = {0: encode(tokenizer, call_turn(1))}
    for iterations, started in ((0, False), (1, True)):
        trainer, _, stats = setup(tokenizer, iterations=iterations)
        assert end_turns(EarlyCalls(trainer, stats), rows, turn) is started
    trainer, _, stats = setup(tokenizer, n=3)  # rows of another batch than the environments'
    assert not end_turns(EarlyCalls(trainer, stats), rows, turn)
    assert LOG == [("double", 1)]


def loop_round(tokenizer, trainer, early):
    """TRL's loop after first turns that called ``double`` (x = rollout): its lists, and the histories of the
    rows of the first round (prompt, completion, the tool reply up to the next assistant header)."""
    n = len(trainer.environments)
    prompt_ids = [prompt(tokenizer, k) for k in range(n)]
    completion_ids = [encode(tokenizer, call_turn(k)) for k in range(n)]
    completions = [[{"role": "assistant", "content": ""}, {"role": "tool", "content": str(2 * k)}] for k in range(n)]
    early.enter_loop(prompt_ids, completion_ids, completions)
    trainer._in_tool_loop = True
    reply = encode(
        tokenizer, "\n<|im_start|>user\n<tool_response>\n0\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    return [p + c + reply for p, c in zip(prompt_ids, completion_ids, strict=True)]


def test_loop_rounds_start_calls_below_the_iteration_limit(tokenizer):
    trainer, envs, stats = setup(tokenizer, iterations=3)
    early = EarlyCalls(trainer, stats)
    rows = loop_round(tokenizer, trainer, early)
    for round_ in (1, 2, 3):  # generations inside the loop: TRL calls tools after rounds 1 and 2, not 3
        assert end_turns(early, rows, {1: encode(tokenizer, call_turn(10 + round_))}) is (round_ < 3)
    assert LOG == [("double", 11), ("double", 12)], LOG
    assert (collect(envs[1], 11), collect(envs[1], 12)) == ("22", "24") and len(LOG) == 2
    # A new loop starts its rounds again.
    rows = loop_round(tokenizer, trainer, early)
    assert end_turns(early, rows, {0: encode(tokenizer, call_turn(20))})
    assert LOG[-1] == ("double", 20)


def test_a_loop_round_before_the_loop_started_starts_nothing(tokenizer):
    trainer, _, stats = setup(tokenizer)
    early = EarlyCalls(trainer, stats)
    trainer._in_tool_loop = True
    assert not end_turns(early, [prompt(tokenizer, 0)], {0: encode(tokenizer, call_turn(1))})
    assert LOG == []


def test_a_loop_rows_call_goes_to_its_own_rollout(tokenizer):
    """TRL's round holds rollouts 1 and 2 only (0 answered): row 0 is rollout 1's, row 1 rollout 2's."""
    trainer, envs, stats = setup(tokenizer, n=3)
    early = EarlyCalls(trainer, stats)
    rows = loop_round(tokenizer, trainer, early)
    early.loop[2][0][-1] = {"role": "assistant", "content": "<answer>0</answer>"}
    assert end_turns(early, rows[1:], {0: encode(tokenizer, call_turn(31)), 1: encode(tokenizer, call_turn(32))})
    assert [sorted(env._prefetched) for env in envs] == [[], ['double{"x": 31}'], ['double{"x": 32}']]
    assert (collect(envs[1], 31), collect(envs[2], 32)) == ("62", "64") and sorted(LOG) == [
        ("double", 31),
        ("double", 32),
    ]


def test_a_turn_is_read_within_the_turn_budget(tokenizer):
    """``--max_turn_tokens``: the turn keeps that many tokens; a call it cuts off never starts."""
    turn = encode(tokenizer, call_turn(4))
    whole = len(turn) - 1  # the call's tokens without the end of turn
    for budget, started in ((whole - 1, False), (whole, True)):
        LOG.clear()
        trainer, envs, stats = setup(tokenizer, max_turn_tokens=budget)
        end_turns(EarlyCalls(trainer, stats), [prompt(tokenizer, 0), prompt(tokenizer, 1)], {0: turn})
        assert (LOG == [("double", 4)]) is started, budget
        assert bool(envs[0]._prefetched) is started


def test_a_turn_is_read_within_the_context_budget(tokenizer):
    """``--max_context_tokens``: a turn whose context reaches the budget calls nothing (TRL's reading counts the
    stop once: the early reading counts nothing)."""
    rows = [prompt(tokenizer, 0), prompt(tokenizer, 1)]
    turn = encode(tokenizer, call_turn(4))
    for extra, started in ((1, True), (0, False)):
        LOG.clear()
        trainer, _, stats = setup(tokenizer, max_context_tokens=len(rows[0]) + len(turn) + extra)
        end_turns(EarlyCalls(trainer, stats), rows, {0: turn})
        assert (LOG == [("double", 4)]) is started, extra
        assert trainer._tool_turns.context_stops == 0


def test_a_loop_turn_is_cut_at_the_completion_budget_as_trl_cuts_it(tokenizer):
    """In a loop round, TRL keeps ``max_completion_length`` tokens of the completion (turns and tool replies): a
    call beyond them never starts; one that fits does."""
    turn = encode(tokenizer, call_turn(6))[:-1]  # the row ran into the completion budget: no end of turn
    for spare, started in ((0, True), (-1, False), (-2, False)):
        LOG.clear()
        trainer, _, stats = setup(tokenizer)
        early = EarlyCalls(trainer, stats)
        rows = loop_round(tokenizer, trainer, early)
        used = len(rows[0]) - len(early.loop[0][0])  # the completion so far: first turn and tool reply
        trainer.max_completion_length = used + len(turn) + spare  # one token short: "</tool_call" is no call
        end_turns(early, rows, {0: turn})
        assert (LOG == [("double", 6)]) is started, spare


def test_a_rollout_at_its_image_budget_starts_nothing(tokenizer):
    trainer, envs, stats = setup(tokenizer, max_tool_images=2)
    trainer._tool_turns.image_counts[id(envs[0])]["images"] = 2
    end_turns(
        EarlyCalls(trainer, stats),
        [prompt(tokenizer, 0), prompt(tokenizer, 1)],
        {0: encode(tokenizer, call_turn(1)), 1: encode(tokenizer, call_turn(2))},
    )
    assert LOG == [("double", 2)]


def test_a_stop_string_decides_a_live_row(tokenizer):
    """With a stop string, a row still decoding that wrote it is decided; its turn is read up to the stop."""
    trainer, _, stats = setup(tokenizer, protocol=StopHermes())
    early = EarlyCalls(trainer, stats)
    assert early._decided(encode(tokenizer, 'x": 1}}\n</tool_call> and'))
    assert not early._decided(encode(tokenizer, 'x": 1}}\n</tool_call'))
    special = type("StopAtSpecial", (HermesProtocol,), {"stop": ("<|vision_end|>",)})()  # a special token
    trainer_special, _, stats_special = setup(tokenizer, protocol=special)
    assert EarlyCalls(trainer_special, stats_special)._decided(encode(tokenizer, "a<|vision_end|>"))
    rows = [prompt(tokenizer, 0), prompt(tokenizer, 1)]
    after = " and then <tool_call>\n" + json.dumps({"name": "double", "arguments": {"x": 9}})
    assert end_turns(early, rows, {0: encode(tokenizer, call_turn(8, after=after))})
    assert LOG == [("double", 8)]  # what follows the stop string is dropped
    with early.generation(rows):
        assert row_ends.watch(2, 0).decided == early._decided
    trainer, _, stats = setup(tokenizer)
    with EarlyCalls(trainer, stats).generation(rows):
        assert row_ends.watch(2, 0).decided is None  # no stop string: only ended rows are handed over


def test_rows_in_doubt_are_counted_and_logged(tokenizer, caplog):
    trainer = SimpleNamespace(_tool_turns=None, _tokenizer=None, environments=())
    stats = TurnStats()
    early = EarlyCalls(trainer, stats)
    tool = {"role": "tool", "content": "x"}
    early.enter_loop([[1], [1], [1]], [[2], [2], [2]], [[tool], [tool], [tool]])  # three rollouts, one history
    caplog.set_level(logging.DEBUG, logger="vlm_grpo.tools.early_calls")
    assert early._match([[1, 2, 3], [1, 2, 4]]) == [None, None]
    assert early._match([[1, 2, 3]]) == [None]
    assert stats.early_unmatched == 3  # summed over the rounds of the generation
    messages = [r.getMessage() for r in caplog.records if r.name == "vlm_grpo.tools.early_calls"]
    assert messages == [
        "early tool calls: 2 of 2 rows of the round left to TRL's loop",
        "early tool calls: 1 of 1 rows of the round left to TRL's loop",
    ]


@pytest.mark.parametrize(
    ("turn", "context", "in_loop", "expected"),
    [
        (None, None, False, None),
        (5, None, False, [5, 5]),
        (None, 30, False, [20, 1]),  # the first turn keeps a token
        (None, 30, True, [20, 0]),
        (12, 30, False, [12, 1]),
        (25, 30, False, [20, 1]),
    ],
)
def test_turn_rooms(turn, context, in_loop, expected):
    """Each row's turn keeps at most ``--max_turn_tokens`` and what its context leaves of ``--max_context_tokens``
    (rows of 10 and 35 prompt tokens; completion budget 64)."""
    trainer = SimpleNamespace(
        max_turn_tokens=turn,
        max_completion_length=64,
        _tool_turns=SimpleNamespace(max_context_tokens=context),
        _in_tool_loop=in_loop,
    )
    assert turn_rooms(trainer, [[0] * 10, [0] * 35]) == expected
    trainer._tool_turns = None  # runs without tools: only the turn budget
    assert turn_rooms(trainer, [[0] * 10, [0] * 35]) == (None if turn is None else [turn, turn])


# The decode's hand-over of ended rows.


def workspace(out: list[list[int]], unfinished: list[bool], order: list[int], eos=(50, 51)):
    """A decode's workspace as the watch reads it: positions (after compaction, not batch order), each with its
    batch row (``order``), its prompt and tokens (``out``), and whether it still decodes."""
    selection = SimpleNamespace(out=torch.tensor(out), unfinished=torch.tensor(unfinished), eos=torch.tensor(list(eos)))
    return SimpleNamespace(selection=selection, order=torch.tensor(order))


def test_the_decode_hands_each_ended_row_once_cut_after_its_eos():
    told: list[dict] = []
    with row_ends.listening(told.append):
        watch = row_ends.watch(3, 2)
    assert row_ends.watch(3, 2) is None  # the listener is gone after the block
    # Prompt columns [9, 9]; position 0 holds batch row 2, position 2 batch row 0 (compacted).
    out = [[9, 9, 1, 51, 7, 50], [9, 9, 2, 3, 4, 5], [9, 9, 6, 50, 0, 0]]
    watch(workspace(out, [False, True, True], [2, 1, 0]), 3)
    assert told == [{2: [1, 51]}]  # up to and including the first EOS (any of them)
    watch(workspace(out, [False, True, True], [2, 1, 0]), 3)
    assert len(told) == 1  # nothing new: no call
    watch(workspace(out, [False, True, False], [2, 1, 0]), 4)
    assert told[1] == {0: [6, 50]}
    watch(workspace(out, [False, False, False], [2, 1, 0]), 4)
    assert told[2] == {1: [2, 3, 4, 5]}  # ended at the length limit: all its tokens


def test_a_decided_live_row_is_handed_with_its_tokens_so_far():
    tails: list[list[int]] = []
    told: list[dict] = []

    def decided(tail):
        tails.append(tail)
        return 7 in tail

    length = row_ends.TAIL + 6
    row = list(range(100, 100 + length))
    with row_ends.listening(told.append, decided):
        watch = row_ends.watch(2, 1)
    out = [[0, *row], [0, *row[:-3], 7, *row[-2:]]]
    watch(workspace(out, [True, True], [0, 1]), 3)  # few tokens yet: all of them
    assert tails == [row[:3], row[:3]] and told == []
    tails.clear()
    watch(workspace(out, [True, True], [0, 1]), length)  # the last TAIL tokens
    assert tails == [row[-row_ends.TAIL :], out[1][-row_ends.TAIL :]]
    assert told == [{1: out[1][1:]}]
    tails.clear()
    watch(workspace(out, [True, True], [0, 1]), length)
    assert tails == [row[-row_ends.TAIL :]] and len(told) == 1  # a row told is not asked again


def test_rows_that_end_are_handed_over_with_the_decided_ones():
    """A check that asks live rows whether they decided their turn still hands over the rows that ended."""
    told: list[dict] = []
    with row_ends.listening(told.append, lambda tail: 7 in tail):
        watch = row_ends.watch(3, 0)
    out = [[1, 2, 3, 4], [1, 7, 3, 4], [1, 50, 0, 0]]
    watch(workspace(out, [True, True, False], [0, 1, 2]), 4)
    assert told == [{1: [1, 7, 3, 4], 2: [1, 50]}]
    watch(workspace(out, [True, True, False], [0, 1, 2]), 4)
    assert len(told) == 1


def test_listening_without_a_listener_and_nested_blocks():
    with row_ends.listening(None, lambda tail: True):
        assert row_ends.watch(1, 0) is None
    outer = []
    with row_ends.listening(outer.append):
        with row_ends.listening(None):
            assert row_ends.watch(1, 0) is None
        assert row_ends.watch(1, 0).listener == outer.append
        with pytest.raises(RuntimeError), row_ends.listening(print):
            raise RuntimeError
        assert row_ends.watch(1, 0).listener == outer.append
    assert row_ends.watch(1, 0) is None
