"""Calls of parallel tools started ahead of TRL's tool loop (``prefetch_tool_calls``, ``ToolBatch``), fast: which
rollouts' calls start (the last assistant turn's calls of parallel tools, up to the first of another tool), which
never start (a turn already started, a rollout whose calls ran as its turn ended, a rollout at its image budget,
rows without an environment), and that each call runs once. The tools log every run, so a call run twice or never
shows in the log."""

from __future__ import annotations

from concurrent.futures import wait

import pytest

from test_early_calls_unit import LOG, double, fresh_tool_threads, halve  # noqa: F401  (autouse: own tool threads)
from vlm_grpo.tools import rollouts
from vlm_grpo.tools.base import make_environment_factory
from vlm_grpo.tools.protocols import PROTOCOLS, function_call
from vlm_grpo.tools.rollouts import ToolBatch, ToolTurns, prefetch_tool_calls


@pytest.fixture
def factory():
    return make_environment_factory([double, halve], {})


def settle(*envs) -> list[tuple[str, int]]:
    """The tool runs once every started call has finished."""
    wait([f for env in envs for futures in env._prefetched.values() for f in futures])
    return sorted(LOG)


def turn(*calls) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [function_call(n, {"x": x}) for n, x in calls]}


def test_the_last_turns_parallel_calls_start_once_up_to_another_tools_call(factory):
    first, second, third = factory(), factory(), factory()
    for env in (first, second, third):
        env.reset()
    completions = [
        [turn(("double", 1), ("double", 2), ("halve", 8), ("double", 3))],
        [turn(("double", 4)), {"role": "tool", "name": "double", "content": "8"}],  # the reply is in: nothing new
        [turn(("halve", 6), ("double", 5))],  # its first call is not of a parallel tool
        [turn(("double", 7))],  # no environment: plain tools
    ]
    seen: set[int] = set()
    assert prefetch_tool_calls([first, second, third, None], completions, seen) == 1
    assert settle(first, second, third) == [("double", 1), ("double", 2)]
    assert prefetch_tool_calls([first, second, third, None], completions, seen) == 0  # the same turns: not again
    assert first.double(x=1) == "2" and first.double(x=2) == "4"  # TRL's calls collect the results
    assert sorted(LOG) == [("double", 1), ("double", 2)]


def test_rollouts_started_already_or_at_their_image_budget_start_nothing(factory):
    ahead, full, free = factory(), factory(), factory()
    for env in (ahead, full, free):
        env.reset()
    ahead._ahead = True  # its calls started as its turn ended
    turns = ToolTurns(PROTOCOLS.get("hermes"), None, max_tool_images=1)
    for env in (ahead, full, free):
        turns.tools_for({}, env, 0)
    turns.image_counts[id(full)]["images"] = 1
    completions = [[turn(("double", 1))], [turn(("double", 2))], [turn(("double", 3))]]
    assert prefetch_tool_calls([ahead, full, free], completions, set(), turns) == 1
    assert settle(ahead, full, free) == [("double", 3)]


def test_a_tool_batch_starts_each_round_once_and_lets_go_of_its_rollouts(factory):
    envs = [factory(), factory()]
    for env in envs:
        env.reset()
    completions = [[turn(("double", 1))], [turn(("double", 2))]]
    with ToolBatch([*envs, None], completions) as batch:
        assert [env._batch for env in envs] == [batch, batch]
        assert settle(*envs) == [("double", 1), ("double", 2)]
        assert [envs[0].double(x=1), envs[1].double(x=2)] == ["2", "4"]
        for row, x in ((0, 5), (1, 6)):  # TRL appends the replies and the next turns
            completions[row] += [{"role": "tool", "content": "r"}, turn(("double", x))]
        assert envs[0].double(x=5) == "10"  # the round's first call starts every rollout's calls
        assert settle(*envs) == [("double", 1), ("double", 2), ("double", 5), ("double", 6)]
        assert batch.prefetch() == 0
    assert [env._batch for env in envs] == [None, None]
    assert rollouts._EXECUTOR is not None


def test_calls_whose_arguments_are_not_an_object_end_what_starts(factory):
    env = factory()
    env.reset()
    unread = {"type": "function", "function": {"name": "double", "arguments": '{"x": 2}'}}
    completions = [[{"role": "assistant", "tool_calls": [*turn(("double", 1))["tool_calls"], unread]}]]
    assert prefetch_tool_calls([env], completions, set()) == 1
    assert settle(env) == [("double", 1)]
    env.reset()
    completions = [[{"role": "assistant", "tool_calls": [{"type": "function"}, *turn(("double", 3))["tool_calls"]]}]]
    assert prefetch_tool_calls([env], completions, set()) == 0
