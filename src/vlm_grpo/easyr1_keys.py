"""EasyR1's config keys that have no effect here, each with the reason, and those refused at some values.

Every key of EasyR1's ``PPOConfig`` is either mapped by :mod:`vlm_grpo.convert_config`, listed in
:data:`IGNORED` (it tunes EasyR1's own engines: FSDP, offloading, vLLM, Ray; training means the same without it),
or listed in :data:`REFUSED_UNLESS` (ignorable at the values given there; any other value changes what is trained,
so the conversion stops with an error unless ``--accept_easyr1_differences`` is passed). A key in none of them is
unknown (EasyR1 itself refuses it too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_FSDP = "FSDP sharding/precision of EasyR1's workers; here DeepSpeed/FSDP come from --deepspeed / --fsdp"
_OFFLOAD = "CPU offloading of EasyR1's FSDP workers (memory only); here DeepSpeed's offload settings"
_VLLM = "a setting of EasyR1's vLLM rollout engine; generation here runs in the training process"
_SPEED = "a speed/memory setting of EasyR1's actor; the loss is the same without it"

#: dotted key (or ``prefix.*``) -> why it has no effect here
IGNORED: dict[str, str] = {
    "data.mini_rollout_batch_size": "generation chunk size of EasyR1's online filtering; dynamic_sampling "
    "generates one generation batch per round",
    "data.val_batch_size": "evaluation batch size (speed only); evaluation runs per_device_eval_batch_size rows",
    "data.filter_overlong_prompts_workers": "worker processes of EasyR1's prompt-length filter",
    "algorithm.lam": "GAE's lambda; GAE is not available",
    "algorithm.kl_type": "the KL controller of the KL-in-reward penalty, which is not available (see use_kl_loss)",
    "algorithm.kl_horizon": "the adaptive KL controller of the KL-in-reward penalty (not available)",
    "algorithm.kl_target": "the adaptive KL controller of the KL-in-reward penalty (not available)",
    "worker.hybrid_engine": "EasyR1's colocated actor/rollout engine; one process does both here",
    "worker.actor.strategy": _FSDP,
    "worker.actor.micro_batch_size_per_device_for_experience": "micro-batch of EasyR1's log-prob passes (memory only)",
    "worker.actor.padding_free": _SPEED,
    "worker.actor.dynamic_batching": _SPEED,
    "worker.actor.ulysses_size": "Ulysses sequence parallelism of EasyR1's actor (memory/speed only)",
    "worker.actor.use_torch_compile": _SPEED,
    "worker.actor.fsdp.*": _FSDP,
    "worker.actor.offload.*": _OFFLOAD,
    "worker.actor.optim.strategy": "adamw (torch AdamW here) or adamw_bf16 (bf16 optimizer states: memory only)",
    "worker.ref.*": "the reference model's sharding/offloading (memory only); the reference is the initial policy",
    "worker.critic.*": "the value model, used only by GAE (not available)",
    "worker.rollout.name": _VLLM,
    "worker.rollout.seed": "vLLM's sampling seed; sampling here is seeded by data.seed",
    "worker.rollout.limit_images": _VLLM,
    "worker.rollout.dtype": _VLLM,
    "worker.rollout.gpu_memory_utilization": _VLLM,
    "worker.rollout.enforce_eager": _VLLM,
    "worker.rollout.enable_chunked_prefill": _VLLM,
    "worker.rollout.tensor_parallel_size": _VLLM,
    "worker.rollout.max_model_len": _VLLM,
    "worker.rollout.max_num_batched_tokens": _VLLM,
    "worker.rollout.disable_log_stats": _VLLM,
    "worker.rollout.disable_tqdm": _VLLM,
    "worker.rollout.val_override_config.temperature": "sampling temperature of evaluation only (TRL evaluates "
    "with the training temperature)",
    "worker.rollout.val_override_config.top_p": "top_p of evaluation only (TRL evaluates with the training top_p)",
    "worker.reward.reward_type": "older EasyR1 versions' reward kind; the kind is read from the function itself",
    "worker.reward.skip_special_tokens": "completions reach rewards decoded without special tokens, as EasyR1's "
    "default",
    "worker.reward.num_cpus": "Ray CPUs of EasyR1's reward worker",
    "trainer.val_generations_to_log": "how many evaluation samples EasyR1 prints (logging only)",
    "trainer.ray_timeline": "Ray profiling output",
    "trainer.critic_warmup": "steps of critic-only training, for GAE (not available)",
    "worker.actor.tau_positive": "SAPO's temperature, used only by loss_type sapo (refused)",
    "worker.actor.tau_negative": "SAPO's temperature, used only by loss_type sapo (refused)",
    "trainer.save_model_only": "what a checkpoint holds (disk only); checkpoints here always hold the optimizer "
    "state so that runs resume",
}


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value in values


#: dotted key -> (values that are fine to ignore, why any other value cannot be honoured)
REFUSED_UNLESS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "data.override_chat_template": (_is(None, ""), "a chat template other than the model's changes every prompt"),
    "worker.actor.clip_ratio_dual": (
        _is(3.0, 3),
        "TRL's loss has no dual clip; at EasyR1's default (3.0) it bounds only negative-advantage tokens whose "
        "probability ratio exceeds 3 (rare with one policy update per rollout), other values are not honoured",
    ),
    "worker.actor.model.override_config": (_is(None, {}), "model config overrides are not applied"),
    "worker.actor.model.tokenizer_path": (_is(None), "the tokenizer/processor is the model's own (model_path)"),
    "worker.actor.optim.min_lr_ratio": (_is(None), "a floor on the learning rate schedule is not applied"),
    "worker.rollout.ignore_eos": (_is(False), "generation always stops at the end-of-sequence token"),
    "trainer.val_only": (_is(False), "evaluation-only runs: use vlm-grpo-eval"),
}


def ignore_reason(key: str) -> str | None:
    """Why ``key`` has no effect here (None: it is not listed as ignored)."""
    if key in IGNORED:
        return IGNORED[key]
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        reason = IGNORED.get(".".join(parts[:i]) + ".*")
        if reason:
            return reason
    return None
