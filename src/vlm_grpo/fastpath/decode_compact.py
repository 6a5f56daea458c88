"""Rows that have finished leave :func:`vlm_grpo.fastpath.decode.fast_decode`'s batch: row compaction.

A GRPO batch decodes until its longest row ends. At EasyR1's shape (320 rows a GPU, completion lengths geometric
with mean ~500, capped at 2,048) one row nearly always runs to the cap, so a decode at full width spends ~3/4 of its
row-steps (GEMM rows, and attention reads over ever longer caches) on rows that have ended. So at the host's "every
row ended?" checks the decode also counts the live rows; when they fit a width of the halving chain of the batch
(rows, rows/2, rows/4, ... rounded up, down to :data:`MIN_ROWS`), its rows move: the live ones to the front, in their
order, the finished ones after them (cache slots, mask, fed tokens and positions, the selection's ids and flags), and
decoding goes on over the first rows only, through steps made (on a GPU: captured) for that width. Every buffer but
the cache is a view of the workspace's own storage, and ``order`` says which batch row each position holds; the
output (and an exported cache) is put back in batch order at the end. The cache stays as it is, or, with
``decode.SIZED_CACHE`` (off by default) and neither kept nor exported, moves into storage for the live rows
only. A finished row's output is its tokens, then padding, as before.

Sampling stays ``generate``'s draw under the same seed: ``torch.multinomial`` draws the noise of its Gumbel-max draw
(``Exp(1)``, one per row and vocabulary entry) for every row of the batch at once, so a narrower draw would move the
generator differently and give a live row other noise. A narrowed selection therefore draws the noise for the
whole batch, as the full-width decode does, and each live row takes its own batch row's (see
:meth:`vlm_grpo.fastpath.decode_select.Selection.noise`): the same tokens, and the generator left where ``generate``
leaves it. Greedy needs nothing.

Compaction needs logits processors that treat each row on its own (:data:`ROW_WISE`): a processor holding per-row
state (e.g. ``encoder_repetition_penalty``'s copy of the prompts) would be read in the wrong order; the decode then
keeps its full width, with one info line. Without an EOS token no row ends, and nothing moves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from vlm_grpo.fastpath.decode_cache import narrowed
from vlm_grpo.fastpath.decode_select import GRAPH_SAFE, MIN_NEW_TOKENS, Selection
from vlm_grpo.utils import warn_once

logger = logging.getLogger(__name__)

COMPACT = True  # False: every decode keeps its full width to the end (benchmarks compare the two)
# The narrowest width. A width of 1 would make torch.compile specialise the row count (a recompile).
MIN_ROWS = 2
# Processors whose output row depends only on that row's scores and ids (transformers' classes, by name).
ROW_WISE = GRAPH_SAFE | {
    MIN_NEW_TOKENS,
    "MinLengthLogitsProcessor",
    "RepetitionPenaltyLogitsProcessor",
    "NoRepeatNGramLogitsProcessor",
    "NoBadWordsLogitsProcessor",
    "SequenceBiasLogitsProcessor",
    "TypicalLogitsWarper",
    "EpsilonLogitsWarper",
    "EtaLogitsWarper",
    "ForcedBOSTokenLogitsProcessor",
    "ForcedEOSTokenLogitsProcessor",
    "ExponentialDecayLengthPenalty",
    "SuppressTokensAtBeginLogitsProcessor",
    "InfNanRemoveLogitsProcessor",
    "LogitNormalization",
}


@dataclass
class DecodeStats:
    """What one decode computed: ``row_steps`` rows summed over its ``steps`` (at full width that is
    :attr:`full_row_steps`), the widths it ran at, in order, and after how many steps it narrowed to each one past
    the first; the (rows, slots) of each storage its cache had, in order, and the most bytes its cache held at once
    (while moving into new storage: the old and the new)."""

    rows: int = 0
    steps: int = 0
    row_steps: int = 0
    widths: list[int] = field(default_factory=list)
    narrowed_at: list[int] = field(default_factory=list)
    allocations: list[tuple[int, int]] = field(default_factory=list)
    peak_cache_bytes: int = 0

    @property
    def full_row_steps(self) -> int:
        return self.rows * self.steps

    def narrowed(self, width: int, steps: int) -> None:
        """The decode goes on at ``width`` rows after ``steps`` steps."""
        self.widths.append(width)
        self.narrowed_at.append(steps)


# The last fast_decode call's (tests and benchmarks read it).
last_stats = DecodeStats()


def enabled(processors: Any, rows: int, has_eos: bool) -> bool:
    """Whether a decode of ``rows`` rows may compact; says once why not where rows could end but cannot leave."""
    if not COMPACT or not has_eos or rows < 2 * MIN_ROWS:
        return False
    blocker = next((type(p).__name__ for p in processors if type(p).__name__ not in ROW_WISE), None)
    if blocker is not None:
        warn_once(
            logger,
            f"fast_decode: finished rows stay in the decode batch to the end: {blocker} is not known to treat each "
            "row on its own",
            logging.INFO,
        )
    return blocker is None


def widths(rows: int) -> list[int]:
    """The widths a decode of ``rows`` rows may run at: ``rows``, then halved (rounded up) down to MIN_ROWS."""
    chain = [rows]
    while chain[-1] > MIN_ROWS:
        chain.append(max(MIN_ROWS, -(-chain[-1] // 2)))
    return chain


def narrower(rows: int, width: int, live: int) -> int | None:
    """The narrowest width of the chain that holds ``live`` rows, if narrower than ``width``; else None."""
    fits = [w for w in widths(rows) if live <= w < width]
    return min(fits) if fits else None


def first_rows(index: torch.Tensor, prompts: int | None = None) -> torch.Tensor:
    """Per row, the first row with the same unique prompt (``index[k]``, below ``prompts``; default: the row count,
    which a whole batch's index is below): the rows whose prompt slots it copies. No host sync."""
    rows = torch.arange(index.numel(), device=index.device)
    first = torch.full((prompts or index.numel(),), index.numel(), dtype=torch.long, device=index.device)
    return first.scatter_reduce(0, index, rows, "amin")[index]


@dataclass(eq=False)
class View:
    """The workspace's buffers as the steps of one width see them: views of its first ``rows`` rows."""

    rows: int
    cache: Any
    tokens: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    selection: Selection
    shared: tuple[torch.Tensor, torch.Tensor] | None


def view(ws: Any, rows: int) -> View:
    """The view of the first ``rows`` rows of the workspace ``ws`` (made once, kept with it: a step captured on it
    reads these addresses). At full width, the buffers themselves."""
    v = ws.views.get(rows)
    if v is None:
        if rows == ws.tokens.size(0):
            v = View(rows, ws.cache, ws.tokens, ws.positions, ws.mask, ws.selection, ws.shared)
        else:
            shared = None if ws.shared is None else (ws.shared[0][:rows], ws.shared[1])
            v = View(
                rows, narrowed(ws.cache, rows), ws.tokens[:rows], ws.positions[..., :rows, :], ws.mask[:rows],
                ws.selection.narrowed(rows, ws.order[:rows]), shared,
            )  # fmt: skip
        ws.views[rows] = v
    return v


def rows_dynamic(v: View, mask: torch.Tensor) -> None:
    """Mark the row dimension of what a compiled step reads dynamic (``maybe_mark_dynamic``: a hint, never an
    error): the fed tokens and positions, ``mask`` (the step's window of ``v.mask``), the cache, the prompt map and the
    selection's rows. Left alone, dynamo compiles the full width static and again with the rows dynamic at the first
    narrower width: two compilations (in a warm process, two traces and cache loads) instead of one."""
    mark = torch._dynamo.maybe_mark_dynamic
    sel = v.selection
    for x in (v.tokens, mask, sel.out, sel.unfinished, *([] if sel.draw_rows is None else [sel.draw_rows])):
        mark(x, 0)
    mark(v.positions, v.positions.dim() - 2)
    for layer in v.cache.layers:
        mark(layer.keys, 0)
        mark(layer.values, 0)
    if v.shared is not None:
        mark(v.shared[0], 0)


def compact(ws: Any, width: int, new: int, written: int, column: int, index: torch.Tensor) -> None:
    """Reorder the first ``width`` rows of ``ws``: its live rows first (in their order), then the finished ones, so the
    first ``new`` rows hold every live row. ``written``: the cache slots written so far; ``column``: the next column
    of the selection's ids; ``index``: each batch row's unique prompt. No host sync."""
    sel = ws.selection
    perm = torch.argsort((sel.unfinished[:width] == 0).to(torch.int8), stable=True)

    def move(x: torch.Tensor, dim: int = 0) -> None:
        x.copy_(x.index_select(dim, perm))

    for layer in ws.cache.layers:
        move(layer.keys[:width, :, :written])
        move(layer.values[:width, :, :written])
    move(ws.mask[:width, ..., :written])  # the slots past it are closed in every row
    move(ws.tokens[:width])
    move(ws.positions[..., :width, :], ws.positions.dim() - 2)
    move(sel.out[:width, :column])
    sel.out[new:width, column:].copy_(sel.pad.expand(width - new, sel.out.size(1) - column))  # their padding
    move(sel.unfinished[:width])
    move(ws.order[:width])
    if ws.shared is not None:  # each row's first row among the first `new`: prompt slots are in every row
        ws.shared[0][:new].copy_(first_rows(index[ws.order[:new]], index.numel()))


def in_batch_order(ws: Any, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` (one per workspace row, in the workspace's order) in batch order (a new tensor)."""
    return torch.empty_like(rows).index_copy_(0, ws.order, rows)


def cache_in_batch_order(ws: Any, written: int) -> None:
    """Put the workspace cache's first ``written`` slots of every row back in batch order (an exported cache)."""
    for layer in ws.cache.layers:
        for x in (layer.keys, layer.values):
            part = x[:, :, :written]
            part.copy_(in_batch_order(ws, part))
