"""Command-line / YAML configuration: TRL's dataclasses, extended (never shadowed).

``GRPOScriptArguments`` holds the data and reward flags, ``VLMModelConfig`` the model-family
flags, ``VLMGRPOConfig`` the training flags. Flag names follow VLM-R1 where it has one.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from trl import GRPOConfig, ModelConfig, ScriptArguments

from vlm_grpo.advantages import check_estimator
from vlm_grpo.fastpath.compile_cache import check_setting as check_compile_cache
from vlm_grpo.tools.protocols import TOOL_PROTOCOL_HELP


def batch_vision_attention_field() -> Any:
    """The ``batch_vision_attention`` option, shared by the GRPO and SFT configs."""
    return field(
        default=True,
        metadata={
            "help": "Qwen-VL vision towers under sdpa: attention over all segments (images, and Qwen2.5-VL's "
            "windows) in one call of torch's flash varlen kernel on GPUs (fp16 / bf16), elsewhere one sdpa call per "
            "distinct segment length, instead of one call per segment; through a registered kernel (no flash-attn "
            "needed). Same numbers (tested); eager and flash towers are left alone. Turn off for transformers' "
            "per-segment loop."
        },
    )


# TrainingArguments' ``report_to``, with what a run does for wandb without an API key (GRPO and SFT configs). Its
# type is written as TrainingArguments writes it: HfArgumentParser takes the second member as the flag's type.
REPORT_TO_HELP = (
    "Integrations to report the logs to (wandb, tensorboard, trackio, ...; several comma-separated), 'all' for every "
    "installed one, 'none' for none. wandb without an API key (no WANDB_API_KEY, no `wandb login`, no WANDB_MODE): "
    "one warning, and the run logs offline under ./wandb (upload it later with `wandb sync`)."
)


@dataclass
class GRPOScriptArguments(ScriptArguments):
    data_file_paths: str | None = field(
        default=None,
        metadata={
            "help": "Training data, separated by ':' (VLM-R1 convention): JSONL, JSON, parquet or arrow files, "
            "folders written by datasets' save_to_disk (DIR or DIR@split), and name@split of a dataset in the local "
            "Hugging Face cache, e.g. 'a.jsonl:geo.parquet:hiyouga/geometry3k@train'."
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
    eval_file_paths: str | None = field(
        default=None,
        metadata={
            "help": "Evaluation data, in any form --data_file_paths takes (':'-separated), checked like the training "
            "rows; instead of --val_split_ratio. Not read when the run never evaluates (--eval_strategy no without "
            "--eval_on_start)."
        },
    )
    format_prompt: str | None = field(
        default=None,
        metadata={
            "help": "Jinja template file that renders the user prompt from the row (EasyR1's data.format_prompt): "
            "sees content / prompt (the question), answer, images and every column; sandboxed. EasyR1's math, "
            "r1v and dapo templates are in configs/templates/. Replaces the family's task template."
        },
    )
    prompt_key: str | None = field(
        default=None,
        metadata={"help": "Column holding the question (EasyR1's data.prompt_key; default 'problem')."},
    )
    answer_key: str | None = field(
        default=None,
        metadata={"help": "Column holding the solution (EasyR1's data.answer_key; default 'answer')."},
    )
    image_key: str | None = field(
        default=None,
        metadata={
            "help": "Column holding the images: paths, data URIs, or HF Image features {bytes, path} "
            "(EasyR1's data.image_key; default 'images')."
        },
    )
    video_key: str | None = field(
        default=None,
        metadata={"help": "Column holding a video: a file or a list of frame images (default 'video' / 'videos')."},
    )
    video_fps: float = field(
        default=2.0, metadata={"help": "Video rows: frames sampled per second of video (EasyR1's data.video_fps)."}
    )
    video_max_frames: int = field(
        default=16, metadata={"help": "Video rows: most frames taken; longer clips are sampled evenly across."}
    )
    video_max_pixels: int | None = field(
        default=None, metadata={"help": "Video rows: frames larger than this many pixels are shrunk to it."}
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
    reward_aliases: str | None = field(
        default=None,
        metadata={
            "help": "Read --reward_funcs with a seed system's reward names: 'vivqa_x' (accuracy -> vqa_graded, "
            "format -> format_explain) or 'lewis' (accuracy -> listener, format -> format_speaker, length -> "
            "one_sentence). The seed's name stays the metric label; each mapping is logged. Off by default: a name "
            "always means the registered reward.",
            "choices": ["vivqa_x", "lewis"],
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
    mm_max_length: int | None = field(
        default=None,
        metadata={
            "help": "Rows whose images take more image (multimodal) tokens in all are bad rows (reported, or skipped "
            "with --skip_bad_rows); RynnScale's --mm_max_length. Images are never resized to fit."
        },
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start a fresh run in an output_dir that is not empty: old checkpoint-* folders are removed, "
            "other files written over. Without it such an output_dir is an error (unless resuming from a checkpoint "
            "there)."
        },
    )
    plot: bool = field(
        default=True,
        metadata={
            "help": "At the end of the run, write output_dir/curves.png from the log history (rewards, accuracy, "
            "entropy, KL, completion length, frac_reward_zero_std; SFT: loss, token accuracy). Same as "
            "vlm-grpo-plot output_dir."
        },
    )

    # Tools: multi-turn rollouts (TRL's tool loop; --max_tool_calling_iterations caps the tool rounds)
    tools: list[str] | None = field(
        default=None,
        metadata={
            "help": "Tools the policy may call during a rollout, by registered name (zoom_in, crop, rotate, python) or "
            "as plugins 'path/to/file.py:fn' / 'package.module:fn'. Their results (text and images) are appended to "
            "the conversation and masked out of the loss."
        },
    )
    tool_kwargs: str | None = field(
        default=None,
        metadata={
            "help": "Options per tool, as JSON (or a mapping in the YAML config): "
            '\'{"python": {"timeout": 10, "memory_mb": 2048}, "zoom_in": {"size": 448}}\'.'
        },
    )
    tool_protocol: str | None = field(
        default=None,
        metadata={"help": TOOL_PROTOCOL_HELP},
    )
    max_turn_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Tool rollouts: the most new tokens one assistant turn may write (verl's "
            "single_response_max_tokens); max_completion_length still bounds the whole rollout. Default: none."
        },
    )
    max_tool_images: int | None = field(
        default=None,
        metadata={
            "help": "Tool rollouts: the most images the tools may return in one rollout; a call past it is answered "
            "with an error the model reads, images past it are left out (hermes replies say so). Default: no limit."
        },
    )
    max_context_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Tool rollouts: the most tokens of one rollout's whole context (prompt, turns, tool replies). "
            "A turn is cut where the context reaches it, and a turn that ends at or past it runs no tool: the "
            "rollout ends there. Default: the model's own limit."
        },
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
    report_to: None | str | list[str] = field(default="none", metadata={"help": REPORT_TO_HELP})  # noqa: RUF036
    share_prompt: bool = field(
        default=True,
        metadata={
            "help": "Compute log-probs (old, reference, policy) of each GRPO group in one forward over "
            "[prompt | c1 | ... | cG]: the prompt and its images are processed once instead of G times (with tools, "
            "each block holds one rollout's turns, tool replies and tool images). "
            "Same numbers as TRL's per-row pass (parity-tested); turn off to use TRL's path."
        },
    )

    packed_attention: str = field(
        default="blocks",
        metadata={
            "help": "Attention kernel of the share_prompt pass. 'blocks': the prefix attends causally and the G "
            "blocks attend to [prefix, own block] with a lower-right causal bias (flash / memory-efficient sdpa "
            "on GPU, no (P+G*C)^2 mask); used for sdpa models with full attention in every layer. 'dense': sdpa "
            "or eager with a dense block mask (the reference; eager models always use it). A text decoder "
            "loaded with a kernel that ignores dense masks (flash_attention_2, flex, ...) is moved to sdpa's "
            "kernels, with one info line, so the packed passes never hand it a mask it would ignore.",
            "choices": ["blocks", "dense"],
        },
    )
    packed_chunk_tokens: int | None = field(
        default=None,
        metadata={
            "help": "share_prompt's old and reference log-prob passes: pack whole GRPO groups into each forward up "
            "to this many packed tokens (each distinct prompt once, then every rollout's own length + 1) instead "
            "of TRL's per_device_train_batch_size rows per forward. None (default): TRL's chunks of rows. With "
            "rows of a few hundred tokens and a micro-batch smaller than a group, TRL's chunks run one group per "
            "forward; a budget such as 65536 fills the card with fewer, larger forwards. These passes keep no "
            "gradients, so peak memory grows with the budget by one layer's activations. A group longer than the "
            "budget gets a forward of its own. The training pass is one forward per micro-batch either way."
        },
    )
    update_chunk_tokens: int | None = field(
        default=None,
        metadata={
            "help": "The update pass: run an optimizer step's micro-batches (all but its last) as a few larger "
            "forwards + backwards of up to this many padded tokens each (rows x longest prompt + completion), "
            "instead of one per micro-batch. Each micro-batch's loss is still TRL's on its own rows (every "
            "loss_type's normaliser, the scaling for gradient accumulation, the logged loss and metrics: "
            "parity-tested), so the step computes the same; with small micro-batches (EasyR1's 1-4 rows) it trades "
            "memory (activations of a chunk instead of a micro-batch) for speed: fewer, fuller kernel launches. "
            "Like packed_chunk_tokens for the old and reference passes. None (default): one forward per "
            "micro-batch. DeepSpeed, FSDP and MoE router losses keep TRL's micro-batches, with one info line."
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
    fuse_decode_projections: bool = field(
        default=True,
        metadata={
            "help": "With fast_decode: run q|k|v and gate|up as one GEMM each in the decode step, over weights "
            "concatenated from the live ones at the start of every generation call and freed at its end (3B: "
            "~3.6 GB, 7B: ~8.5 GB while generating; kept between calls under keep_decode_graphs). LoRA layers "
            "without dropout have their adapters folded into that copy (the model's weights are not touched), so a "
            "LoRA decode step costs what a full one does; "
            "with lora_dropout > 0 the LoRA layers run as they are around the fused base. The same tokens as "
            "generate (tested)."
        },
    )
    keep_decode_graphs: bool | None = field(
        default=None,
        metadata={
            "help": "With fast_decode on a GPU: keep the decode step's CUDA graphs, its static cache and the fused "
            "weights from one generation call to the next, which then refills them and replays the graphs instead "
            "of warming up and capturing again. Measured on an H100 (3B, prompt lengths changing every step): "
            "448px C128 1.51-1.65 -> 1.43-1.48 s/step, 896px C128 2.26 -> 2.06, 448px C1024 5.94 -> 5.69. "
            "What is kept stays allocated through training: the fused copy (3B: ~3.6 GB) and the cache for the "
            "longest decode so far (3B: peak memory +3.4 GiB). Anything a graph bakes in that changes (the "
            "batch's rows, a module's train / eval mode or adapters, a parameter's address) makes a new capture; "
            "the workspaces of up to two other batch widths stay kept too (tool rounds over the rollouts still "
            "calling tools), within the same memory share by default. "
            "None (default): on where the "
            "kept state is at most a tenth of the card's memory, and off under DeepSpeed ZeRO-3 / FSDP (True is "
            "refused there: parameters are gathered into new memory at every call, so nothing kept could be "
            "replayed). Same tokens as capturing at every call (tested on CPU; greedy tokens equal on an H100)."
        },
    )
    compile_layers: bool | None = field(
        default=None,
        metadata={
            "help": "In the share_prompt passes, run each text decoder layer, and each vision block where the "
            "tower's attention allows it (Qwen's batched varlen kernel, InternVL), through torch.compile (the "
            "attention kernels stay eager islands, gradient checkpointing wraps the compiled layer). None "
            "(default): on for a GPU, off on CPU and under DeepSpeed ZeRO-3 / FSDP (where True is refused: their "
            "per-module hooks would run inside the compiled layers). Measured on an H100 (3B, gradient "
            "checkpointing, prompt lengths changing every step): the decoder layers take 2.5-4 percent off the "
            "step (448px C128 1.47 -> 1.41 s, 896px C128 2.14 -> 2.09 s, 448px C1024 6.11 -> 5.93 s); the vision "
            "blocks about 0.02-0.03 s more off the loss pass at 448px. Log-probs and gradients match TRL's "
            "(tested); the first steps pay the compilation (a few seconds) and a second completion width "
            "recompiles once; a failed compilation warns and runs eagerly."
        },
    )
    trim_completion_padding: bool = field(
        default=True,
        metadata={
            "help": "Cut each training micro-batch's completions to its own longest one: TRL pads every "
            "completion to the longest of the whole generation batch, so with rows of different lengths a "
            "micro-batch runs its forward and backward mostly over padding. Only columns with no token of any row "
            "of the micro-batch are dropped, from every per-token tensor at once: the loss, its gradients and "
            "the metrics are unchanged (tested)."
        },
    )
    compile_cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "Where compiled artifacts persist between runs (torch.compile's graphs and autotuning results, "
            "the Triton kernels' binaries), in a sub-folder named after the torch / Triton versions and the card, so "
            "a second run of the same command loads them instead of compiling. None (default): "
            "$VLM_GRPO_COMPILE_CACHE, else compile/ in $VLM_GRPO_CACHE or ~/.cache/vlm_grpo; a "
            "TORCHINDUCTOR_CACHE_DIR or TRITON_CACHE_DIR you set stays in charge then. 'off': a temporary folder "
            "removed at exit (every run compiles from scratch)."
        },
    )
    cudnn_attention: bool = field(
        default=False,
        metadata={
            "help": "Let sdpa use its cuDNN kernels. False (default): the trainer turns sdpa's cuDNN backend off "
            "for the process (torch.backends.cuda.enable_cudnn_sdp(False)), as TrainingArguments' tf32 sets "
            "matmul precision. cuDNN builds an execution plan for every sequence length it has not seen: 148 ms "
            "on an H100 against 1.9 ms for a repeat call, and GRPO prompts change length every step; flash and "
            "memory-efficient kernels are as fast on a repeat. A process-wide switch, so "
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

    reuse_vision_features: bool = field(
        default=True,
        metadata={
            "help": "Encode each image once per generation: the log-prob passes take the image features the "
            "generation prefill computed instead of running the vision tower again. Exact where the weights that "
            "encode are the generation's: always in the old-log-prob pass; in the reference and loss passes only "
            "when the vision tower and projector train no parameter (--freeze_vision_modules, LoRA outside the "
            "tower) and a separate reference model's tower holds the same weights. A trained tower encodes in the "
            "loss pass, as gradients flow through it. Holds the features of a generation batch on the device "
            "(Qwen2.5-VL-3B, 64 distinct 512x512 images: about 85 MB). Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE), "
            "GLM-4.1V/4.5V and InternVL; other families encode in every pass."
        },
    )

    process_prompts_once: bool = field(
        default=True,
        metadata={
            "help": "Run the processor (chat template, tokenizer, image preprocessing) once per distinct prompt of "
            "a batch and repeat its outputs for the G copies, in TRL's two processor calls per step. The same "
            "tensors as TRL's call over every row (tested for every family); outputs it cannot lay out per row "
            "(videos, uncounted tiles) are processed row by row, with one info line. Measured on an H100 host "
            "at 896px: 16 rows 140 ms, their 2 distinct rows 11 ms."
        },
    )

    fast_decode: bool = field(
        default=True,
        metadata={
            "help": "With share_prefill: decode from a static KV cache with the decode step captured in a CUDA "
            "graph (GPU; the same loop runs eagerly on CPU). Sampling uses generate's own logits processors, "
            "so greedy outputs equal generate's (tested). Decodes with generate (after the shared prefill) for "
            "flash/flex attention, sliding-window layers and ZeRO-3 without ds3_gather_for_generation; options "
            "the shared path cannot honour (beam search, stop strings, max_time, a wrapped generate, ...) send the "
            "whole generation through TRL's own path, with one info line."
        },
    )

    early_tool_calls: bool = field(
        default=True,
        metadata={
            "help": "With tools and fast_decode: a rollout whose turn has ended starts its calls of parallel tools "
            "(fn.parallel = True, e.g. python) while the other rollouts of the round still decode, instead of after "
            "the round. The turn is read as TRL's tool loop reads it (budgets, stop string, protocol), and TRL's "
            "call collects the result: each call runs once, and tokens, masks and metrics are unchanged (tested). "
            "Other tools run when TRL's loop calls them. Rounds stay TRL's: the next turns start when every tool "
            "call of the round has returned."
        },
    )

    advantage_estimator: str = field(
        default="grpo",
        metadata={
            "help": "How advantages are computed from the rewards (EasyR1 algorithm.adv_estimator). 'grpo': TRL's "
            "group-normalised advantages (see scale_rewards). 'rloo': reward minus the mean of the other "
            "completions of its group (leave-one-out), not scaled. 'reinforce_plus_plus': no group baseline; "
            "rewards whitened over all completion tokens of the generation batch. 'gae' (needs a critic) and "
            "'remax' are refused with an error.",
        },
    )

    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "DAPO dynamic sampling (EasyR1 online_filtering): drop groups whose rewards do not vary (all "
            "right or all wrong; or, with --filter_key, whose mean is outside (filter_low, filter_high)) and "
            "generate groups for further prompts until the batch is full again. Logs dynamic_sampling/kept_groups, "
            "/dropped_groups, /rounds, /filled_groups."
        },
    )
    max_sampling_rounds: int = field(
        default=4,
        metadata={
            "help": "dynamic_sampling: most generation rounds per batch. When they run out, the missing groups are "
            "filled with dropped ones (zero advantage, no policy-gradient signal) and a warning is logged."
        },
    )
    filter_key: str | None = field(
        default=None,
        metadata={
            "help": "dynamic_sampling: filter on the group mean of this value instead of on zero spread (EasyR1 "
            "algorithm.filter_key): a reward name, 'reward' / 'overall' for the weighted sum, or a key of the dicts a "
            "batch reward returns ('accuracy' of {overall, accuracy, format}; 'name/key' when two rewards return it)."
        },
    )
    filter_low: float = field(
        default=0.01, metadata={"help": "dynamic_sampling with filter_key: keep groups whose mean is above this."}
    )
    filter_high: float = field(
        default=0.99, metadata={"help": "dynamic_sampling with filter_key: keep groups whose mean is below this."}
    )

    rollout_log: str | None = field(
        default=None,
        metadata={
            "help": "Append every rollout (prompt, image paths, completion, each reward, advantage, step) to this "
            "JSONL file; rank r > 0 writes NAME.rank<r>.jsonl. VLM-R1's DEBUG_MODE=true + LOG_PATH turn it on "
            "when this is not given."
        },
    )
    rollout_log_every: int = field(default=1, metadata={"help": "rollout_log: log every N-th step (1, 1+N, ...)."})
    rollout_log_max_chars: int | None = field(
        default=None, metadata={"help": "rollout_log: cut prompts, solutions and completions to this many chars."}
    )

    def __post_init__(self) -> None:
        check_estimator(self.advantage_estimator)
        check_compile_cache(self.compile_cache_dir)
        if self.packed_chunk_tokens is not None and self.packed_chunk_tokens < 1:
            raise ValueError(
                f"packed_chunk_tokens={self.packed_chunk_tokens}: give a positive number of tokens per forward, "
                "or leave it unset for TRL's chunks of per_device_train_batch_size rows"
            )
        if self.update_chunk_tokens is not None and self.update_chunk_tokens < 1:
            raise ValueError(
                f"update_chunk_tokens={self.update_chunk_tokens}: give a positive number of padded tokens per "
                "forward of the update pass, or leave it unset for one forward per micro-batch"
            )
        apply_device_defaults(self)
        split_report_to(self)
        super().__post_init__()


def split_report_to(args: Any) -> None:
    """``--report_to wandb,tensorboard`` as a list: the command line takes one string (GRPO and SFT configs)."""
    if isinstance(args.report_to, str) and "," in args.report_to:
        args.report_to = [name.strip() for name in args.report_to.split(",") if name.strip()]


def apply_device_defaults(args: Any) -> None:
    """Device handling shared by the GRPO and SFT configs; call before ``TrainingArguments.__post_init__``.

    Without an accelerator, accelerate only forms a process group under torchrun when told to: plain DDP
    needs use_cpu (else every rank silently trains alone as "rank 0 of 1"), and DeepSpeed needs an explicit
    gloo backend (use_cpu would bypass DeepSpeed altogether). bf16 defaults to on only with an accelerator.
    """
    if not torch.accelerator.is_available():
        if args.deepspeed:
            _configure_cpu_deepspeed(args)
            if args.bf16:  # VLM-R1 scripts pass --bf16; transformers refuses bf16 without a GPU unless use_cpu
                logging.getLogger("vlm_grpo").warning("--bf16 with DeepSpeed needs a GPU: training in fp32 on CPU")
                args.bf16 = False
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
