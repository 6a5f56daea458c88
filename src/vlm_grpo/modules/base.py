"""The contract every model-family adapter fulfils.

An adapter knows the quirks of one family so the trainer and the data pipeline don't have to:
how to load model and processor, where the vision tower lives, what LoRA should target, how many
prompt tokens an image costs, and in which coordinate frame the model writes boxes.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vlm_grpo.cli_errors import UserError

logger = logging.getLogger(__name__)

# Question templates by task type. `{question}` is replaced by the row's question text.
THINK_ANSWER = (
    " First output the thinking process in <think> </think> tags and then output the final answer in "
    "<answer> </answer> tags."
)
DEFAULT_TEMPLATES: dict[str, str] = {
    "default": "{question}" + THINK_ANSWER,
    "vqa": "{question}" + THINK_ANSWER,
    "counting": "{question}" + THINK_ANSWER + " The answer is a single number.",
    "rec": "{question}" + THINK_ANSWER + " Output the bounding box in the answer as [x1, y1, x2, y2].",
    "raw": "{question}",
    # RynnBrain tasks: the row's system prompt (and the preprocess output-format hint) say how to answer.
    **{task: "{question}" for task in ("trajectory", "affordance", "area", "segment", "general")},
}


def rec_template(coordinates: str) -> str:
    """A REC (referring-expression) template that names the family's box coordinate frame."""
    return "{question}" + THINK_ANSWER + f" Output the bounding box in the answer as [x1, y1, x2, y2] in {coordinates}."


# processor -> (chat template, extra tokens); see VLMModule.image_template_overhead.
_TEMPLATE_OVERHEAD: weakref.WeakKeyDictionary[Any, tuple[Any, int]] = weakref.WeakKeyDictionary()


@dataclass
class ImageLimits:
    """Image size knobs that users set on the command line."""

    min_pixels: int | None = None
    max_pixels: int | None = None
    max_anyres_num: int | None = None


class GroupSharingMixin:
    """Hooks ``vlm_grpo.fastpath.sharing`` needs from a family: how pixels split per sample, and positions."""

    #: Multimodal inputs besides ``pixel_values`` / ``image_grid_thw`` / ``mm_token_type_ids`` that
    #: :meth:`group_vision_inputs` slices per group (Pixtral's and LLaVA-OneVision's ``image_sizes``, Idefics3's
    #: ``pixel_attention_mask``); the speed path steps aside for any other input.
    grouped_vision_inputs: ClassVar[frozenset[str]] = frozenset()
    #: The log-prob passes may take the generation's image features as ``mm_encoder_outputs`` (the backbone's
    #: ``get_image_features`` output layout is known: :mod:`vlm_grpo.fastpath.vision_reuse`).
    reuses_image_features: ClassVar[bool] = False

    def units_per_sample(self, mm: dict[str, Any]) -> list[int] | None:
        """Rows of ``pixel_values`` each sample owns (None: no images in the batch)."""
        return None

    def image_units(self, model: Any, placeholders: int) -> int | None:
        """Rows of ``pixel_values`` an image owns whose features fill ``placeholders`` tokens (None: not known)."""
        return None

    @staticmethod
    def vision_spans(groups: list[Any], pixels: bool) -> list[tuple[int, int]]:
        """Slices of the per-unit (``pixels``) or per-image tensors, in the order the packed pass places them: a
        group's prompt images (its leader's, once), then each row's own tool images."""
        spans = []
        for g in groups:
            spans.append(g.image_rows if pixels else g.image_range)
            spans.extend(g.tool_rows if pixels else g.tool_ranges)
        return [s for s in spans if s is not None]

    def group_vision_inputs(self, groups: list[Any], mm: dict[str, Any]) -> dict[str, Any]:
        """Vision inputs of the group leaders' prompts and of each row's tool images: each unique image is encoded
        once."""
        pixel_values = mm.get("pixel_values")
        slices = self.vision_spans(groups, pixels=True)
        if pixel_values is None or not slices:
            return {}
        return {"pixel_values": torch.cat([pixel_values[a:b] for a, b in slices])}

    def packed_position_ids(
        self, model: Any, group: Any, mm: dict[str, Any], completions: list[torch.Tensor]
    ) -> torch.Tensor:
        """The positions of one packed group, ``(1, length)``: 1-D positions as the naive left-padded pass has them
        (prompt token i at its padded index; a block continues from the prompt's last token).

        ``completions``: per row of the group, the completion tokens its block holds (blocks differ in length).
        """
        prompt_len = group.prompt.numel()
        end = group.pad_offset + prompt_len  # the prompt ends where the completions start
        lengths = torch.tensor([ids.numel() + 1 for ids in completions])
        # Block b: end - 1, end, ..., end + len_b - 1 (the prompt's last token, then its completion tokens).
        block = torch.arange(int(lengths.sum())) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
        prompt = torch.arange(group.pad_offset, end - 1)
        return torch.cat([prompt, block + end - 1]).to(group.prompt.device)[None]


class VLMModule(GroupSharingMixin):
    """Base adapter. Subclasses set the class attributes and override what differs."""

    name: ClassVar[str] = ""
    #: Module-name prefixes (as in ``model.named_parameters()``) of the vision tower and its projector.
    vision_prefixes: ClassVar[tuple[str, ...]] = ()
    #: The vision tower hands attention ``cu_seqlens`` in one call when its attention name says "flash",
    #: so :mod:`vlm_grpo.fastpath.vision_attention` can batch its segments by length (Qwen-VL towers).
    varlen_vision: ClassVar[bool] = False
    #: Linear-layer names LoRA targets by default (in the language model only).
    lora_targets: ClassVar[tuple[str, ...]] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    #: Further linear-layer names of the vision tower and projector that ``--lora_include_vision`` adds to the
    #: default targets (matched under ``vision_prefixes`` only): vision towers name their layers their own way.
    vision_lora_targets: ClassVar[tuple[str, ...]] = ()
    #: Overrides of ``DEFAULT_TEMPLATES`` for this family (e.g. box coordinate conventions).
    templates: ClassVar[dict[str, str]] = {}
    #: Rewards this family scores its own way (name -> callable or "module:attr"); used with
    #: ``--is_reward_customized_from_vlm_module``.
    reward_overrides: ClassVar[dict[str, Any]] = {}

    def __init__(self, limits: ImageLimits | None = None) -> None:
        self.limits = limits or ImageLimits()

    # ----------------------------------------------------------------- loading
    def load_model(
        self,
        path: str,
        *,
        dtype: torch.dtype | str | None = None,
        attn_implementation: str | None = None,
        trust_remote_code: bool = False,
        revision: str | None = None,
        **kwargs: Any,
    ) -> torch.nn.Module:
        from transformers import AutoModelForImageTextToText

        if isinstance(dtype, str) and dtype != "auto":
            dtype = getattr(torch, dtype)
        return AutoModelForImageTextToText.from_pretrained(
            path,
            dtype=dtype if dtype is not None else "auto",
            attn_implementation=resolve_attn_implementation(attn_implementation),
            trust_remote_code=trust_remote_code,
            revision=revision,
            **kwargs,
        )

    def prepare_model(self, model: torch.nn.Module) -> None:
        """Make a loaded model of this family ready for TRL's trainer (however it was loaded); default: nothing."""

    def load_processor(self, path: str, *, trust_remote_code: bool = False, revision: str | None = None) -> Any:
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(
            path, trust_remote_code=trust_remote_code, revision=revision, padding_side="left"
        )
        return self.prepare_processor(processor)

    def prepare_processor(self, processor: Any) -> Any:
        """What the trainers need of a loaded processor: left padding, the user's image limits, family fixes."""
        processor.tokenizer.padding_side = "left"
        self.apply_image_limits(processor)
        return processor

    def apply_image_limits(self, processor: Any) -> None:
        """Put ``--min_pixels`` / ``--max_pixels`` / ``--max_anyres_num`` onto the processor."""

    def refuse_image_limits(self, how: str) -> None:
        """Stop with a user error when an image limit was given that this family has no knob for."""
        given = [f"--{k}" for k, v in vars(self.limits).items() if v is not None]
        if given:
            raise UserError(f"{', '.join(given)}: the '{self.name}' family has no such limit; {how}")

    # ----------------------------------------------------------------- structure
    def is_vision_parameter(self, name: str) -> bool:
        name = name.removeprefix("module.").removeprefix("base_model.model.")
        return any(name.startswith(p) for p in self.vision_prefixes)

    def freeze_vision(self, model: torch.nn.Module) -> int:
        """Freeze the vision tower (and projector); returns how many parameters were frozen.

        Counts ``ds_numel`` where present: under ZeRO-3 a partitioned parameter reports ``numel() == 0``.
        """
        frozen, matched = 0, 0
        for name, param in model.named_parameters():
            if self.is_vision_parameter(name):
                param.requires_grad_(False)
                frozen += getattr(param, "ds_numel", param.numel())
                matched += 1
        if matched == 0:
            raise ValueError(
                f"--freeze_vision_modules found no parameter under {self.vision_prefixes} in "
                f"{type(model).__name__}; the '{self.name}' adapter does not match this model"
            )
        return frozen

    def lora_target_modules(self, targets: list[str] | None = None, include_vision: bool = False) -> str:
        """A PEFT regex: the given (or default) layer names, outside the vision tower unless asked.

        With ``include_vision`` and the default names, the family's ``vision_lora_targets`` join them inside the
        vision tower, so LoRA really reaches it whatever its layers are called."""
        names = "|".join(re.escape(t) for t in (targets or self.lora_targets))
        if not self.vision_prefixes:
            return rf".*\.({names})"
        vision = "|".join(re.escape(p) for p in self.vision_prefixes)
        if not include_vision:
            return rf"(?!(?:{vision})\.).*\.({names})"
        if targets or not self.vision_lora_targets:
            return rf".*\.({names})"
        extra = "|".join(re.escape(t) for t in self.vision_lora_targets)
        return rf"(?:{vision})(?:\..*)?\.({extra})|.*\.({names})"

    # ----------------------------------------------------------------- prompts and images
    def question_template(self, task_type: str | None) -> str:
        key = task_type or "default"
        merged = {**DEFAULT_TEMPLATES, **self.templates}
        return merged.get(key, merged["default"])

    def num_image_tokens(self, processor: Any, width: int, height: int) -> int:
        """Prompt tokens one image of this size becomes after the processor expands its placeholder.

        That is ``len(prompt tokens with the image) - len(prompt tokens with the image item removed)``:
        the chat template's tokens for the item plus what the processor expands its placeholder into.
        """
        raise NotImplementedError

    def row_image_tokens(self, processor: Any, sizes: list[tuple[int, int]]) -> int:
        """Prompt tokens the images of one sample (``(width, height)`` each) become: their ``num_image_tokens``
        summed, unless the family expands an image differently when it shares the sample with others."""
        return sum(self.num_image_tokens(processor, w, h) for w, h in sizes)

    def rows_forward_kwargs(
        self, mm: dict[str, Any], start: int, end: int, tool_images: bool = False
    ) -> dict[str, Any]:
        """Model inputs for batch rows ``[start, end)`` that TRL's per-row log-prob pass leaves out or cuts for
        another layout; they replace what it passes (see ``VLMGRPOTrainer``). ``tool_images``: the pixels come
        from TRL's tool loop (its image processor call on the batch's images). {}: nothing to add."""
        return {}

    def tool_pixel_fields(self, processor: Any, mm: dict[str, Any], input_ids: torch.Tensor) -> dict[str, Any]:
        """The pixels of a tool run's batch (``input_ids``: its rows) in the layout TRL cuts per row, where TRL's
        tool loop lays them out otherwise. {}: as they are."""
        return {}

    def trl_pixel_fields(self, mm: dict[str, Any]) -> dict[str, Any]:
        """Fields that tell TRL how this family's ``pixel_values`` split per sample where its own guess from the
        shapes goes wrong (added to its batches outside tool runs). {}: none."""
        return {}

    def image_template_overhead(self, processor: Any) -> int:
        """Tokens the chat template writes for one ``{"type": "image"}`` item besides the placeholder.

        Qwen templates wrap ``<|image_pad|>`` in ``<|vision_start|>``/``<|vision_end|>`` (2); InternVL's
        follow ``<IMG_CONTEXT>`` with a newline (1). Measured by rendering a one-image prompt with and
        without the image item, so it holds for whatever template the checkpoint ships. Cached per
        processor (and template).
        """
        template = getattr(processor, "chat_template", None)
        cached = _TEMPLATE_OVERHEAD.get(processor)
        if cached is not None and cached[0] == template:
            return cached[1]
        question = {"type": "text", "text": "What is in the image?"}
        with_image = [{"role": "user", "content": [{"type": "image"}, question]}]
        without = [{"role": "user", "content": [question]}]
        tokenizer = getattr(processor, "tokenizer", processor)
        placeholder = tokenizer.convert_tokens_to_ids(processor.image_token)

        def ids(messages: list[dict[str, Any]]) -> list[int]:
            text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return tokenizer(text, add_special_tokens=False)["input_ids"]

        a, b = ids(with_image), ids(without)
        placeholders = a.count(placeholder) - b.count(placeholder)
        if placeholders != 1:
            raise ValueError(
                f"The chat template of {type(processor).__name__} writes {placeholders} '{processor.image_token}' "
                "placeholders for one image item; expected 1"
            )
        overhead = len(a) - len(b) - 1
        _TEMPLATE_OVERHEAD[processor] = (template, overhead)
        return overhead

    # ----------------------------------------------------------------- multi-process vision sync
    def dummy_image_inputs(self, backbone: torch.nn.Module, device: Any) -> dict[str, Any]:
        """Keyword arguments for ``backbone.get_image_features`` that encode one smallest blank image.

        Used by :mod:`vlm_grpo.fastpath.vision_sync` on ranks whose batch has no images.
        """
        raise NotImplementedError(f"the '{self.name}' adapter has no dummy image for multi-process vision sync")

    def dummy_vision_sum(self, backbone: torch.nn.Module, device: Any) -> torch.Tensor:
        """Sum of every vision output the language model would consume, for one dummy image.

        That is the projected features (``pooler_output``) and, where the family has them, the deepstack
        features: the same parameters get gradients as in a real image pass, no more.
        """
        out = backbone.get_image_features(**self.dummy_image_inputs(backbone, device), return_dict=True)
        tensors: list[torch.Tensor] = []

        def collect(value: Any) -> None:
            if isinstance(value, torch.Tensor):
                tensors.append(value)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    collect(item)

        collect(getattr(out, "pooler_output", None))
        collect(getattr(out, "deepstack_features", None))
        return sum(t.float().sum() for t in tensors)

    def coord_size(self, processor: Any, width: int, height: int) -> tuple[int, int]:
        """Width and height of the frame in which the model writes box coordinates for such an image.

        Rewards map predicted boxes from this frame back to the original image size.
        """
        return (1000, 1000)

    def image_grid(self, processor: Any, width: int, height: int) -> tuple[int, int, int] | None:
        """``(t, h, w)`` patches of such an image, as the processor's ``image_grid_thw`` (None: no such grid).

        Rewards receive it as ``image_grid_thw`` (VLM-R1's ``iou_reward`` maps boxes with it)."""
        return None


def resolve_attn_implementation(requested: str | None) -> str:
    """``sdpa`` unless the user asked for something else; flash-attn only when it is installed."""
    if requested in (None, "", "auto"):
        return "sdpa"
    if requested.startswith("flash_attention") and importlib.util.find_spec("flash_attn") is None:
        logger.warning("attn_implementation=%s asked for, but flash_attn is not installed: using sdpa", requested)
        return "sdpa"
    return requested
