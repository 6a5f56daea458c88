"""Rows of a :func:`~vlm_grpo.fastpath.decode.fast_decode` call that have ended, told to a listener while the other
rows still decode.

The decode checks on the host every few tokens whether every row has ended (``decode._CHECK_EVERY``). Where a
listener is set (:func:`listening`, for the calls made inside the block), each check also hands it the rows that have
ended since the last one: their batch row and their tokens up to and including the first EOS. The tool loop uses it
to start a rollout's tool calls as soon as its turn has ended (:mod:`vlm_grpo.tools.early_calls`). A listener may
also say, from the last few tokens of a row still decoding, that its turn is decided already (a tool protocol's stop
string, after which the turn is cut): that row is then handed over too, with its tokens so far. The decode's tokens
are unchanged; without a listener nothing is read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

#: What a listener gets: batch row -> its tokens (cut after the first EOS).
Listener = Callable[[dict[int, list[int]]], None]
#: Whether a row still decoding has decided its turn, from its last tokens (at least TAIL of them, or all it has).
Decided = Callable[[list[int]], bool]

TAIL = 24  # tokens of a live row handed to ``decided``: the steps since the last check and a stop string's length

_LISTENER: ContextVar[tuple[Listener, Decided | None] | None] = ContextVar("vlm_grpo_row_ends", default=None)


@contextmanager
def listening(listener: Listener | None, decided: Decided | None = None) -> Iterator[None]:
    """Decodes inside the block tell ``listener`` (None: nobody) which rows have ended, and which rows still
    decoding have decided their turn (``decided``; None: none before its end)."""
    token = _LISTENER.set((listener, decided) if listener is not None else None)
    try:
        yield
    finally:
        _LISTENER.reset(token)


class Watch:
    """The rows of one decode already told to the listener."""

    def __init__(self, listener: Listener, decided: Decided | None, rows: int, prompt_len: int) -> None:
        self.listener = listener
        self.decided = decided
        self.rows = rows
        self.prompt_len = prompt_len
        self.told: set[int] = set()

    def __call__(self, ws: Any, produced: int) -> None:
        """At a host check: ``ws``, the decode's workspace (``order``: the batch row at each position, finished rows
        included); ``produced``: the decode steps run so far."""
        sel = ws.selection
        unfinished = sel.unfinished[: self.rows].tolist()
        order = ws.order[: self.rows].tolist()
        new = [p for p in range(self.rows) if not unfinished[p] and order[p] not in self.told]
        if self.decided is not None:
            live = [p for p in range(self.rows) if unfinished[p] and order[p] not in self.told]
            if live:
                start = self.prompt_len + max(0, produced - TAIL)
                tails = sel.out[live, start : self.prompt_len + produced].tolist()
                new += [p for p, tail in zip(live, tails, strict=True) if self.decided(tail)]
        if not new:
            return
        tokens = sel.out[new, self.prompt_len : self.prompt_len + produced].tolist()
        eos = set(sel.eos.tolist())
        out = {}
        for position, row in zip(new, tokens, strict=True):
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            out[order[position]] = row[:cut]
            self.told.add(order[position])
        self.listener(out)


def watch(rows: int, prompt_len: int) -> Watch | None:
    """The watch of a decode of ``rows`` rows after ``prompt_len`` prompt columns, or None without a listener."""
    current = _LISTENER.get()
    return Watch(*current, rows, prompt_len) if current is not None else None
