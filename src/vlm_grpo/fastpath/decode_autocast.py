"""The autocast a decode step re-enters: the one the model's own forward ran the prefill under."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

# (device type, dtype) of the autocast a forward runs under; None: none.
AutocastState = tuple[str, torch.dtype] | None


@contextlib.contextmanager
def autocast_seen(module: torch.nn.Module) -> Iterator[list[AutocastState]]:
    """Record the autocast ``module`` first runs under inside the block (the list gets one entry).

    ``generate`` calls the model's own forward, which may enter an autocast: accelerate wraps a prepared model's
    forward in its mixed-precision autocast (``--bf16`` without DeepSpeed), and TRL generates through it. The
    decode step calls the decoder directly, past that wrapper, so it re-enters what the prefill ran under."""
    seen: list[AutocastState] = []

    def hook(mod: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if not seen:
            kind = next(mod.parameters()).device.type
            seen.append((kind, torch.get_autocast_dtype(kind)) if torch.is_autocast_enabled(kind) else None)

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def without_cast_cache(state: AutocastState) -> contextlib.AbstractContextManager:
    """``state``'s autocast without its cast cache: a weight cast cached during a warm-up pass would be reused,
    not recorded, by the graph capture (torch's CUDA-graph notes ask for ``cache_enabled=False``)."""
    if state is None:
        return contextlib.nullcontext()
    return torch.autocast(state[0], dtype=state[1], cache_enabled=False)
