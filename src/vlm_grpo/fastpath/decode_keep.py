"""What a kept decode workspace (``keep_decode_graphs``) is checked against before its graphs replay, and whether to
keep one by default: see :func:`vlm_grpo.fastpath.decode.fast_decode`'s ``keep``."""

from __future__ import annotations

import logging
from typing import Any

import torch

from vlm_grpo.fastpath.decode_fusion import kept_tensors
from vlm_grpo.utils import warn_once

logger = logging.getLogger(__name__)

# keep_decode_graphs None: keep the decode workspace and the fused copy between generation calls when together
# they take at most this fraction of the card's memory (3B on an 80 GB card: ~4.6 GB, kept; 7B: ~10 GB, not).
KEEP_FRACTION = 0.1


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
