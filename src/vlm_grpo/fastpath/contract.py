"""The private TRL / transformers / torch names the speed path and the trainers' hooks rely on, and a check
that they still exist.

Each entry names an owner (``module:qualname``), the private attribute we use, and either the parameters
we call or override it with, or ``source`` (for attributes set at run time: the owner's source must mention
it). ``missing()`` lists what the installed versions lack, one readable line per name.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass


@dataclass(frozen=True)
class PrivateName:
    owner: str  # "module:Qualified.name"
    name: str
    params: tuple[str, ...] = ()  # parameters our override / call passes
    source: str | None = None  # "module:Qualified.name" whose source must mention ``name`` (run-time attribute)
    why: str = ""


PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName(
        "trl:GRPOTrainer",
        "_compute_loss",
        ("model", "inputs"),
        why="reuse_vision_features: the loss pass reads its micro-batch's kept image features",
    ),
    PrivateName(
        "trl:GRPOTrainer",
        "_get_per_token_logps_and_entropies",
        ("model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy"),
        why="share_prompt overrides it (the packed log-prob pass)",
    ),
    PrivateName(
        "trl:GRPOTrainer",
        "_generate_single_turn",
        ("prompt_ids", "images", "multimodal_fields", "num_generations"),
        why="share_prefill overrides it (one prefill per group)",
    ),
    PrivateName("trl:GRPOTrainer", "_tokenize_prompts", ("prompts",), why="mixed text/image batches"),
    PrivateName(
        "trl:GRPOTrainer",
        "_prepare_inputs",
        ("generation_batch",),
        why="trim_completion_padding cuts the micro-batch it returns to its own longest completion",
    ),
    PrivateName(
        "trl:GRPOTrainer", "_get_train_sampler", ("dataset",), why="the epoch-seeded sampler (resume across epochs)"
    ),
    PrivateName(
        "trl:GRPOTrainer",
        "_generate_and_score_completions",
        ("inputs",),
        why="dynamic sampling (extra rounds, kept groups), the rollout log, process_prompts_once's stand-in",
    ),
    PrivateName(
        "trl:GRPOTrainer",
        "self.processing_class(images=",
        source="trl:GRPOTrainer._generate_and_score_completions",
        why="process_prompts_once: the log-prob passes' pixels come from this call, made on the stand-in",
    ),
    PrivateName(
        "trl:GRPOTrainer",
        "self.processing_class.apply_chat_template(",
        source="trl:GRPOTrainer._tokenize_prompts",
        why="process_prompts_once: generation's prompt ids and pixels come from this call, made on the stand-in",
    ),
    PrivateName(
        "trl:GRPOTrainer",
        "_calculate_rewards",
        ("inputs", "prompts", "completions", "completion_ids_list"),
        why="dynamic sampling's filter metric and the rollout log's per-reward values",
    ),
    PrivateName(
        "transformers:Trainer",
        "_load_optimizer_and_scheduler",
        ("checkpoint",),
        why="dynamic sampling restores its prompt stream's position on resume",
    ),
    PrivateName(
        "transformers:Trainer",
        "_save_checkpoint",
        ("model", "trial"),
        why="crash-safe checkpoints: the completion marker written after every rank saved",
    ),
    PrivateName(
        "trl:GRPOTrainer",
        "_compute_loss",
        ("model", "inputs"),
        why="update_chunk_tokens runs TRL's loss per micro-batch on log-probs a chunk's forward computed",
    ),
    *(
        PrivateName(
            "trl:GRPOTrainer",
            name,
            source=f"trl:GRPOTrainer.{where}",
            why="update_chunk_tokens reads a window's micro-batches from TRL's buffer, at TRL's micro-step",
        )
        for name, where in (("_buffered_inputs", "_prepare_inputs"), ("_step", "training_step"))
    ),
    PrivateName(
        "transformers:Trainer",
        "current_gradient_accumulation_steps",
        source="transformers:Trainer._run_epoch",
        why="update_chunk_tokens fuses only windows of the configured length (not an epoch's shorter tail)",
    ),
    PrivateName(
        "trl:GRPOTrainer",
        "_tokenizer",
        source="trl:GRPOTrainer.__init__",
        why="the pad id of the packed rows and the shared prefill",
    ),
    *(
        PrivateName(
            "trl:GRPOTrainer",
            name,
            source="trl:GRPOTrainer.__init__",
            why="tool-image turns on the shared path mark image / video pads as TRL's own path does",
        )
        for name in ("_image_pad_token_id", "_video_pad_token_id")
    ),
    PrivateName("trl.models.utils", "unwrap_model_for_generation", ("model", "accelerator"), why="shared prefill"),
    PrivateName(
        "transformers:Trainer",
        "_load_from_checkpoint",
        ("resume_from_checkpoint", "model"),
        why="checkpoint reload through from_pretrained (CheckpointReloadMixin)",
    ),
    PrivateName("transformers.generation.utils:GenerationMixin", "_prepare_generation_config", ("generation_config",)),
    PrivateName("transformers.generation.utils:GenerationMixin", "_prepare_special_tokens", ("generation_config",)),
    PrivateName(
        "transformers:GenerationConfig",
        "_pad_token_tensor",
        source="transformers.generation.utils:GenerationMixin._prepare_special_tokens",
        why="fast_decode pads and stops like generate",
    ),
    PrivateName(
        "transformers:GenerationConfig",
        "_eos_token_tensor",
        source="transformers.generation.utils:GenerationMixin._prepare_special_tokens",
    ),
    PrivateName(
        "transformers.generation.utils:GenerationMixin",
        "_get_logits_processor",
        ("generation_config", "input_ids_seq_length"),
        why="fast_decode samples with generate's own processors",
    ),
    *(
        PrivateName(
            "transformers.generation.logits_process:MinNewTokensLengthLogitsProcessor",
            name,
            source="transformers.generation.logits_process:MinNewTokensLengthLogitsProcessor.__call__",
            why="decode_select: min_new_tokens counted on the device (inside the decode graph) from its settings",
        )
        for name in ("prompt_length_to_skip", "min_new_tokens", "eos_token_id")
    ),
    PrivateName(
        "transformers:Qwen2VLForConditionalGeneration",
        "_prepare_position_ids_for_generation",
        why="prefill positions (mrope) exactly as generate computes them",
    ),
    PrivateName(
        "transformers:PretrainedConfig", "_attn_implementation", why="block / varlen kernels are selected by name"
    ),
    PrivateName(
        "transformers.modeling_layers:GradientCheckpointingLayer",
        "_gradient_checkpointing_func",
        source="transformers.modeling_layers",
        why="compile_layers wraps the compiled layer in the same checkpoint function",
    ),
    PrivateName("transformers.integrations.sdpa_attention", "sdpa_attention_forward", ("module", "query", "key")),
    PrivateName("transformers.masking_utils", "sdpa_mask", why="the block kernel's fallback mask"),
    PrivateName("torch._dynamo.exc", "TorchDynamoException", why="compile_layers falls back to eager on it"),
    PrivateName(
        "torch._inductor.runtime.cache_dir_utils",
        "default_cache_dir",
        why="compile_cache: the folder inductor writes into TORCHINDUCTOR_CACHE_DIR itself is not a user's choice",
    ),
    PrivateName(
        "transformers.cache_utils:StaticLayer",
        "cumulative_length",
        source="transformers.cache_utils:StaticLayer.update",
        why="decode_cache: one write position shared by every layer; fast_decode sets it after the prompt; "
        "cache_restored rewinds it around a capture",
    ),
    PrivateName(
        "transformers.cache_utils:StaticLayer",
        "lazy_initialization",
        ("key_states", "value_states"),
        why="decode_cache allocates each layer's K/V with the prefill's dtypes; SharedPositionLayer extends it",
    ),
    PrivateName(
        "transformers.cache_utils:StaticLayer",
        "update",
        ("key_states", "value_states"),
        why="SharedPositionLayer overrides it (the shared write position; only the last layer advances it)",
    ),
    PrivateName(
        "transformers.cache_utils:Cache",
        "self.layers[layer_idx].update(",
        source="transformers.cache_utils:Cache.update",
        why="decode_cache's layers receive the decoder's cache updates through the cache's layer list",
    ),
    PrivateName(
        "torch._dynamo", "maybe_mark_dynamic", ("t", "index"), why="one compiled decode step for every attention window"
    ),
    PrivateName(
        "torch", "_assert_async", why="decode_select.sample_one: multinomial's checks inside the compiled selection"
    ),
    PrivateName(
        "transformers.activations",
        "SiLUActivation",
        why="decode_mlp: the MLP's act_fn is SiLU (ACT2FN['silu']), the one activation the kernel computes",
    ),
    PrivateName(
        "torch:ops.aten",
        "_flash_attention_forward",
        ("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p", "is_causal", "scale"),
        why="packed_attention=blocks, batch_vision_attention: packed rows / vision segments in one varlen flash call",
    ),
    # Tool rollouts (vlm_grpo.tools; not the speed path, but the same kind of dependency)
    PrivateName(
        "trl:GRPOTrainer",
        "_tool_call_loop",
        ("prompts", "prompt_ids", "completion_ids", "completions", "logprobs", "images", "multimodal_fields"),
        why="tool protocols: turns read, replies worded, budgets; tool metrics, sandbox cells prefetched",
    ),
    PrivateName(
        "trl:GRPOTrainer",
        "_generate",
        ("prompts",),
        why="with tools, the completions handed on are rebuilt from the tokens (the rollout as written and read)",
    ),
    PrivateName(
        "trl:GRPOTrainer",
        "_get_tool_suffix_ids",
        ("tool_messages",),
        why="protocols that word their own replies (PyVision, DeepEyes) have them rendered as one user turn",
    ),
    PrivateName(
        "trl:GRPOTrainer",
        "_env_tools",
        source="trl:GRPOTrainer._tokenize_prompts",
        why="protocols whose prompts describe the tools render no tool schemas; tools shown in --tools order",
    ),
    PrivateName(
        "trl:GRPOTrainer",
        "_sync_tool_dicts",
        source="trl:GRPOTrainer._generate_and_score_completions",
        why="a malformed call is answered through a hidden tool in every rollout's tool dict",
    ),
    PrivateName(
        "trl:GRPOTrainer",
        "_tokenizer",
        source="trl:GRPOTrainer._tool_call_loop",
        why="the tool loop parses later turns with parse_response(self._tokenizer, ...): a wrapper stands in there",
    ),
    PrivateName(
        "trl.trainer.grpo_trainer",
        "parse_response",
        source="trl:GRPOTrainer._tool_call_loop",
        why="later turns are parsed in the loop through the tokenizer, so the wrapper sees their malformed calls",
    ),
    PrivateName(
        "trl.chat_template_utils",
        "parse_response",
        ("tokenizer", "ids", "prefix", "tools"),
        why="the wrapper runs it on the real tokenizer: TRL's fallback to text and its tool-call checks",
    ),
    *(
        PrivateName(
            "trl:GRPOTrainer",
            name,
            source=f"trl:GRPOTrainer.{where}",
            why="early_tool_calls reads an ended turn as TRL's loop will: its round, its tools, its budget cut",
        )
        for name, where in (
            ("max_tool_calling_iterations", "_tool_call_loop"),
            ("_batch_environments", "_tool_call_loop"),
            ("environment_factories", "_tool_call_loop"),
            ("excess_length", "_tool_call_loop"),
        )
    ),
)


def _resolve(spec: str) -> object:
    module_name, _, qualname = spec.partition(":")
    obj: object = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def _param_names(obj: object) -> list[str] | None:
    """The parameter names of a function, or of a torch operator's schema; None when neither can be read."""
    schema = getattr(getattr(obj, "default", None), "_schema", None)
    if schema is not None:
        return [argument.name for argument in schema.arguments]
    try:
        return list(inspect.signature(obj).parameters)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def check(entry: PrivateName) -> str | None:
    """None if ``entry`` holds in the installed versions, else what is missing."""
    label = f"{entry.owner.replace(':', '.')}.{entry.name}"
    try:
        owner = _resolve(entry.owner)
    except (ImportError, AttributeError) as err:
        return f"{label}: cannot import {entry.owner} ({err})"
    if entry.source is not None:
        try:
            text = inspect.getsource(_resolve(entry.source))  # type: ignore[arg-type]
        except (ImportError, AttributeError, OSError, TypeError) as err:
            return f"{label}: cannot read {entry.source} ({err})"
        return None if entry.name in text else f"{label}: {entry.source} no longer sets or uses '{entry.name}'"
    if not hasattr(owner, entry.name):
        return f"{label}: missing"
    if entry.params:
        params = _param_names(getattr(owner, entry.name))
        if params is None:
            return None
        absent = [p for p in entry.params if p not in params]
        if absent:
            return f"{label}: signature changed, no parameter(s) {', '.join(absent)}"
    return None


def missing() -> list[str]:
    """One line per private name the installed TRL / transformers / torch no longer has as we use it."""
    return [problem for entry in PRIVATE_NAMES if (problem := check(entry)) is not None]
