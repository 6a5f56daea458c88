"""``torch.compile`` for the decoder layers and vision blocks in the shared-prompt training passes (``compile_layers``).

After sharing, those passes are partly host-bound: at 896² and 128 completion tokens on an H200 the kernels
of the loss forward + backward fill about two-thirds of its time, over ~12,000 kernel launches.
Compiling a whole decoder layer turns its ~50 host-side ops per pass into
two graph calls and fuses the small kernels. Compiling only the norms and MLPs did not help (measured);
presumably each compiled call's own overhead is about what it saves at that grain.

Two things stand in the way, and are handled here without touching transformers' code:

* transformers checkpoints inside the layer's ``forward``, and a checkpointed region cannot contain
  graph breaks. For the duration of a packed forward, each layer's ``forward`` is set on the instance to
  "checkpoint (as configured) around the compiled original forward", and restored afterwards.
* the packed attention's per-row calls (:mod:`vlm_grpo.fastpath.block_attention`) loop over the layout's Python
  ints; they run as a compiler-disabled island, so new layouts do not recompile the layer. On GPUs with flash
  attention the packed attention is instead one varlen flash call whose layout is tensors (``VarlenLayout``): the
  layer traces whole, attention and its backward included (at 448² C128 on an H200 the loss forward + backward
  takes 0.31 s instead of the per-row calls' 0.47 s).

The vision tower's blocks (32 in Qwen2.5-VL, trained in full fine-tuning) are compiled the same way where their
attention is one the compiler can trace or leave alone: the batched attention of
:mod:`vlm_grpo.fastpath.vision_attention` is one varlen flash call on GPUs, traced with the block (the longest
segment is an int input: specialized at the first call, dynamic after the first change), and elsewhere an island
like the packed one (its segment plan needs host ints); towers without ``cu_seqlens`` segments (InternVL) trace
whole. A Qwen tower on plain sdpa / eager splits its sequence with ``.tolist()`` inside the attention, which would
break every graph; it stays eager.

Generation does not go through this (its decode step has its own compilation, ``compile_decode``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from vlm_grpo.fastpath.fallback import EagerOnFailure
from vlm_grpo.fastpath.vision_attention import NAME as VARLEN
from vlm_grpo.fastpath.vision_attention import vision_towers
from vlm_grpo.utils import warn_once

logger = logging.getLogger(__name__)

_compiled: dict[Callable, Callable] = {}  # original forward -> its compiled form (one per layer class)
_BACKEND: str | Callable = "inductor"


def _compiled_forward(layer: torch.nn.Module) -> Callable | None:
    """The compiled original ``forward`` of the layer's class; None when transformers does not wrap it."""
    original = getattr(type(layer).forward, "__wrapped__", None)  # transformers' checkpointing wrapper
    if original is None:
        return None
    if original not in _compiled:
        compiled = torch.compile(original, backend=_BACKEND)
        # Only dynamo's own errors: any other error of a layer is the user's to see.
        failed = f"compile_layers: compiling {type(layer).__name__} failed"
        _compiled[original] = EagerOnFailure(compiled, original, logger, failed, torch._dynamo.exc.TorchDynamoException)
    return _compiled[original]


def _layer_forward(layer: torch.nn.Module, compiled: Callable) -> Callable:
    """What transformers' wrapper does (checkpoint when training with grad), around the compiled forward."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        if layer.gradient_checkpointing and layer.training and torch.is_grad_enabled():
            return layer._gradient_checkpointing_func(functools.partial(compiled, layer, **kwargs), *args)
        return compiled(layer, *args, **kwargs)

    return forward


def decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The text decoder's layers (``model`` unwrapped down to the transformers model)."""
    return [m for m in model.get_decoder().modules() if isinstance(m, GradientCheckpointingLayer)]


def vision_blocks(model: Any, vlm_module: Any) -> list[torch.nn.Module]:
    """The vision tower's checkpointing layers (``model`` unwrapped down to the transformers model) that compile
    cleanly; [] for a tower whose attention splits its sequence on the host (see the module's docstring)."""
    config = getattr(model.config, "vision_config", None)
    if vlm_module is None or config is None:
        return []
    if getattr(vlm_module, "varlen_vision", False) and config._attn_implementation != VARLEN:
        return []
    towers = vision_towers(model, vlm_module)
    return [m for tower in towers for m in tower.modules() if isinstance(m, GradientCheckpointingLayer)]


def resolve_compile_layers(setting: bool | None, device_type: str, sharded: bool) -> bool:
    """Whether the packed passes compile their decoder layers. ``None`` (the default): on a CUDA device, unless
    parameters are gathered per module (DeepSpeed ZeRO-3, FSDP); ``True`` there is refused."""
    if setting and sharded:
        raise ValueError(
            "compile_layers=True does not work with DeepSpeed ZeRO-3 or FSDP: their per-module parameter hooks "
            "would run inside the compiled layers. Set compile_layers=False (or leave it unset)."
        )
    if setting is None:
        return device_type == "cuda" and not sharded
    return setting


@contextlib.contextmanager
def compiled_layers(model: Any, enabled: bool = True, vlm_module: Any = None) -> Iterator[None]:
    """Within the block, the decoder layers of ``model`` (a transformers model) run compiled, and the vision
    blocks of its tower where :func:`vision_blocks` finds them (``vlm_module`` names the tower)."""
    stacks = [decoder_layers(model), vision_blocks(model, vlm_module)] if enabled else []
    swapped = []
    for layers in stacks:
        for layer in layers:
            compiled = _compiled_forward(layer)
            if compiled is None:  # every packed forward comes here: say it once
                warn_once(logger, f"compile_layers: {type(layer).__name__} has no wrapped forward to compile; eager")
                break
            layer.forward = _layer_forward(layer, compiled)
            swapped.append(layer)
    try:
        yield
    finally:
        for layer in swapped:
            del layer.forward
