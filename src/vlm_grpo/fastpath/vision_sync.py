"""Every rank runs the vision tower in every full forward, so sharded runs agree on mixed batches.

Under DeepSpeed ZeRO-3 (and FSDP) each submodule's parameters are all-gathered just before it runs,
and under ZeRO-1/2/3 gradients are reduced in buckets as backward produces them. Both are
collectives: every rank must issue the same ones in the same order. When one rank's batch is
text-only and another's has images, only the second runs the vision tower, so the ranks' collective
sequences part ways and the run aborts (gloo: ``Received data size doesn't match expected size``)
or hangs (NCCL).

The fix keeps the ranks in step without touching the model's code: two forward pre-hooks on the
backbone (the ``*Model`` inside ``*ForConditionalGeneration``). The first notes whether a forward
carries images and whether it is a full pass (no cached keys yet: a training/log-prob forward or a
generation prefill; decode steps run no vision on any rank). The second runs, for a full pass
without images, just before the language model, i.e. exactly where the real pass encodes images
(after the token embedding, before the first decoder layer): it encodes one tiny dummy image
through the family's own ``get_image_features`` (tower, projector/merger, deepstack mergers) and adds
``0 * sum(outputs)`` to ``inputs_embeds``. Forward values are unchanged and the vision parameters get
zero gradients, produced at the same point of backward as real image gradients would be.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vlm_grpo.utils import peft_base

logger = logging.getLogger(__name__)


def _cache_is_empty(kwargs: dict[str, Any]) -> bool:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if cache is None:
        return True
    get_len = getattr(cache, "get_seq_length", None)
    return get_len is None or int(get_len()) == 0


def _has_images(args: tuple, kwargs: dict[str, Any]) -> bool:
    if kwargs.get("pixel_values") is not None or kwargs.get("pixel_values_videos") is not None:
        return True
    encoded = kwargs.get("mm_encoder_outputs")
    return bool(encoded) and any(v is not None for v in encoded.values())


class VisionSync:
    """The two hooks of one backbone; ``remove()`` takes them off again."""

    def __init__(self, vlm_module: Any, backbone: torch.nn.Module) -> None:
        self.vlm_module = vlm_module
        self.backbone = backbone
        self.pending = False
        #: Set while every rank's pass takes kept image features (:mod:`vlm_grpo.fastpath.vision_reuse`): no rank
        #: runs the tower then, so none runs the dummy image either.
        self.suspended = False
        #: Dummy vision passes run so far (tests read it).
        self.dummy_passes = 0
        language_model = backbone.get_decoder()  # language_model; Idefics3 / SmolVLM: text_model
        self._handles = [
            backbone.register_forward_pre_hook(self._note_inputs, with_kwargs=True),
            # prepend: run before DeepSpeed's own pre-hook on the language model, so the dummy vision
            # modules come before it in ZeRO-3's fetch order, as the real vision modules do.
            language_model.register_forward_pre_hook(self._dummy_vision, with_kwargs=True, prepend=True),
        ]

    def _note_inputs(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        self.pending = not self.suspended and not _has_images(args, kwargs) and _cache_is_empty(kwargs)

    def _dummy_vision(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]):
        if not self.pending:
            return None
        self.pending = False
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:  # the backbone always passes inputs_embeds by name; anything else is not ours
            return None
        zero = self.vlm_module.dummy_vision_sum(self.backbone, embeds.device) * 0
        self.dummy_passes += 1
        kwargs["inputs_embeds"] = embeds + zero.to(embeds.dtype)
        return args, kwargs

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def vision_backbone(model: torch.nn.Module) -> torch.nn.Module | None:
    """The ``*Model`` that runs ``get_image_features`` and then ``language_model`` (PEFT unwrapped)."""
    inner = peft_base(model)
    backbone = getattr(inner, "model", None)
    if backbone is None or not hasattr(backbone, "get_image_features") or not hasattr(backbone, "get_decoder"):
        return None
    return backbone


def install_vision_sync(vlm_module: Any, model: torch.nn.Module) -> VisionSync | None:
    """Hook ``model`` so that forwards without images still run the vision tower (see the module doc)."""
    backbone = vision_backbone(model)
    if backbone is None:
        logger.warning("%s has no vision backbone with get_image_features: no vision sync", type(model).__name__)
        return None
    return VisionSync(vlm_module, backbone)


def needs_vision_sync(accelerator: Any, model: torch.nn.Module, vlm_module: Any) -> bool:
    """Sharded multi-process runs: ZeRO-3/FSDP gather parameters per module (frozen or not); any ZeRO
    stage reduces gradients in buckets, which a trainable vision tower must fill on every rank."""
    if accelerator.num_processes <= 1:
        return False
    state = accelerator.state
    if getattr(state, "fsdp_plugin", None) is not None:
        return True
    plugin = getattr(state, "deepspeed_plugin", None)
    if plugin is None:
        return False
    if plugin.zero_stage == 3:
        return True
    return any(p.requires_grad for n, p in model.named_parameters() if vlm_module.is_vision_parameter(n))
