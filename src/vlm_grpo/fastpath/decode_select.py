"""Token selection of :func:`vlm_grpo.fastpath.decode.fast_decode`: ``generate``'s logits processors, its softmax /
multinomial / argmax and its EOS bookkeeping, as device ops over static buffers.

Each decoded token used to run ~20 eager ops after the decode step's graph replay (the processors, sampling, the
EOS update, the writes for the next step): ~45 kernel launches a token, each its own gap on the GPU. With the
indices that move every token (the output column, the mask slot of the token fed next) held in device tensors,
nothing here depends on a host value, so the step's CUDA graph can capture the selection too: one replay a token.

That needs processors that read only the scores and their own settings, never the generated ids
(:data:`GRAPH_SAFE`); ``min_new_tokens``, which reads the generated length, runs in the graph as a version that
counts on the device. Others (repetition penalty, ``no_repeat_ngram_size``, ...) read ``input_ids`` up to the
current token, a shape that changes every step: the selection then runs eagerly after the replay, on the same
buffers, through the same code, with one info line. Either way the draws are ``torch.multinomial``'s on the same
generator in the same order, so the tokens are the ones the eager loop (and ``generate``) draws under the same seed.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

# Processors whose __call__ reads the scores and their own settings only (transformers' classes, by name).
GRAPH_SAFE = frozenset(
    {
        "TemperatureLogitsWarper",
        "TopKLogitsWarper",
        "TopPLogitsWarper",
        "MinPLogitsWarper",
        "SuppressTokensLogitsProcessor",
    }
)
# Reads the generated length (a host int): it runs in the graph as _MinNewTokensOnDevice, which counts on the device.
MIN_NEW_TOKENS = "MinNewTokensLengthLogitsProcessor"
# Processor settings a captured graph can bake in (tensors by their values, see signature).
_SETTINGS = (torch.Tensor, bool, int, float, str, type(None))


def _setting(value: Any) -> Any:
    """A processor attribute as a hashable value; tensors by their values (e.g. the suppressed token ids)."""
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), tuple(value.flatten().tolist()))
    return value  # one of _SETTINGS: in_graph_blocker turned other settings away


def in_graph_blocker(processors: Any) -> str | None:
    """Why the selection cannot run inside the decode graph (None: it can)."""
    for p in processors:
        name = type(p).__name__
        if name not in GRAPH_SAFE and name != MIN_NEW_TOKENS:
            return f"{name} is not known to read the scores only"
        for value in vars(p).values():
            if not isinstance(value, _SETTINGS):
                return f"{name} holds a {type(value).__name__} setting"
    return None


def signature(processors: Any) -> tuple:
    """What a captured selection bakes in from ``processors``: every class and setting (part of a kept graph's
    key). The prompt length ``min_new_tokens`` counts from is not baked in: the device version reads it per call."""
    return tuple(
        (type(p).__name__, tuple(sorted((k, _setting(v)) for k, v in vars(p).items() if k != "prompt_length_to_skip")))
        for p in processors
    )


class _MinNewTokensOnDevice:
    """``MinNewTokensLengthLogitsProcessor`` with the generated length taken from the selection's device counters
    instead of ``input_ids.shape``: the same scores (EOS ids at -inf while fewer than ``min_new_tokens`` are out)."""

    def __init__(self, processor: Any, selection: Selection) -> None:
        self.min_new_tokens, self.eos_token_id = processor.min_new_tokens, processor.eos_token_id
        self.selection = selection

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        new_tokens = self.selection.column - self.selection.start
        eos = torch.isin(torch.arange(scores.shape[-1], device=scores.device), self.eos_token_id)
        return torch.where(eos & (new_tokens < self.min_new_tokens), -math.inf, scores)


class Selection:
    """The selection's buffers (made once per decode workspace, so a kept graph finds them at the same addresses)
    and its two device-only steps: :meth:`open` before a decode forward, :meth:`select` after it.

    ``out``: the prompt ids, then each step's token (``generate``'s ``input_ids`` layout); ``column``: the next
    column of ``out``; ``slot``: the cache slot of the token fed next; ``unfinished`` / ``produced``: generate's
    unfinished rows and the steps produced while some row was unfinished (the output length); ``start``: where
    ``min_new_tokens`` starts counting. ``graph_processors``: what a captured graph calls, made at the first
    :meth:`load` and kept with the graph (it may hold tensors the graph reads)."""

    def __init__(self, rows: int, width: int, eos_count: int | None, device: torch.device) -> None:
        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.out, self.column, self.slot, self.start = longs(rows, width), longs(1), longs(1), longs(1)
        self.unfinished, self.produced, self.pad = longs(rows), longs(), longs()
        self.eos = longs(eos_count) if eos_count else None
        self.graph_processors: Any = None

    def load(self, input_ids: torch.Tensor, prefix: int, gc: Any, processors: Any) -> None:
        """Start a decode: the prompt's ids, the first slot and column, every row unfinished, the special tokens."""
        from transformers import LogitsProcessorList

        prompt_len = input_ids.size(1)
        self.out[:, :prompt_len].copy_(input_ids)
        self.column.fill_(prompt_len)
        self.slot.fill_(prefix)
        self.unfinished.fill_(1)
        self.produced.zero_()
        if self.eos is not None:
            self.eos.copy_(gc._eos_token_tensor.reshape(-1))
            self.pad.copy_(gc._pad_token_tensor)
        for p in processors:
            if type(p).__name__ == MIN_NEW_TOKENS:
                self.start.fill_(p.prompt_length_to_skip)
        if self.graph_processors is None:
            self.graph_processors = LogitsProcessorList(
                _MinNewTokensOnDevice(p, self) if type(p).__name__ == MIN_NEW_TOKENS else p for p in processors
            )

    def state(self) -> tuple[torch.Tensor, ...]:
        """What one selection step changes besides ``out`` past ``column`` (which the next step overwrites)."""
        return (self.column, self.slot, self.unfinished, self.produced)

    def open(self, mask: torch.Tensor, attend: bool | float) -> None:
        """The token fed now attends to itself: its slot of the mask opens."""
        mask.index_fill_(-1, self.slot, attend)

    def select(
        self, logits: torch.Tensor, processors: Any, input_ids: torch.Tensor, do_sample: bool,
        tokens: torch.Tensor, positions: torch.Tensor,
    ) -> None:  # fmt: skip
        """``generate``'s choice of the next token from ``logits``, written to ``out`` and fed back (``tokens``,
        ``positions``); ``input_ids``: what the processors see as the ids so far."""
        scores = processors(input_ids, logits.to(copy=True, dtype=torch.float32))
        if do_sample:
            next_tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            next_tokens = torch.argmax(scores, dim=-1)
        if self.eos is not None:
            self.produced.add_(self.unfinished.any())
            next_tokens = next_tokens * self.unfinished + self.pad * (1 - self.unfinished)
            self.unfinished.copy_(self.unfinished & ~torch.isin(next_tokens, self.eos))
        self.out.index_copy_(1, self.column, next_tokens[:, None])
        self.column.add_(1)
        self.slot.add_(1)
        tokens.copy_(next_tokens[:, None])
        positions.add_(1)


@dataclass(eq=False)
class InStep:
    """The selection as a decode step runs it inside its graph: open the fed token's slot, forward, select."""

    selection: Selection
    mask: torch.Tensor  # the workspace's whole mask (a window's view shares its storage)
    attend: bool | float
    do_sample: bool
    tokens: torch.Tensor
    positions: torch.Tensor

    def before(self) -> None:
        self.selection.open(self.mask, self.attend)

    def after(self, logits: torch.Tensor) -> None:
        sel = self.selection
        sel.select(logits, sel.graph_processors, sel.out, self.do_sample, self.tokens, self.positions)

    @contextlib.contextmanager
    def restored(self) -> Iterator[Callable[[], None]]:
        """For warm-up passes: yields ``reset``, which puts back what a step changed (the counters, the fed tokens
        and positions); the sampler's state is put back on exit, so warm-ups draw nothing the decode would."""
        tensors = (*self.selection.state(), self.tokens, self.positions)
        saved = [t.clone() for t in tensors]

        def reset() -> None:
            for t, s in zip(tensors, saved, strict=True):
                t.copy_(s)

        device = self.tokens.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield reset
            reset()
