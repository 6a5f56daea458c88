"""The decode loop's static cache: one write position for all layers, and the restore around a graph capture.

transformers' ``StaticLayer`` keeps its own write position per layer (``cumulative_length``) and advances it in
``update``. A decode step that writes one slot in every layer therefore advances 36 counters at 3B: 36 tiny kernels
a token in the compiled, captured step (~55 us of ~3.5 ms on an H100, ``decode_lengths.py --profile``). Every layer
of a decode step writes the same slot, so here the layers share one position tensor, and only the last layer
advances it. During a step every layer reads the position the step started at, and after it the position has moved
by one, as with the per-layer counters.

A decode whose rows end at different lengths need not hold every row's longest possible cache from the start:
:func:`resize` moves the cache into new storage with more slots (the next attention window) or fewer rows (after a
compaction), layer by layer.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers.cache_utils import StaticCache, StaticLayer


class SharedPositionLayer(StaticLayer):
    """A ``StaticLayer`` whose write position (``cumulative_length``) is a tensor shared with the cache's other
    layers; only the layer built with ``advances=True`` (the last) moves it."""

    def __init__(self, max_cache_len: int, position: torch.Tensor, advances: bool) -> None:
        super().__init__(max_cache_len)
        self.position, self.advances = position, advances

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.cumulative_length = self.position  # marked static by decode_cache, as StaticLayer marks its own

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new K/V at the shared position; the last layer then advances it. Returns the whole cache."""
        slots = torch.arange(key_states.size(-2), device=self.keys.device) + self.position
        if self.advances:
            self.position.add_(key_states.size(-2))
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        return self.keys, self.values


def decode_cache(config: Any, slots: int, sources: Any, rows: int) -> StaticCache:
    """A static cache of ``rows`` rows and ``slots`` slots for ``config``'s decoder, its layers allocated now with
    the dtypes and head shapes of ``sources`` (the prefill cache's layers), sharing one write position."""
    cache = StaticCache(config=config, max_cache_len=slots)
    kinds = {type(layer).__name__ for layer in cache.layers if type(layer) is not StaticLayer}
    if kinds:  # fast_decode sends these models to generate (unsupported_reason): reaching here is a bug
        raise ValueError(f"decode_cache: full-attention layers only, this decoder has {', '.join(sorted(kinds))}")
    position = torch.zeros((), dtype=torch.long, device=sources[0].keys.device)
    last = len(cache.layers) - 1
    cache.layers = [SharedPositionLayer(slots, position, advances=i == last) for i in range(len(cache.layers))]
    # Each layer's keys and values keep the prefill's dtypes, which may differ: under autocast with fp32 weights
    # the rotary embedding returns fp32 keys while the values stay bf16 (generate's dynamic cache holds the same).
    for layer, src in zip(cache.layers, sources, strict=True):
        layer.lazy_initialization(*(x.new_empty(rows, x.size(1), 0, x.size(-1)) for x in (src.keys, src.values)))
    torch._dynamo.mark_static_address(position)
    return cache


def narrowed(cache: StaticCache, rows: int) -> StaticCache:
    """The first ``rows`` rows of ``cache`` (from :func:`decode_cache`) as a cache of their own: each layer's keys and
    values are views of the same storage, and the layers share the same write position tensor, so a decode step over
    the narrow cache writes where the full one would, and the full one sees it."""
    view = copy.copy(cache)
    view.layers = []
    for layer in cache.layers:
        narrow = copy.copy(layer)
        narrow.keys, narrow.values, narrow.batch_size = layer.keys[:rows], layer.values[:rows], rows
        torch._dynamo.mark_static_address(narrow.keys)
        torch._dynamo.mark_static_address(narrow.values)
        view.layers.append(narrow)
    return view


def nbytes(cache: StaticCache) -> int:
    """The bytes of every layer's keys and values (their whole storage, not a view's part)."""
    return sum(x.untyped_storage().nbytes() for layer in cache.layers for x in (layer.keys, layer.values))


def slots_dynamic(cache: StaticCache) -> None:
    """Mark every layer's slot dimension dynamic for ``torch.compile`` (a cache that grows within a call compiles
    once). A function of its own: a loop in the decode would leave its variable holding the last tensor, and with it
    that storage, after the cache has moved out of it."""
    for layer in cache.layers:
        torch._dynamo.maybe_mark_dynamic(layer.keys, 2)
        torch._dynamo.maybe_mark_dynamic(layer.values, 2)


def resize(cache: StaticCache, rows: int, slots: int, written: int, dynamic: bool = False) -> int:
    """Move ``cache`` (from :func:`decode_cache`) into new storage of ``rows`` rows and ``slots`` slots per layer:
    its first ``rows`` rows' first ``written`` slots are copied, the other slots are zeros (a masked slot must not
    hold NaN: attention weights of 0 times NaN are NaN). Layer by layer, so that besides the new storage at most one
    tensor of the old is held (once nothing else, a view or a captured step, holds it). ``dynamic``: the slot
    dimension is marked dynamic for ``torch.compile`` (a cache that grows within a call compiles once).
    Returns the most bytes held at once while moving (the old storage, then the new, in between)."""
    held = peak = nbytes(cache)
    for layer in cache.layers:
        for name in ("keys", "values"):
            old = getattr(layer, name)
            new = old.new_empty(rows, old.size(1), slots, old.size(-1))
            new[:, :, :written].copy_(old[:rows, :, :written])
            new[:, :, written:].zero_()
            peak = max(peak, held + new.untyped_storage().nbytes())
            held += new.untyped_storage().nbytes() - old.untyped_storage().nbytes()
            torch._dynamo.mark_static_address(new)
            if dynamic:
                torch._dynamo.maybe_mark_dynamic(new, 2)
            setattr(layer, name, new)
            del old
        layer.max_cache_len, layer.batch_size = slots, rows
    return peak


@contextlib.contextmanager
def cache_restored(cache: Any) -> Iterator[Callable[[], None]]:
    """Put back, on exit, what decode forwards run inside wrote into ``cache`` (a StaticCache).

    A window's graph is captured mid-decode, and its warm-up passes run the real step: each writes its K/V at
    every layer's current length and advances that length (the capture itself only records). Saved here: each
    layer's length and the slot there. Yields ``rewind``, which sets the lengths back: called before each pass,
    every pass writes that one slot (never a slot the decode has written, never past the cache's end). The
    indices stay on the device: no host sync. On an exception nothing is restored (the decode is abandoned)."""
    saved = []
    for layer in cache.layers:
        slot = layer.cumulative_length.reshape(1).clone()
        saved.append((layer, slot, layer.keys.index_select(2, slot), layer.values.index_select(2, slot)))

    def rewind() -> None:
        for layer, slot, _, _ in saved:
            layer.cumulative_length.copy_(slot[0])

    yield rewind
    for layer, slot, keys, values in saved:
        layer.keys.index_copy_(2, slot, keys)
        layer.values.index_copy_(2, slot, values)
        layer.cumulative_length.copy_(slot[0])
