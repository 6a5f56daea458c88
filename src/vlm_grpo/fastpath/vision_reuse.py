"""Each image encoded once per step: the features generation computed, reused by the log-prob passes.

The vision tower runs in the generation prefill (each group's prompt images once), and again in every
log-prob pass: the old-log-prob pass, the reference pass and the loss pass of every micro-batch. The
features the decoder sees (what the backbone's ``get_image_features`` returns: the merger's / projector's
output, and Qwen3-VL's deepstack features) are a function of the pixels and of the tower's weights only, so
they are reused wherever those weights are the ones that encoded at generation:

- the old-log-prob pass: always (same step, same weights), unless a LoRA adapter in the tower is switched
  (PEFT's disabled-adapter reference pass with ``--lora_include_vision``);
- the reference pass and the loss passes: only when the tower and its projector have no trainable parameter
  and no dropout that training mode turns on; a separate reference model only when its tower holds the same
  weights as the policy's (compared once, element by element; not under ZeRO-3, where each rank holds a shard).

A trainable tower always encodes in the loss pass: gradients flow through it.

Carrier: generation keeps, per batch row, the features of its images (:class:`FeatureChunk`: one for the
prompt's images, shared by the G rows of a group, then one per tool image) under the output key
:data:`FEATURES_KEY`, a list with one entry per row. TRL shuffles and cuts lists per row, as it does its
``prompt_ids``, so each micro-batch's rows keep their own features. A pass hands them to the model as
``mm_encoder_outputs`` (transformers' own input for precomputed image features) in place of ``pixel_values``;
a pass where any row lacks its images' features encodes as before. In multi-process runs every rank decides
together and, when all reuse, the vision sync's dummy image is skipped on every rank as well
(:mod:`vlm_grpo.fastpath.vision_sync`): ZeRO-3's gathers stay paired.

Memory: the prompt features of a group are held once for its G rows, on the device, in the decoder's dtype:
images x tokens per image x hidden x 2 bytes (bf16), e.g. 64 distinct 512x512 images x 324 tokens x 2,048
(Qwen2.5-VL-3B) = 85 MB per generation batch; Qwen3-VL's deepstack features add as much again per deepstack
layer (3).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlm_grpo.fastpath.sharing import all_ranks_agree
from vlm_grpo.fastpath.vision_sync import vision_backbone
from vlm_grpo.utils import is_zero3, peft_base, per_chunk_kwargs, warn_once

logger = logging.getLogger(__name__)

#: The generation output's key (one entry per row) that carries the rows' image features.
FEATURES_KEY = "vision_features"


@dataclass(frozen=True)
class FeatureChunk:
    """What ``get_image_features`` returned for consecutive images of one row, concatenated along dim 0."""

    tensors: tuple[torch.Tensor, ...]  # the pooled features, then each deepstack layer's
    images: int  # how many images
    units: int  # their pixel units (Qwen: patches; InternVL: tiles)
    kind: type  # the image output's class
    split: bool  # pooler_output as one tensor per image (Qwen) rather than one stacked tensor (InternVL)
    deepstack: bool  # the output carries deepstack features (Qwen3-VL)


#: Per row: its prompt images' chunk (None: a text-only prompt), then one chunk per tool image.
RowFeatures = tuple[FeatureChunk | None, ...]


def chunks_of(outputs: Any, images: Sequence[int], units: Sequence[int]) -> list[FeatureChunk] | None:
    """Cut one forward's image outputs into chunks of ``images[i]`` images (``units[i]`` pixel units) each, in the
    order the forward placed them (None: an output this module does not know)."""
    pooled = getattr(outputs, "pooler_output", None)
    if pooled is None:
        return None
    deep = getattr(outputs, "deepstack_features", None)
    split = isinstance(pooled, (tuple, list))
    if (split and len(pooled) != sum(images)) or (not split and pooled.size(0) != sum(units)):
        return None
    layers = [pooled, *(deep or [])]
    chunks, image, unit = [], 0, 0
    for n, u in zip(images, units, strict=True):
        if split:
            tensors = tuple(torch.cat(list(layer[image : image + n])).detach() for layer in layers)
        else:
            tensors = tuple(layer[unit : unit + u].detach() for layer in layers)
        chunks.append(FeatureChunk(tensors, n, u, type(outputs), split, deep is not None))
        image, unit = image + n, unit + u
    return chunks


def encoder_outputs(chunks: Sequence[FeatureChunk]) -> dict[str, Any]:
    """``mm_encoder_outputs`` for a forward whose images are those of ``chunks``, in order."""
    first = chunks[0]
    tensors = [torch.cat([c.tensors[i] for c in chunks]) for i in range(len(first.tensors))]
    fields: dict[str, Any] = {"pooler_output": (tensors[0],) if first.split else tensors[0]}
    if first.deepstack:
        fields["deepstack_features"] = [(t,) for t in tensors[1:]]
    return {"image": first.kind(**fields)}


def with_features(inputs: dict[str, Any], chunks: Sequence[FeatureChunk]) -> dict[str, Any]:
    """The model inputs with the images' features in place of their pixels (unchanged without images)."""
    if inputs.get("pixel_values") is None or not chunks:
        return inputs
    inputs = {k: v for k, v in inputs.items() if k != "pixel_values"}
    inputs["mm_encoder_outputs"] = encoder_outputs(chunks)
    return inputs


class FeatureReplay:
    """The features of one pass's rows, handed to its forwards in the order each forward places its images."""

    def __init__(self, rows: Sequence[RowFeatures]) -> None:
        self.rows = rows

    def for_rows(self, start: int, end: int) -> list[FeatureChunk]:
        """TRL's per-row layout: rows in order, each row's images in order."""
        return [c for row in self.rows[start:end] for c in row if c is not None]

    def for_groups(self, groups: Sequence[Any]) -> list[FeatureChunk]:
        """The packed layout (:meth:`~vlm_grpo.modules.base.GroupSharingMixin.vision_spans`): a group's prompt
        images once (its leader's), then each row's own tool images."""
        chunks = []
        for group in groups:
            chunks.append(self.rows[group.rows[0]][0])
            chunks += [c for r in group.rows for c in self.rows[r][1:]]
        return [c for c in chunks if c is not None]

    def packed(self, groups: Sequence[Any], inputs: dict[str, Any]) -> dict[str, Any]:
        """A packed forward's inputs with its groups' features in place of their pixels."""
        return with_features(inputs, self.for_groups(groups))


@contextlib.contextmanager
def replay_rows(model: torch.nn.Module, replay: FeatureReplay | None) -> Iterator[None]:
    """Hand each of TRL's per-row forwards (consecutive chunks of rows) its rows' features instead of pixels."""
    if replay is None:
        yield
        return
    with per_chunk_kwargs(model, lambda start, end, kw: with_features(kw, replay.for_rows(start, end))):
        yield


def row_features(chunks: Sequence[FeatureChunk], groups: Sequence[Any], rows: int) -> list[RowFeatures]:
    """Per batch row, the prompt chunk of its group (``chunks``: one per group holding images, in order)."""
    out: list[RowFeatures] = [(None,)] * rows
    chunk = iter(chunks)
    for group in groups:
        if group.image_rows is None:
            continue
        mine = (next(chunk),)
        for row in group.rows:
            out[row] = mine
    return out


def _tower_modules(model: torch.nn.Module, module: Any) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if module.is_vision_parameter(n)]


def tower_is_static(model: torch.nn.Module, module: Any) -> str | None:
    """Why the tower's features can change between generation and a training pass (None: they cannot)."""
    if any(p.requires_grad for n, p in model.named_parameters() if module.is_vision_parameter(n)):
        return "the vision tower (or its projector) is trained"
    return "the vision tower has dropout" if _has_dropout(model, module) else None


def adapter_state(model: torch.nn.Module, module: Any) -> tuple | None:
    """Which LoRA adapters of the tower are on (None: no adapter in the tower)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for _, m in _tower_modules(model, module):
        if isinstance(m, BaseTunerLayer):
            return bool(m.disable_adapters), tuple(m.active_adapters)
    return None


def same_tower(policy: torch.nn.Module, ref: torch.nn.Module, module: Any) -> bool:
    """Whether the reference model's tower holds exactly the policy's tower weights (name by name)."""
    mine = {
        n.removeprefix("base_model.model."): p for n, p in policy.named_parameters() if module.is_vision_parameter(n)
    }
    theirs = {n: p for n, p in ref.named_parameters() if module.is_vision_parameter(n)}
    if not mine or mine.keys() != theirs.keys():
        return False
    return all(
        p.shape == theirs[n].shape and torch.equal(p.detach(), theirs[n].detach().to(p.device)) for n, p in mine.items()
    )


class VisionReuseMixin:
    """Keeps the generation's image features with its batch and hands them to the log-prob passes.

    Placed before ``GRPOTrainer`` and after the mixins that regroup generation outputs, so that every generation
    round's output carries its own rows' features.
    """

    _recorded: list[RowFeatures] | None = None  # the features the current generation's prefill kept
    _recording = False
    _scoring = False  # inside _generate_and_score_completions: the old and reference passes
    _generation_adapters: tuple | None = None
    _ref_same_tower: bool | None = None
    #: Vision-feature reuse of the last log-prob pass: "reused", or why it encoded (tests and logs read it).
    last_vision_reuse: str | None = None
    #: Log-prob passes so far that ran on kept features, the vision tower (and the vision sync's dummy image) idle.
    vision_reused_passes = 0

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        reuse = self.args.reuse_vision_features
        self._recorded, self._recording, self._scoring = None, reuse, True
        if reuse:
            self._generation_adapters = adapter_state(self._unwrapped_policy(), self.vlm_module)
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._recording, self._scoring = False, False
        if reuse:
            rows = output["prompt_ids"].size(0)
            recorded = self._recorded if self._recorded is not None and len(self._recorded) == rows else None
            output[FEATURES_KEY] = recorded if recorded is not None else [None] * rows
        self._recorded = None
        return output

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Any:
        self._pass_rows = inputs.get(FEATURES_KEY)
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._pass_rows = None

    _pass_rows: Sequence[RowFeatures | None] | None = None

    def keep_prefill_features(self, outputs: Any, groups: Sequence[Any], mm: dict[str, Any], rows: int) -> None:
        """Keep what a generation prefill encoded (``outputs``: its ``image_outputs``) for the batch's rows."""
        if not self._recording:
            return
        self._recording = False  # the first generation call of a step is the one over the whole batch
        imaged = [g for g in groups if g.image_rows is not None]
        num_images = mm.get("num_images") or []
        images = [num_images[g.rows[0]] for g in imaged]
        units = [g.image_rows[1] - g.image_rows[0] for g in imaged]
        chunks = chunks_of(outputs, images, units) if imaged and outputs is not None else []
        if chunks is None:
            warn_once(
                logger, "reuse_vision_features: this family's image outputs are not known; encoding", logging.INFO
            )
            return
        self._recorded = row_features(chunks, groups, rows)

    def keep_turn_features(self, outputs: Any, images: Sequence[Any], units: Sequence[int]) -> None:
        """Keep what a tool turn's prefill encoded (``images``: the image objects, in the order it encoded them)."""
        if self._tool_features is None:
            return
        chunks = chunks_of(outputs, [1] * len(images), units)
        for image, chunk in zip(images, chunks or [], strict=False):
            self._tool_features[id(image)] = (image, chunk)  # the image held: its id stays its own

    _tool_features: dict[int, tuple[Any, FeatureChunk]] | None = None

    def keep_history_features(self, outputs: Any, groups: Sequence[Any], mm: dict[str, Any], images: list) -> None:
        """Keep what a tool turn that prefilled whole histories encoded (rows with equal histories share a group)."""
        if self._tool_features is None or outputs is None:
            return
        imaged = [g for g in groups if g.image_range is not None]
        grid = mm.get("image_grid_thw")
        units = []
        for group in imaged:
            a, b = group.image_range
            if grid is not None:
                units += grid[a:b].prod(-1).tolist()
            elif group.image_rows[1] - group.image_rows[0] == b - a:  # one tile an image
                units += [1] * (b - a)
            else:
                return  # tiles per image not known: these rows' passes encode
        chunks = chunks_of(outputs, [1] * len(units), units)
        if chunks is None:
            return
        at = 0
        for group in imaged:
            count = group.image_range[1] - group.image_range[0]
            for row in group.rows:
                for image, chunk in zip(images[row] or [], chunks[at : at + count], strict=False):
                    self._tool_features[id(image)] = (image, chunk)
            at += count

    def _generate(self, prompts: list) -> Any:
        """TRL's; the rows' kept features gain those of their tool images (kept by the tool turns' prefills)."""
        self._tool_features = {} if self.args.reuse_vision_features else None
        try:
            out = super()._generate(prompts)
            tool_images = out[-1]
            if self._recorded is not None and tool_images and any(tool_images):
                self._recorded = [
                    row if not extra else (*row, *(self._tool_chunk(image) for image in extra))
                    for row, extra in zip(self._recorded, tool_images, strict=True)
                ]
        finally:
            self._tool_features = None
        return out

    def _tool_chunk(self, image: Any) -> FeatureChunk | None:
        kept = self._tool_features.get(id(image))
        return kept[1] if kept is not None and kept[0] is image else None

    def _unwrapped_policy(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model)

    def _reuse_blocker(self, model: Any) -> str | None:
        """Why this pass cannot reuse the generation's features, whatever its rows (None: it can)."""
        if not self.args.reuse_vision_features:
            return "turned off"
        policy = self._unwrapped_policy()
        backbone = vision_backbone(policy)
        if not self.vlm_module.reuses_image_features or backbone is None:
            return "this family's image features are not reused"
        if "mm_encoder_outputs" not in self._forward_parameters():
            return "the model takes no precomputed image features"
        separate_ref = model is self.ref_model and self.ref_model is not None
        if self._scoring and not separate_ref:  # the old pass, or PEFT's reference pass (same model)
            if adapter_state(policy, self.vlm_module) != self._generation_adapters:
                return "the tower's LoRA adapter is switched for the reference pass"
            return "the vision tower has dropout" if policy.training and _has_dropout(policy, self.vlm_module) else None
        reason = tower_is_static(policy, self.vlm_module)
        if reason is not None or not separate_ref:
            return reason
        if self._ref_same_tower is None:
            zero3 = is_zero3(self.accelerator)
            ref = peft_base(self.accelerator.unwrap_model(self.ref_model))
            self._ref_same_tower = not zero3 and same_tower(policy, ref, self.vlm_module)
        return None if self._ref_same_tower else "the reference model's tower is not provably the policy's"

    @contextlib.contextmanager
    def _vision_reuse(self, model: Any, mm: dict[str, Any], rows: int) -> Iterator[FeatureReplay | None]:
        """The pass's features (None: it encodes), decided by every rank together; while all ranks reuse, the vision
        sync's dummy image is off too."""
        features = self._recorded if self._scoring else self._pass_rows
        reason = self._reuse_blocker(model)
        if reason is None:
            reason = _missing(features, mm, rows, self.vlm_module)
        agreed = reason != "turned off" and all_ranks_agree(self, reason is None)
        self.last_vision_reuse = "reused" if agreed else reason or "another rank encodes"
        if not agreed:
            if reason != "turned off":
                message = f"reuse_vision_features: a log-prob pass encodes its images ({self.last_vision_reuse})"
                warn_once(logger, message, logging.INFO)
            yield None
            return
        self.vision_reused_passes += 1
        syncs = self._vision_syncs
        for sync in syncs:
            sync.suspended = True
        try:
            yield FeatureReplay(features) if mm.get("pixel_values") is not None else None
        finally:
            for sync in syncs:
                sync.suspended = False


def _has_dropout(model: torch.nn.Module, module: Any) -> bool:
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for _, m in _tower_modules(model, module))


def _missing(features: Sequence[RowFeatures | None] | None, mm: dict[str, Any], rows: int, module: Any) -> str | None:
    """Why the rows' kept features do not cover their images (None: they do)."""
    num_images = mm.get("num_images")
    if mm.get("pixel_values") is None:
        return None
    if features is None or len(features) != rows or any(f is None for f in features):
        return "no features were kept for these rows (generation did not go through the shared prefill)"
    units = module.units_per_sample(mm)
    for row, kept in enumerate(features):
        chunks = [c for c in kept if c is not None]
        if any(c is None for c in kept[1:]):
            return "a row has tool images whose features were not kept"
        if num_images is not None and sum(c.images for c in chunks) != num_images[row]:
            return "a row has images (tool images) whose features were not kept"
        if units is not None and sum(c.units for c in chunks) != units[row]:
            return "a row's kept features do not match its pixels"
    return None
