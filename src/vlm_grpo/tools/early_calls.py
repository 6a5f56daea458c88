"""A rollout's tool calls start the moment its turn has ended, while the other rollouts of the round still decode.

TRL's tool loop runs in rounds: every rollout's turn is generated, then the tools are called, then the next turns
are generated. With parallel tools (:func:`~vlm_grpo.tools.rollouts.prefetch_tool_calls`) the calls of a round run
at the same time, so a round costs the slowest turn plus the slowest call. Here, while a turn is decoded with
``fast_decode``, every host check of the decode hands the rows that have ended (:mod:`vlm_grpo.fastpath.row_ends`)
to :class:`EarlyCalls`, which reads each turn exactly as the trainer and TRL's loop will read it after the decode:
the turn budgets (``--max_turn_tokens``, ``--max_context_tokens``), the protocol's stop string, TRL's cut at
``max_completion_length``, TRL's ``parse_response`` and the protocol's reading (answer, malformed action, unknown
tool, context budget), and starts the turn's calls of parallel tools in the thread pool. TRL's own call then
collects the result, exactly once (the environment hands each started call to one caller), and the rollout's calls
are not started again after the round. A round then costs about the longest of each rollout's turn plus its calls.

Only calls TRL's loop will make start early: the turn's round is below ``max_tool_calling_iterations``; the row is
matched to its rollout without doubt (see :meth:`EarlyCalls._match`); the tool is
marked parallel (its rollouts run at the same time anyway; other tools run in TRL's order, when TRL calls them);
the rollout has not reached ``--max_tool_images`` (a call the budget refuses never runs). Everything else runs when
TRL's loop calls it, as before. Turns decoded by ``generate`` (TRL's path) start nothing early.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from vlm_grpo.fastpath import row_ends
from vlm_grpo.tools.base import ToolEnvironment
from vlm_grpo.tools.rollouts import ToolTurns, is_parallel, parallel_calls, tool_executor

logger = logging.getLogger(__name__)


def _ordered(fits: list[list[int]]) -> list[int | None]:
    """The first increasing pick, one of ``fits[k]`` (ascending) for each ``k``; all None where there is none."""
    picks: list[int | None] = []
    previous = None
    for options in fits:
        pick = next((i for i in options if previous is None or i > previous), None)
        if pick is None:
            return [None] * len(fits)
        picks.append(pick)
        previous = pick
    return picks


def turn_rooms(trainer: Any, prompt_ids: Sequence[Sequence[int]]) -> list[int] | None:
    """The most tokens each row's turn keeps (``--max_turn_tokens``; a row's whole context within
    ``--max_context_tokens``), or None where no budget applies. The first turn keeps a token: TRL's bookkeeping needs
    a non-empty completion."""
    limit = trainer.max_turn_tokens
    turns = trainer._tool_turns
    budget = turns.max_context_tokens if turns is not None else None
    if limit is None and budget is None:
        return None
    rooms = [limit if limit is not None else trainer.max_completion_length] * len(prompt_ids)
    if budget is not None:
        least = 0 if trainer._in_tool_loop else 1
        rooms = [max(least, min(room, budget - len(ids))) for room, ids in zip(rooms, prompt_ids, strict=True)]
    return rooms


def _parallel_tools(cls: type) -> bool:
    """Whether an environment class has a tool marked ``parallel`` (``fn.parallel = True``)."""
    return any(is_parallel(cls, name) for name in dir(cls))


class EarlyCalls:
    """The early calls of one generation (a ``_generate`` call of the trainer: its first turns and tool loop),
    counted in ``stats`` (:class:`~vlm_grpo.fastpath.turn_cache.TurnStats`)."""

    def __init__(self, trainer: Any, stats: Any) -> None:
        self.trainer = trainer
        self.turns: ToolTurns = trainer._tool_turns
        self.tokenizer = trainer._tokenizer  # the tokenizer itself (inside the loop it stands behind the parser)
        self.environments = list(trainer.environments or [])
        # Only parallel tools start early: without one, the decode's checks read nothing (no host work per check).
        classes = {type(env) for env in self.environments if isinstance(env, ToolEnvironment)}
        self.parallel = any(_parallel_tools(cls) for cls in classes)
        self.loop: tuple | None = None  # TRL's loop's prompt_ids, completion_ids, completions
        self.round = 0  # generations inside the loop so far
        self.stats = stats

    def enter_loop(self, prompt_ids: list, completion_ids: list, completions: list) -> None:
        """TRL's tool loop starts with these lists (it updates them in place round after round)."""
        self.loop = (prompt_ids, completion_ids, completions)
        self.round = 0

    @contextmanager
    def generation(self, prompt_ids: Sequence[Sequence[int]]) -> Iterator[None]:
        """One generation call of the trainer (``prompt_ids``: its rows' histories): its decode's ended rows start
        their calls."""
        for env in self.environments:  # the previous round's calls have all been collected by now
            env._ahead = False
        listener = self._listener(prompt_ids) if self.parallel else None
        with row_ends.listening(listener, self._decided if self.turns.protocol.stop else None):
            yield

    def _decided(self, tail: list[int]) -> bool:
        """A row still decoding has written the protocol's stop string (PyVision's ``</code>``): the trainer cuts
        its turn there, whatever it writes next."""
        text = self.tokenizer.decode(tail, skip_special_tokens=False)
        return any(stop in text for stop in self.turns.protocol.stop)

    def _listener(self, rows: Sequence[Sequence[int]]) -> Any:
        trainer = self.trainer
        if trainer._in_tool_loop:
            self.round += 1
            if self.loop is None or self.round >= trainer.max_tool_calling_iterations:
                return None  # TRL's loop runs no tools after this turn
            rollouts = self._match(rows)
        elif trainer.max_tool_calling_iterations < 1 or len(rows) != len(self.environments):
            return None
        else:
            rollouts = list(range(len(rows)))
        rooms = turn_rooms(trainer, rows)

        def listener(ended: dict[int, list[int]]) -> None:
            for row, ids in ended.items():
                if rollouts[row] is not None:
                    self._start(rollouts[row], rows[row], ids, rooms[row] if rooms is not None else None)

        return listener

    def _match(self, rows: Sequence[Sequence[int]]) -> list[int | None]:
        """The rollout of each row of a loop round. TRL's rows are its rollouts waiting on tool replies (the last
        message a tool's), in order, less those it dropped at the completion budget; a row's history starts with its
        rollout's prompt and completion so far. Among the assignments that keep that order and those prefixes, a
        row whose rollout is the same in the first and the last one has it in all of them; the others (histories
        that several rollouts share, with one of them not in the round) get None."""
        prompt_ids, completion_ids, completions = self.loop
        waiting = [i for i, turns in enumerate(completions) if turns and turns[-1].get("role") == "tool"]
        heads = {i: np.asarray([*prompt_ids[i], *completion_ids[i]], dtype=np.int64) for i in waiting}
        fits = []
        for row in rows:
            ids = np.asarray(row, dtype=np.int64)
            fits.append(
                [i for i in waiting if heads[i].size <= ids.size and np.array_equal(ids[: heads[i].size], heads[i])]
            )
        first = _ordered(fits)
        mirrored = _ordered([[-i for i in reversed(options)] for options in reversed(fits)])  # the last, mirrored
        last = [None if i is None else -i for i in reversed(mirrored)]
        out = [a if a is not None and a == b else None for a, b in zip(first, last, strict=True)]
        if None in out:
            self.stats.early_unmatched += out.count(None)
            logger.debug("early tool calls: %d of %d rows of the round left to TRL's loop", out.count(None), len(out))
        return out

    def _start(self, rollout: int, prefix: Sequence[int], ids: list[int], room: int | None) -> None:
        """Read the ended turn ``ids`` of ``rollout`` (after ``prefix``) as TRL's loop will, and start its calls."""
        from trl.chat_template_utils import parse_response

        trainer, turns = self.trainer, self.turns
        env = self.environments[rollout] if rollout < len(self.environments) else None
        if not isinstance(env, ToolEnvironment):
            return
        ids = turns.cut(ids[:room] if room is not None else ids)  # the trainer's cuts, in its order
        if trainer._in_tool_loop:  # TRL's cut at the completion budget
            excess = len(prefix) - len(self.loop[0][rollout]) + len(ids) - trainer.max_completion_length
            ids = ids[: len(ids) - excess] if excess > 0 else ids
        if not ids or turns.at_image_budget(env):
            return
        if trainer.environment_factories is not None:
            tools = trainer._env_tools[trainer._batch_environments[rollout]]
        else:
            tools = trainer.tools
        message = parse_response(self.tokenizer, ids, prefix=list(prefix), tools=tools)
        names = tools if trainer._in_tool_loop else trainer._sync_tool_dicts[rollout]  # what the trainer reads with
        calls = parallel_calls(env, turns.read(message, ids, len(prefix), names, count=False).get("tool_calls"))
        if calls:
            self.stats.early_calls += len(calls)
            self.stats.early_turns += 1
            env._prefetch(calls, tool_executor())
            env._ahead = True
