"""Command-line / YAML configuration: TRL's dataclasses, extended (never shadowed).

``GRPOScriptArguments`` holds the data and reward flags, ``VLMModelConfig`` the model-family
flags, ``VLMGRPOConfig`` the training flags. Flag names follow VLM-R1 where it has one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from trl import GRPOConfig, ModelConfig, ScriptArguments


def batch_vision_attention_field() -> Any:
    """The ``batch_vision_attention`` option, shared by the GRPO and SFT configs."""
    return field(
        default=True,
        metadata={
            "help": "Qwen-VL vision towers under sdpa: one sdpa call per distinct segment length (images, and "
            "Qwen2.5-VL's windows) instead of one per segment, through a registered varlen kernel (torch sdpa, no "
            "flash-attn needed). Same numbers (tested); eager and flash towers are left alone. Turn off for "
            "transformers' per-segment loop."
        },
    )


@dataclass
class GRPOScriptArguments(ScriptArguments):
    data_file_paths: str | None = field(
        default=None,
        metadata={
            "help": "Training files (JSONL, JSON or parquet), separated by ':' (VLM-R1 convention), "
            "e.g. 'a.jsonl:b.jsonl'."
        },
    )
    image_folders: str | None = field(
        default=None,
        metadata={
            "help": "Image folders, separated by ':': one per data file, or one for all. Relative image paths in "
            "rows are resolved against them (default: the data file's own folder)."
        },
    )
    val_split_ratio: float = field(
        default=0.0, metadata={"help": "Fraction of the rows held out as an evaluation split (0 = none)."}
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["accuracy", "format"],
        metadata={
            "help": "Rewards by registered name, or plugins as 'path/to/file.py:fn' / 'package.module:fn', "
            "optionally named 'label=path/to/file.py:fn'. The label names the reward's metrics and its "
            "--reward_kwargs entry (default: the function name, or file.fn when two plugins share one). Weights "
            "come from --reward_weights."
        },
    )
    reward_kwargs: str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments bound to rewards, as JSON (or a mapping in the YAML config): "
            '\'{"vqa_graded": {"scale": 3.0}, "iou": {"threshold": 0.5}}\'.'
        },
    )
    reward_max_failed_batches: int = field(
        default=5,
        metadata={
            "help": "Stop the run (error naming the reward, its exception and the likely fix) when a reward raises on "
            "every sample of its first batch, or of this many batches in a row. 0: never stop; those samples just "
            "get no reward."
        },
    )
    vlmr1_solution_tags: bool = field(
        default=False,
        metadata={
            "help": "Wrap each solution in '<answer> ... </answer>' (unless it already has an <answer> tag) before "
            "the rewards see it, as VLM-R1's data loader does: its own reward functions (iou_reward, ...) read the "
            "solution's last <answer>."
        },
    )
    reward_method: str | None = field(
        default=None,
        metadata={
            "help": "Accuracy method for rows without their own 'accu_reward_method' (e.g. default, math, exact)."
        },
    )
    task_type: str | None = field(
        default=None,
        metadata={
            "help": "Task of rows without their own 'task_type' (default, vqa, counting, rec, raw); picks the "
            "question template of the VLM module."
        },
    )
    skip_bad_rows: bool = field(
        default=False,
        metadata={"help": "Skip (and count in the log) rows that fail validation instead of stopping the run."},
    )
    is_reward_customized_from_vlm_module: bool = field(
        default=False,
        metadata={"help": "Let the VLM module replace registered rewards with its own variants of the same name."},
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Rows whose prompt (text after the chat template + image tokens) is longer are bad rows "
            "(reported, or skipped with --skip_bad_rows). TRL 1.x does not truncate prompts."
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Start a fresh run even if output_dir already holds checkpoint-* folders."},
    )


@dataclass
class VLMModelConfig(ModelConfig):
    vlm_module: str | None = field(
        default=None,
        metadata={"help": "VLM module (adapter) name; default: chosen from the checkpoint's config.json model_type."},
    )
    min_pixels: int | None = field(
        default=None, metadata={"help": "Qwen-VL families: smallest image area (pixels) after resizing."}
    )
    max_pixels: int | None = field(
        default=None, metadata={"help": "Qwen-VL families: largest image area (pixels) after resizing."}
    )
    max_anyres_num: int | None = field(
        default=None, metadata={"help": "InternVL: most tiles an image is cut into (dynamic resolution)."}
    )
    freeze_vision_modules: bool = field(
        default=False, metadata={"help": "Freeze the vision tower and its projector (full fine-tuning or LoRA)."}
    )
    lora_include_vision: bool = field(
        default=False,
        metadata={"help": "Also put LoRA on the vision tower's linear layers (off: LoRA on the language model only)."},
    )


@dataclass
class VLMGRPOConfig(GRPOConfig):
    """TRL's GRPOConfig with defaults that suit VLM runs on any machine."""

    bf16: bool | None = field(
        default=None,
        metadata={"help": "Use bf16 mixed precision. Default: on when a CUDA device is present, off on CPU."},
    )
    share_prompt: bool = field(
        default=True,
        metadata={
            "help": "Compute log-probs (old, reference, policy) of each GRPO group in one forward over "
            "[prompt | c1 | ... | cG]: the prompt and its images are processed once instead of G times. "
            "Same numbers as TRL's per-row pass (parity-tested); turn off to use TRL's path."
        },
    )

    packed_attention: str = field(
        default="blocks",
        metadata={
            "help": "Attention kernel of the share_prompt pass. 'blocks': the prefix attends causally and the G "
            "blocks attend to [prefix, own block] with a lower-right causal bias (flash / memory-efficient sdpa "
            "on GPU, no (P+G*C)^2 mask); used for sdpa models with full attention in every layer. 'dense': sdpa "
            "or eager with a dense block mask (the reference; eager models always use it).",
            "choices": ["blocks", "dense"],
        },
    )
    compile_decode: bool | None = field(
        default=None,
        metadata={
            "help": "With fast_decode: run the decode step through torch.compile before the CUDA graph captures "
            "it, fusing the hundreds of small norm / rotary / elementwise kernels of a decoder step. None "
            "(default): on GPU only. The first generation call pays the compilation once. Cache lengths are "
            "rounded up to a multiple of 256, so a new prompt length in a bucket already seen compiles nothing; "
            "the first call in another bucket recompiles once with the length dynamic, and later ones compile "
            "nothing. Greedy outputs equal generate's (tested); a failed compilation warns and decodes eagerly."
        },
    )
    compile_layers: bool = field(
        default=False,
        metadata={
            "help": "In the share_prompt passes, run each text decoder layer through torch.compile (the packed "
            "attention kernel stays eager, gradient checkpointing wraps the compiled layer). Measured on an H100 "
            "(3B, gradient checkpointing): the training window shrinks at 512 completion tokens (0.79 -> 0.67 s, "
            "MFU 25.5 -> 30.0 percent) but not at 128, and the step time not at all, hence off by default. Log-probs "
            "and gradients match TRL's (tested); the first steps pay the compilation; a failed compilation warns "
            "and runs eagerly. Not with DeepSpeed ZeRO-3 or FSDP."
        },
    )
    cudnn_attention: bool = field(
        default=False,
        metadata={
            "help": "Let sdpa use its cuDNN kernels. False (default): the trainer turns sdpa's cuDNN backend off "
            "for the process (torch.backends.cuda.enable_cudnn_sdp(False)), as TrainingArguments' tf32 sets "
            "matmul precision. cuDNN builds an execution plan for every sequence length it has not seen: 148 ms "
            "on an H100 against 1.9 ms for a repeat call, and GRPO prompts change length every step; flash and "
            "memory-efficient kernels are as fast on a repeat (benchmarks/RESULTS.md). A process-wide switch, so "
            "that the recomputation of gradient checkpointing picks the kernels the forward picked."
        },
    )
    batch_vision_attention: bool = batch_vision_attention_field()
    share_prefill: bool = field(
        default=True,
        metadata={
            "help": "In generation, prefill each unique prompt (and encode its images) once and decode its G "
            "samples from the repeated KV cache. Greedy outputs equal the per-row path (tested)."
        },
    )

    fast_decode: bool = field(
        default=True,
        metadata={
            "help": "With share_prefill: decode from a static KV cache with the decode step captured in a CUDA "
            "graph (GPU; the same loop runs eagerly on CPU). Sampling uses generate's own logits processors, "
            "so greedy outputs equal generate's (tested). Falls back to generate for flash/flex attention, "
            "sliding-window layers, beam search, stop strings, and ZeRO-3 without ds3_gather_for_generation."
        },
    )

    def __post_init__(self) -> None:
        apply_device_defaults(self)
        super().__post_init__()


def apply_device_defaults(args: Any) -> None:
    """Device handling shared by the GRPO and SFT configs; call before ``TrainingArguments.__post_init__``.

    Without an accelerator, accelerate only forms a process group under torchrun when told to: plain DDP
    needs use_cpu (else every rank silently trains alone as "rank 0 of 1"), and DeepSpeed needs an explicit
    gloo backend (use_cpu would bypass DeepSpeed altogether). bf16 defaults to on only with an accelerator.
    """
    if not torch.accelerator.is_available():
        if args.deepspeed:
            _configure_cpu_deepspeed(args)
        else:
            args.use_cpu = True
    if args.bf16 is None and not args.fp16:
        args.bf16 = torch.accelerator.is_available() and not args.use_cpu


def _configure_cpu_deepspeed(args: Any) -> None:
    """DeepSpeed on CPU under torchrun (tests, laptops): form the gloo group ourselves.

    ``TrainingArguments`` gives accelerate no backend on the DeepSpeed path, and with no CUDA that
    means "not distributed": each rank would compute batch sizes for a world of 1. We create the
    DeepSpeed-flavoured ``PartialState`` with gloo and tell ``TrainingArguments`` to use it.
    """
    if int(os.environ.get("LOCAL_RANK", -1)) == -1:
        return
    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        PartialState(backend=args.ddp_backend or "gloo")
    finally:
        del os.environ["ACCELERATE_USE_DEEPSPEED"]
    if args.accelerator_config is None:
        args.accelerator_config = {"use_configured_state": True}
    elif isinstance(args.accelerator_config, dict):
        args.accelerator_config["use_configured_state"] = True
    else:
        raise ValueError("DeepSpeed on CPU needs accelerator_config as a dict (or unset), not a file path")
