"""``VLMSFTTrainer``: TRL's SFTTrainer with the VLM adapter layer, and its config.

Same adapter duties as :class:`vlm_grpo.trainer.VLMGRPOTrainer` (load model and processor through the
family's module, freeze the vision tower on request, keep LoRA off it) plus the one thing TRL's SFT lacks
for VLMs: separate learning rates for the language model and the vision encoder (``--llm_lr``,
``--vision_encoder_lr``), as optimizer parameter groups. Loss masking, collation and image processing
are TRL's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from trl import SFTConfig, SFTTrainer

from vlm_grpo.configs import REPORT_TO_HELP, apply_device_defaults, batch_vision_attention_field, split_report_to
from vlm_grpo.data.jsonl import LazyImageTransform
from vlm_grpo.fastpath.vision_attention import use_batched_vision_attention
from vlm_grpo.modules import VLMModule
from vlm_grpo.trainer_common import CheckpointReloadMixin, CompleteCheckpointMixin, as_vlm_config, prepare_vlm

logger = logging.getLogger(__name__)


@dataclass
class VLMSFTConfig(SFTConfig):
    """TRL's SFTConfig with defaults that suit VLM runs on any machine (like ``VLMGRPOConfig``)."""

    bf16: bool | None = field(
        default=None,
        metadata={"help": "Use bf16 mixed precision. Default: on when a CUDA device is present, off on CPU."},
    )
    report_to: None | str | list[str] = field(default="none", metadata={"help": REPORT_TO_HELP})  # noqa: RUF036
    llm_lr: float | None = field(
        default=None,
        metadata={"help": "Learning rate of the language model (and everything outside the vision tower). "
                  "Default: --learning_rate."},
    )  # fmt: skip
    vision_encoder_lr: float | None = field(
        default=None,
        metadata={"help": "Learning rate of the vision tower and its projector. Default: --learning_rate."},
    )
    assistant_only_loss: bool = field(
        default=True,
        metadata={
            "help": "Loss only on the assistant's tokens. Uses the chat template's {%% generation %%} markers (TRL "
            "patches known templates); templates without them fall back to prompt/completion rows, where the loss "
            "is on the completion only. false: loss on every token."
        },
    )
    max_length: int | None = field(
        default=None,
        metadata={
            "help": "Truncate sequences to this many tokens (image tokens included). Default: no truncation; use "
            "--max_prompt_length to find rows that are too long before training."
        },
    )
    save_merged_model: bool = field(
        default=True,
        metadata={
            "help": "With LoRA: write the adapter to output_dir/adapter and the merged full model to output_dir, "
            "so output_dir is a --model_name_or_path for GRPO. false: the adapter only, in output_dir."
        },
    )
    batch_vision_attention: bool = batch_vision_attention_field()
    remove_unused_columns: bool = field(
        default=False,
        metadata={"help": "Kept False: the dataset builds its messages and images on access from its own columns."},
    )

    def __post_init__(self) -> None:
        apply_device_defaults(self)
        split_report_to(self)
        super().__post_init__()


class SFTTransform(LazyImageTransform):
    """``datasets`` transform: the GRPO prompt of each row answered by its solution, images decoded on access.

    ``messages`` (prompt + assistant turn) when the loss is masked by the chat template's generation
    markers; ``prompt`` + ``completion`` otherwise (TRL then masks the prompt).
    """

    def __init__(self, module: Any, prompt_completion: bool = False) -> None:
        super().__init__(module)
        self.prompt_completion = prompt_completion

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        out = super().__call__(batch)
        answers = [[{"role": "assistant", "content": [{"type": "text", "text": s}]}] for s in out["solution"]]
        if self.prompt_completion:
            out["completion"] = answers
        else:
            out["messages"] = [prompt + answer for prompt, answer in zip(out.pop("prompt"), answers, strict=True)]
        return out


def assistant_masks_supported(processor: Any) -> bool:
    """Whether assistant-only loss can come from the chat template: it has (or TRL can patch in) the
    ``{% generation %}`` markers, and the processor really returns a non-empty assistant mask for a mixed batch
    (InternVL's processor cannot batch the offsets the mask needs when a text-only row comes first, in
    transformers 5.2x)."""
    from PIL import Image
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    template = getattr(processor, "chat_template", None)
    if not template:
        return False
    try:
        training_template = None if has_generation_markers(template) else get_training_chat_template(processor)
        image = Image.new("RGB", (64, 64), (128, 128, 128))
        answer = {"role": "assistant", "content": [{"type": "text", "text": "A square."}]}
        text_only = [{"role": "user", "content": [{"type": "text", "text": "What is it?"}]}, answer]
        with_image = [
            {"role": "user", "content": [{"type": "image", "image": image}, *text_only[0]["content"]]},
            answer,
        ]
        out = processor.apply_chat_template(
            [text_only, with_image],  # a mixed batch, text-only first: what trips InternVL's processor
            chat_template=training_template,
            tokenize=True,
            return_dict=True,
            return_tensors="pt",
            return_assistant_tokens_mask=True,
            processor_kwargs={"padding": True},
        )
        return bool(torch.as_tensor(out["assistant_masks"]).sum() > 0)
    except Exception as exc:  # a template TRL cannot patch, or a processor that cannot build the mask
        logger.info("Assistant-token masks are not available from this chat template/processor: %r", exc)
        return False


class VLMSFTTrainer(CompleteCheckpointMixin, CheckpointReloadMixin, SFTTrainer):
    """SFT for vision-language models.

    Args beyond ``trl.SFTTrainer``:
        vlm_module: adapter instance or registered name; default: from the checkpoint's ``model_type``.
        freeze_vision_modules: freeze the vision tower and its projector before training.
        lora_include_vision: put LoRA on vision layers too (default: language model only).
        args: a ``VLMSFTConfig``; a plain ``trl.SFTConfig`` keeps its values and gets ``VLMSFTConfig``'s defaults
            for the options it lacks (``llm_lr``, ``batch_vision_attention``, ...); None: all defaults.
    """

    def __init__(
        self,
        model: str | torch.nn.Module,
        args: VLMSFTConfig | None = None,
        *,
        vlm_module: VLMModule | str | None = None,
        freeze_vision_modules: bool = False,
        lora_include_vision: bool = False,
        processing_class: Any = None,
        peft_config: Any = None,
        **kwargs: Any,
    ) -> None:
        args = as_vlm_config(args, VLMSFTConfig, model, "SFT")
        vlm_module, model, processing_class = prepare_vlm(
            model,
            args,
            vlm_module,
            processing_class,
            peft_config,
            freeze_vision_modules=freeze_vision_modules,
            lora_include_vision=lora_include_vision,
        )
        self.vlm_module = vlm_module
        super().__init__(model=model, args=args, processing_class=processing_class, peft_config=peft_config, **kwargs)
        use_batched_vision_attention(self.model, self.args.batch_vision_attention, vlm_module)

    # ------------------------------------------------------------------ two learning rates
    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """Parameter groups (vision / language model) x (decay / no decay), each with its own learning rate."""
        llm_lr = self.args.llm_lr
        vision_lr = self.args.vision_encoder_lr
        if self.optimizer is not None or (llm_lr is None and vision_lr is None):
            return super().create_optimizer(model) if model is not None else super().create_optimizer()
        opt_model = self.model if model is None else model
        decay = set(self.get_decay_parameter_names(opt_model))
        base_lr = self.args.learning_rate
        groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
        for name, param in opt_model.named_parameters():
            if param.requires_grad:
                groups.setdefault((self.vlm_module.is_vision_parameter(name), name in decay), []).append(param)
        param_groups = [
            {
                "params": params,
                "weight_decay": self.args.weight_decay if has_decay else 0.0,
                "lr": (vision_lr if is_vision else llm_lr)
                if (vision_lr if is_vision else llm_lr) is not None
                else base_lr,
                "name": f"{'vision' if is_vision else 'llm'}{'' if has_decay else '_no_decay'}",
            }
            for (is_vision, has_decay), params in sorted(groups.items())
        ]
        if self.optimizer_cls_and_kwargs is not None:
            optimizer_cls, optimizer_kwargs = self.optimizer_cls_and_kwargs
        else:
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        self.optimizer = optimizer_cls(param_groups, **optimizer_kwargs)
        logger.info(
            "Optimizer groups: %s",
            ", ".join(
                f"{g['name']} lr={g['lr']:g} ({sum(p.numel() for p in g['params'])} params)" for g in param_groups
            ),
        )
        return self.optimizer
