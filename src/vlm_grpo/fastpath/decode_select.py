"""Token selection of :func:`vlm_grpo.fastpath.decode.fast_decode`: ``generate``'s logits processors, its softmax /
multinomial / argmax and its EOS bookkeeping, as device ops over static buffers.

Run eagerly, each decoded token takes ~20 ops after the decode step's graph replay (the processors, sampling, the
EOS update, the writes for the next step): ~45 kernel launches a token, each its own gap on the GPU. With the
indices that move every token (the output column, the mask slot of the token fed next) held in device tensors,
nothing here depends on a host value, so the step's CUDA graph can capture the selection too: one replay a token.

That needs processors that read only the scores and their own settings, never the generated ids
(:data:`GRAPH_SAFE`); ``min_new_tokens``, which reads the generated length, runs in the graph as a version that
counts on the device. Others (repetition penalty, ``no_repeat_ngram_size``, ...) read ``input_ids`` up to the
current token, a shape that changes every step: the selection then runs eagerly after the replay, on the same
buffers, through the same code, with one info line. Either way the draws are ``torch.multinomial``'s on the same
generator in the same order, so the tokens are the ones the eager loop (and ``generate``) draws under the same seed.

Inside a compiled step the selection goes through ``torch.compile`` too (:func:`compiled_select`): eagerly, its
float copy, softmax and ``torch.multinomial`` (whose checks and draw read the 16 x 152k probabilities six times)
took 158 us a token on an H100 (3B's vocabulary, 16 rows); compiled, with the draw spelled out as
:func:`sample_one`, 50 us (``benchmarks/micro/select_micro.py``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from vlm_grpo.fastpath.fallback import EagerOnFailure

logger = logging.getLogger(__name__)

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


# The draw's reductions run over slices of this many vocabulary entries, then over the slices: one program per row
# (16 rows of 152k entries) left the card nearly idle (53 us for the argmax alone, H100).
DRAW_SLICE = 1024


def _sliced(values: torch.Tensor, fill: float) -> torch.Tensor:
    """``values`` [rows, V] as [rows, slices, DRAW_SLICE], the last slice padded with ``fill``."""
    rows, v = values.shape
    slices = -(-v // DRAW_SLICE)
    return torch.nn.functional.pad(values, (0, slices * DRAW_SLICE - v), value=fill).view(rows, slices, DRAW_SLICE)


def sample_one(scores: torch.Tensor, q: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.multinomial(torch.softmax(scores, -1), num_samples=1).squeeze(1)`` spelled out as PyTorch computes
    it, for the compiled selection: the same checks, and the same draw, the first ``argmax(probs / q)`` with ``q ~
    Exp(1)`` from ``exponential_`` on the same generator, hence the same tokens under the same seed
    (tests/test_decode_select.py holds it to torch.multinomial). Every reduction runs over vocabulary slices and
    then over the slices, so inductor fuses them into a few kernels that spread over the card; compiled with
    ``fallback_random`` (:data:`SELECT_OPTIONS`), ``exponential_`` stays eager's own. ``q``: the noise, drawn
    already (:meth:`Selection.noise`)."""
    if q is None:  # first, as multinomial draws it: the checks below fuse with the rest
        q = torch.empty_like(scores).exponential_()
    peak = _sliced(scores, -math.inf).amax(-1).amax(-1, keepdim=True)
    exp = torch.exp(scores - peak)
    probs = exp / _sliced(exp, 0.0).sum(-1).sum(-1, keepdim=True)  # the softmax, its sums over slices
    p = _sliced(probs, 0.0)  # zeros change neither check
    valid = (p.amax(-1).amax(-1) < math.inf) & (p.amin(-1).amin(-1) >= 0)
    torch._assert_async(valid.all(), "probability tensor contains either `inf`, `nan` or element < 0")
    torch._assert_async((p.sum(-1).sum(-1) != 0).all(), "invalid multinomial distribution (sum of probabilities <= 0)")
    ratio = _sliced(probs / q, -math.inf)  # >= 0 (or nan) everywhere else: the padding never wins
    best, where = ratio.max(-1)  # the first maximum of each slice
    first = best.argmax(-1)  # the first slice holding the row's maximum
    return first * DRAW_SLICE + where.gather(-1, first[:, None]).squeeze(-1)


def multinomial_with(probs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``torch.multinomial(probs, 1).squeeze(1)`` with its noise ``q`` (``Exp(1)``, ``probs``' shape) given: the same
    checks and the same draw, the first ``argmax(probs / q)`` (tests/test_decode_compact.py holds it to
    torch.multinomial)."""
    valid = (probs.amax() < math.inf) & (probs.amin() >= 0)
    torch._assert_async(valid, "probability tensor contains either `inf`, `nan` or element < 0")
    torch._assert_async((probs.sum(-1) != 0).all(), "invalid multinomial distribution (sum of probabilities <= 0)")
    return (probs / q).argmax(-1)


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
    :meth:`load` and kept with the graph (it may hold tensors the graph reads).

    ``draw_rows`` / ``draw_width``: set on a :meth:`narrowed` selection, whose rows are ``draw_rows`` (a device
    tensor, read when a draw runs) of a decode of ``draw_width`` rows: see :meth:`noise`."""

    def __init__(self, rows: int, width: int, eos_count: int | None, device: torch.device) -> None:
        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        self.out, self.column, self.slot, self.start = longs(rows, width), longs(1), longs(1), longs(1)
        self.unfinished, self.produced, self.pad = longs(rows), longs(), longs()
        self.eos = longs(eos_count) if eos_count else None
        self.graph_processors: Any = None
        self.draw_rows: torch.Tensor | None = None
        self.draw_width = rows

    def narrowed(self, rows: int, draw_rows: torch.Tensor) -> Selection:
        """The selection of the first ``rows`` rows (views of ``out`` and ``unfinished``; the counters, the special
        tokens and the processors shared), whose row k draws as row ``draw_rows[k]`` of this one would."""
        view = copy.copy(self)
        view.out, view.unfinished = self.out[:rows], self.unfinished[:rows]
        view.draw_rows, view.draw_width = draw_rows, self.draw_width
        return view

    def noise(self, scores: torch.Tensor) -> torch.Tensor | None:
        """For a narrowed selection, the ``Exp(1)`` noise of its rows' draw: drawn for all ``draw_width`` rows, as
        ``torch.multinomial`` over the whole batch draws it, and the rows ``draw_rows`` taken. The generator then
        moves as it would at full width, and each row gets the noise it would have got there: the same token under
        the same seed. None at full width (``torch.multinomial`` draws its own)."""
        if self.draw_rows is None:
            return None
        q = torch.empty(self.draw_width, scores.size(-1), dtype=scores.dtype, device=scores.device).exponential_()
        return q.index_select(0, self.draw_rows)

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
            q = self.noise(scores)
            if torch.compiler.is_compiling():
                next_tokens = sample_one(scores, q)
            elif q is None:
                next_tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            else:
                next_tokens = multinomial_with(torch.softmax(scores, dim=-1), q)
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


# A compiled step's in-graph selection goes through torch.compile too (False: eagerly; benchmarks compare the two).
COMPILE = True
# Inductor options of the compiled selection: random ops stay eager's (exponential_ draws what multinomial would).
SELECT_OPTIONS: dict[str, Any] = {"fallback_random": True}
_compiled_select: EagerOnFailure | None = None


def compiled_select() -> EagerOnFailure:
    """:meth:`Selection.select` through ``torch.compile``, one per process (dynamo caches by code object: later
    calls' selections and processors reuse its graph). Where inductor fails (torch 2.11 cannot generate the top-p
    warper's cumulative sum on a GPU), one warning, and the process selects eagerly from then on."""
    global _compiled_select
    if _compiled_select is None:
        compiled = torch.compile(Selection.select, options=SELECT_OPTIONS)
        failed = "compile_decode: compiling the token selection failed"
        _compiled_select = EagerOnFailure(compiled, Selection.select, logger, failed)
    return _compiled_select


@dataclass(eq=False)
class InStep:
    """The selection as a decode step runs it inside its graph: open the fed token's slot, forward, select.
    ``compile``: the selection goes through :func:`compiled_select` (a compiled step's); eagerly if that fails."""

    selection: Selection
    mask: torch.Tensor  # the workspace's whole mask (a window's view shares its storage)
    attend: bool | float
    do_sample: bool
    tokens: torch.Tensor
    positions: torch.Tensor
    compile: bool = False

    def __post_init__(self) -> None:
        self._select = compiled_select() if self.compile and COMPILE else Selection.select

    def before(self) -> None:
        self.selection.open(self.mask, self.attend)

    def after(self, logits: torch.Tensor) -> None:
        sel = self.selection
        self._select(sel, logits, sel.graph_processors, sel.out, self.do_sample, self.tokens, self.positions)

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


def prepared_generation_config(base: Any, generation_config: Any, prompt_len: int, device) -> Any:
    """The generation config ``generate`` would use: model defaults merged, special tokens as tensors."""
    gc, _ = base._prepare_generation_config(copy.deepcopy(generation_config))
    if gc.max_new_tokens is not None:
        gc.max_length = prompt_len + gc.max_new_tokens
    base._prepare_special_tokens(gc, True, device=device)
    return gc


def default_generator(device: torch.device) -> torch.Generator | None:
    """The generator ``torch.multinomial`` draws from on ``device`` (the one generate samples with)."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator if device.type == "cpu" else None
