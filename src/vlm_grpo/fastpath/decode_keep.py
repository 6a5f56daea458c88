"""What a kept decode workspace (``keep_decode_graphs``) is checked against before its graphs replay, and whether to
keep one by default: see :func:`vlm_grpo.fastpath.decode.fast_decode`'s ``keep``."""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from vlm_grpo.fastpath.decode_fusion import kept_tensors
from vlm_grpo.utils import warn_once

logger = logging.getLogger(__name__)

# keep_decode_graphs None: keep the decode workspace and the fused copy between generation calls when together
# they take at most this fraction of the card's memory (3B on an 80 GB card: ~4.6 GB, kept; 7B: ~10 GB, not).
KEEP_FRACTION = 0.1
# Kept workspaces besides the last one, of other batch widths: a tool run's rounds alternate between the first
# turn's rows and the rows still calling tools, and each width would otherwise capture its graphs again every step.
# At most this many per decoder (the oldest goes first); with keep None, within KEEP_FRACTION with the rest.
SPARES = 2
_SPARE: weakref.WeakKeyDictionary[Any, dict[tuple, Any]] = weakref.WeakKeyDictionary()


def pointers(decoder: Any, head: Any) -> tuple:
    """Address, shape and strides of every tensor a decode step reads from the model: its parameters and buffers,
    the head's, and the fused copies (a graph replays reads from these addresses as it laid them out when captured;
    ZeRO-3 or ``model.to`` would move them)."""
    tensors = (*decoder.parameters(), *decoder.buffers(), *head.parameters(), *head.buffers(), *kept_tensors(decoder))
    return tuple((t.data_ptr(), tuple(t.shape), t.stride()) for t in tensors)


def modes(decoder: Any) -> tuple:
    """Per module, what a forward reads besides tensors and a graph would bake in: its class, train / eval, and a
    LoRA layer's active adapters, their switches and scalings."""
    out = []
    for m in decoder.modules():
        mode: tuple = (type(m), m.training)
        if hasattr(m, "active_adapters") and hasattr(m, "scaling"):
            mode += (tuple(m.active_adapters), m.disable_adapters, m.merged, tuple(sorted(m.scaling.items())))
        out.append(mode)
    return tuple(out)


def keep_by_default(use_graph: bool, device: torch.device, nbytes: int) -> bool:
    """``keep`` None: keep under a CUDA graph when the kept copy and cache take at most KEEP_FRACTION of the card."""
    if not use_graph:
        return False
    total = torch.cuda.get_device_properties(device).total_memory
    if nbytes <= KEEP_FRACTION * total:
        return True
    warn_once(
        logger,
        f"keep_decode_graphs: the decode graphs are captured again at every generation call: kept, the fused "
        f"weights and the cache would hold {nbytes / 2**30:.1f} GiB between calls, more than {KEEP_FRACTION:.0%} of "
        f"the card's {total / 2**30:.0f} GiB. Set keep_decode_graphs=True to keep them anyway.",
        logging.INFO,
    )
    return False


def _other_width(ws: Any, key: tuple, pointers: tuple | None = None) -> bool:
    """``ws`` differs from a call with ``key`` only in its rows (the key's first entry)."""
    return ws.key != key and ws.key[1:] == key[1:] and (pointers is None or ws.pointers == pointers)


def take(decoder: Any, ws: Any, key: tuple, slots: int, pointers: tuple) -> Any:
    """The kept workspace a call (``key``, ``slots``, the model's ``pointers``) can run in, or None: the last one
    (``ws``), or a spare of this width. The last one is parked as a spare when only its rows differ, else dropped;
    spares whose graphs read tensors that moved are dropped."""
    spares = {k: w for k, w in _SPARE.pop(decoder, {}).items() if k[1:] == key[1:] and w.pointers == pointers}
    if ws is not None and _other_width(ws, key, pointers):
        spares.pop(ws.key, None)
        spares[ws.key] = ws  # the newest spare
        ws = None
    elif ws is not None and (ws.key != key or ws.slots < slots or ws.pointers != pointers):
        ws = None  # its graphs bake in something else, or read tensors that moved
    if ws is None:
        spare = spares.pop(key, None)
        ws = spare if spare is not None and spare.slots >= slots else None
    while len(spares) > SPARES:
        spares.pop(next(iter(spares)))
    if spares:
        _SPARE[decoder] = spares
    return ws


def drop_spares(decoder: Any) -> None:
    _SPARE.pop(decoder, None)


def spare_nbytes(decoder: Any, kept: Any, key: tuple) -> int:
    """Bytes of the caches the spares hold after a call with ``key`` (the last workspace ``kept`` included when it
    would be parked)."""
    parked = list(_SPARE.get(decoder, {}).values())
    if kept is not None and _other_width(kept, key):
        parked.append(kept)
    return sum(x.nbytes for ws in parked for layer in ws.cache.layers for x in (layer.keys, layer.values))


def within_budget(device: torch.device, nbytes: int) -> bool:
    return nbytes <= KEEP_FRACTION * torch.cuda.get_device_properties(device).total_memory


def resolve_keep_decode_graphs(setting: bool | None, sharded: bool) -> bool | None:
    """``keep_decode_graphs`` for this run: off where parameters are gathered into new memory at every generation
    call (DeepSpeed ZeRO-3, FSDP), where ``True`` is refused; otherwise as given (None: see :func:`fast_decode`)."""
    if setting and sharded:
        raise ValueError(
            "keep_decode_graphs=True does not work with DeepSpeed ZeRO-3 or FSDP: parameters are gathered into new "
            "memory at every generation call, so a kept decode graph could never be replayed. Set "
            "keep_decode_graphs=False (or leave it unset)."
        )
    return False if sharded else setting
