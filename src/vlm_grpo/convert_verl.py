"""verl's ``python3 -m verl.trainer.main_ppo key=value ...`` -> a vlm-grpo ``--config`` YAML.

    vlm-grpo-convert-config verl algorithm.adv_estimator=grpo data.train_files=train.parquet ... -o rl.yaml
    vlm-grpo --config rl.yaml
    vlm-grpo algorithm.adv_estimator=grpo actor_rollout_ref.model.path=... [--flag value ...]   # the same, directly

The words before the first ``key=value`` (``python3 -m verl.trainer.main_ppo``) may be pasted along; they are
skipped. Keys left out take verl's defaults (:data:`VERL_DEFAULTS`, those of ``ppo_trainer.yaml``), so the
converted run means what the line meant under verl, not what TRL's defaults would make of it.

Batch sizes keep verl's meaning. One verl step generates ``data.train_batch_size`` prompts x
``actor_rollout_ref.rollout.n`` completions; the actor then makes one optimizer step per
``ppo_mini_batch_size`` prompts (x n completions, over ``trainer.nnodes x trainer.n_gpus_per_node`` processes),
in micro-batches of ``ppo_micro_batch_size_per_gpu`` completions, ``ppo_epochs`` times over the batch. In TRL's
words: ``per_device_train_batch_size`` = micro, ``gradient_accumulation_steps`` = mini x n / (world x micro),
``steps_per_generation`` = train_batch_size x n / (world x micro), ``num_generations`` = n, ``num_iterations`` =
ppo_epochs. A verl step is ``train_batch_size / ppo_mini_batch_size x ppo_epochs`` optimizer steps, so step counts
(``total_training_steps``, ``save_freq``, ``test_freq``, ``lr_warmup_steps``) are multiplied by that.

A key whose meaning cannot be kept is an error naming it; keys that only place work (FSDP, offload, the rollout
engine, parallel sizes, profiling) are listed as ignored at the top of the YAML and on stderr.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import yaml

from vlm_grpo.cli_errors import UserError
from vlm_grpo.config_words import override_value, write_converted

logger = logging.getLogger(__name__)

ACTOR = "actor_rollout_ref.actor."
ROLLOUT = "actor_rollout_ref.rollout."
MODEL = "actor_rollout_ref.model."

#: verl's defaults (verl/trainer/config/ppo_trainer.yaml) for every key whose value changes training here.
VERL_DEFAULTS: dict[str, Any] = {
    "algorithm.adv_estimator": "gae",
    "algorithm.norm_adv_by_std_in_grpo": True,
    "algorithm.use_kl_in_reward": False,
    "data.train_batch_size": 1024,
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "data.shuffle": True,
    "data.truncation": "error",
    "data.filter_overlong_prompts": False,
    MODEL + "enable_gradient_checkpointing": True,
    MODEL + "lora_rank": 0,
    MODEL + "lora_alpha": 16,
    MODEL + "target_modules": "all-linear",
    ACTOR + "ppo_mini_batch_size": 256,
    ACTOR + "ppo_epochs": 1,
    ACTOR + "clip_ratio": 0.2,
    ACTOR + "loss_agg_mode": "token-mean",
    ACTOR + "entropy_coeff": 0,
    ACTOR + "use_kl_loss": False,
    ACTOR + "kl_loss_coef": 0.001,
    ACTOR + "kl_loss_type": "low_var_kl",
    ACTOR + "policy_loss.loss_mode": "vanilla",
    ACTOR + "grad_clip": 1.0,
    ACTOR + "optim.lr": 1e-6,
    ACTOR + "optim.weight_decay": 0.01,
    ACTOR + "optim.betas": [0.9, 0.999],
    ACTOR + "optim.lr_warmup_steps_ratio": 0.0,
    ACTOR + "optim.lr_warmup_steps": -1,
    ACTOR + "optim.lr_scheduler_type": "constant",
    ACTOR + "optim.min_lr_ratio": 0.0,
    ROLLOUT + "n": 1,
    ROLLOUT + "temperature": 1.0,
    ROLLOUT + "top_p": 1.0,
    ROLLOUT + "top_k": -1,
    ROLLOUT + "do_sample": True,
    "trainer.total_epochs": 30,
    "trainer.nnodes": 1,
    "trainer.n_gpus_per_node": 8,
    "trainer.save_freq": -1,
    "trainer.test_freq": -1,
    "trainer.project_name": "verl_examples",
    "trainer.experiment_name": "gsm8k",
    "trainer.logger": ["console", "wandb"],
    "trainer.val_only": False,
    "reward_model.enable": False,
}

#: verl key -> vlm-grpo flag, value as it is
DIRECT = {
    "data.max_prompt_length": "max_prompt_length",
    "data.prompt_key": "prompt_key",
    "data.image_key": "image_key",
    "data.video_key": "video_key",
    "data.shuffle": "shuffle_dataset",
    "data.seed": "seed",
    MODEL + "path": "model_name_or_path",
    MODEL + "enable_gradient_checkpointing": "gradient_checkpointing",
    MODEL + "trust_remote_code": "trust_remote_code",
    ACTOR + "optim.lr": "learning_rate",
    ACTOR + "optim.weight_decay": "weight_decay",
    ACTOR + "ppo_epochs": "num_iterations",
    ACTOR + "freeze_vision_tower": "freeze_vision_modules",
    ROLLOUT + "n": "num_generations",
    ROLLOUT + "temperature": "temperature",
    ROLLOUT + "top_p": "top_p",
    "trainer.total_epochs": "num_train_epochs",
    "trainer.experiment_name": "run_name",
    "trainer.max_actor_ckpt_to_keep": "save_total_limit",
}

#: keys (or key prefixes, ending in '.') that only place or speed up work: ignored, with the reason
IGNORED = {
    ACTOR + "fsdp_config.": "FSDP sharding / offload: use --deepspeed for the same memory placement",
    "actor_rollout_ref.ref.": "the reference model's placement and micro-batches: memory and speed only",
    ACTOR + "ppo_max_token_len_per_gpu": "token budget of dynamic micro-batches: memory and speed only",
    ACTOR + "use_dynamic_bsz": "token-packed micro-batches: memory and speed only (the loss is the same)",
    ACTOR + "ulysses_sequence_parallel_size": "sequence parallelism: placement only",
    ACTOR + "shuffle": "order of mini-batches within a verl step",
    ACTOR + "data_loader_seed": "order of mini-batches within a verl step",
    ACTOR + "use_torch_compile": "speed only",
    ACTOR + "checkpoint.": "checkpoints here hold the model, optimizer and trainer state",
    ACTOR + "strategy": "placement only",
    ACTOR + "profiler.": "profiling",
    ACTOR + "optim.clip_grad": "read as grad_clip",
    MODEL + "use_remove_padding": "padding-free attention: speed only",
    MODEL + "use_fused_kernels": "speed only",
    MODEL + "use_liger": "speed only",
    MODEL + "enable_activation_offload": "memory only",
    MODEL + "use_shm": "loading only",
    "critic.": "no critic: GRPO-family estimators need none",
    "data.val_batch_size": "evaluation batching; evaluation here runs n completions per device at a time",
    "data.dataloader_num_workers": "loading speed only",
    "data.return_raw_chat": "verl's dataset internals",
    "data.return_raw_input_ids": "verl's dataset internals",
    "data.filter_overlong_prompts_workers": "loading speed only",
    "data.reward_fn_key": "verl's reward manager routing; name the reward with --reward_funcs",
    "trainer.val_before_train": "validation only; with trainer.test_freq > 0 it is eval_on_start",
    "trainer.log_val_generations": "validation logging",
    "trainer.balance_batch": "load balancing across GPUs: speed only",
    "trainer.critic_warmup": "no critic",
    "trainer.device": "the device follows torchrun / CUDA_VISIBLE_DEVICES",
    "trainer.default_hdfs_dir": "HDFS upload",
    "trainer.del_local_ckpt_after_load": "checkpoint housekeeping",
    "trainer.resume_mode": "resuming follows --resume_from_checkpoint (see the resume rules)",
    "trainer.ray_wait_register_center_timeout": "no Ray here",
    "trainer.esi_redundant_time": "no Ray here",
    "trainer.use_legacy_worker_impl": "verl internals",
    "ray_kwargs.": "no Ray here",
    "ray_init.": "no Ray here",
    "global_profiler.": "profiling",
    "transfer_queue.": "verl internals",
    "algorithm.gamma": "GAE only",
    "algorithm.lam": "GAE only",
    "algorithm.kl_ctrl.": "KL in the reward is off (algorithm.use_kl_in_reward=False)",
    "algorithm.kl_penalty": "KL in the reward is off (algorithm.use_kl_in_reward=False)",
    "actor_rollout_ref.hybrid_engine": "placement only",
    "actor_rollout_ref.nccl_timeout": "NCCL timeout: set --ddp_timeout",
}
#: rollout keys that only choose or tune the generation engine (the sampled distribution is unchanged)
ROLLOUT_ENGINE = {
    "name", "mode", "gpu_memory_utilization", "tensor_model_parallel_size", "data_parallel_size",
    "expert_parallel_size", "pipeline_model_parallel_size", "enforce_eager", "free_cache_engine", "load_format",
    "dtype", "max_num_batched_tokens", "max_model_len", "max_num_seqs", "enable_chunked_prefill",
    "enable_prefix_caching", "log_prob_micro_batch_size", "log_prob_micro_batch_size_per_gpu",
    "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu", "disable_log_stats", "prompt_length",
    "engine_kwargs", "cudagraph_capture_sizes", "layered_summon", "multi_stage_wake_up", "calculate_log_probs",
    "skip_tokenizer_init", "val_kwargs", "agent", "checkpoint_engine", "trace", "profiler", "prometheus",
    "scheduling_policy", "logprobs_mode", "over_sample_rate",
}  # fmt: skip
LOSS_AGG = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}
ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "remax")
LOGGERS = {"wandb": "wandb", "tensorboard": "tensorboard", "swanlab": "swanlab", "mlflow": "mlflow"}
LAUNCHER_WORDS = {"python", "python3", "-m", "verl.trainer.main_ppo", "main_ppo"}


class VerlConfigError(UserError, ValueError):
    """A main_ppo line whose meaning cannot be kept."""


def parse_overrides(tokens: Sequence[str]) -> dict[str, Any]:
    """``key=value`` words as Hydra reads them (values as YAML: ``8``, ``True``, ``[a,b]``, ``null``);
    ``+key`` / ``++key`` add or force a key, which is the same here."""
    out: dict[str, Any] = {}
    started = False
    for token in tokens:
        if token.startswith("~"):
            raise VerlConfigError(f"{token}: deleting a key has no meaning here; leave the key out")
        if "=" not in token:
            if not started and (token in LAUNCHER_WORDS or token.endswith(("python", "python3"))):
                continue
            raise VerlConfigError(f"{token!r}: expected key=value (a verl override such as data.train_batch_size=128)")
        started = True
        key, _, raw = token.partition("=")
        key = key.lstrip("+")
        value = _value(raw)
        if key in out and out[key] != value:
            raise VerlConfigError(f"{key} is given twice ({out[key]!r} and {value!r}); keep one")
        out[key] = value
    return out


def _value(raw: str) -> Any:
    """A value as Hydra reads it (``key=`` is null)."""
    return None if raw == "" else override_value(raw)


def _ignored_reason(key: str) -> str | None:
    for prefix, why in IGNORED.items():
        if key == prefix or (prefix.endswith(".") and key.startswith(prefix)):
            return why
    if key.startswith(ROLLOUT) and key[len(ROLLOUT) :].split(".")[0] in ROLLOUT_ENGINE:
        return "generation engine settings: the sampled distribution is the same"
    return None


def _int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
        raise VerlConfigError(f"{key}={value!r}: expected a whole number")
    return int(value)


def batch_sizes(cfg: dict[str, Any]) -> tuple[dict[str, Any], int, str]:
    """TRL's batch flags for verl's sizes, the optimizer steps per verl step, and a note saying how."""
    world = _int("trainer.nnodes", cfg["trainer.nnodes"]) * _int(
        "trainer.n_gpus_per_node", cfg["trainer.n_gpus_per_node"]
    )
    prompts = _int("data.train_batch_size", cfg["data.train_batch_size"])
    mini = _int(ACTOR + "ppo_mini_batch_size", cfg[ACTOR + "ppo_mini_batch_size"])
    n = _int(ROLLOUT + "n", cfg[ROLLOUT + "n"])
    epochs = _int(ACTOR + "ppo_epochs", cfg[ACTOR + "ppo_epochs"])
    micro = cfg.get(ACTOR + "ppo_micro_batch_size_per_gpu")
    if micro is None and cfg.get(ACTOR + "ppo_micro_batch_size") is not None:
        micro = _int(ACTOR + "ppo_micro_batch_size", cfg[ACTOR + "ppo_micro_batch_size"]) // world
    if micro is None:
        raise VerlConfigError(
            f"{ACTOR}ppo_micro_batch_size_per_gpu is not set: give it (completions per forward pass on one GPU)"
        )
    micro = _int(ACTOR + "ppo_micro_batch_size_per_gpu", micro)
    if min(world, prompts, mini, n, epochs, micro) < 1:
        raise VerlConfigError("batch sizes, rollout.n, ppo_epochs and the GPU count must be at least 1")
    if prompts % mini:
        raise VerlConfigError(
            f"data.train_batch_size={prompts} is not a multiple of {ACTOR}ppo_mini_batch_size={mini}: "
            "every optimizer step must see the same number of prompts"
        )
    if (mini * n) % world:
        raise VerlConfigError(
            f"ppo_mini_batch_size x rollout.n = {mini * n} completions do not split over {world} GPUs"
        )
    per_gpu = mini * n // world
    if per_gpu % micro:
        raise VerlConfigError(
            f"{per_gpu} completions per GPU per optimizer step (ppo_mini_batch_size x n / GPUs) are not a multiple "
            f"of ppo_micro_batch_size_per_gpu={micro}"
        )
    accumulation = per_gpu // micro
    flags = {
        "num_generations": n,
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": accumulation,
        "steps_per_generation": prompts * n // (world * micro),
        "num_iterations": epochs,
        "per_device_eval_batch_size": n,
    }
    updates = prompts // mini * epochs
    note = (
        f"batch: {prompts} prompts x n={n} per verl step over {world} GPU(s); an optimizer step every {mini} "
        f"prompts in micro-batches of {micro}; {epochs} epoch(s) -> per_device_train_batch_size {micro}, "
        f"gradient_accumulation_steps {accumulation}, steps_per_generation {flags['steps_per_generation']}, "
        f"num_iterations {epochs}: {updates} optimizer step(s) per verl step (run it with torchrun --nnodes "
        f"{cfg['trainer.nnodes']} --nproc_per_node {cfg['trainer.n_gpus_per_node']})"
    )
    return flags, updates, note


def convert(overrides: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(vlm-grpo flags, notes) for a main_ppo line's overrides; VerlConfigError for what cannot be kept."""
    cfg = {**VERL_DEFAULTS, **overrides}
    out: dict[str, Any] = {}
    notes: list[str] = []
    errors: list[str] = []
    used: set[str] = set(VERL_DEFAULTS)

    def get(key: str) -> Any:
        used.add(key)
        return cfg.get(key)

    def refuse(key: str, why: str) -> None:
        errors.append(f"{key}={cfg.get(key)!r}: {why}")

    for key, flag in DIRECT.items():
        if get(key) is not None:
            out[flag] = cfg[key]
    for key, flag in (("data.train_files", "data_file_paths"), ("data.val_files", "eval_file_paths")):
        value = get(key)
        if value is not None:
            out[flag] = ":".join(map(str, value)) if isinstance(value, list) else str(value)

    flags, updates, note = batch_sizes(cfg)
    out.update(flags)
    notes.append(note)
    used.update(ACTOR + k for k in ("ppo_micro_batch_size_per_gpu", "ppo_micro_batch_size"))

    response = get(ROLLOUT + "response_length")
    out["max_completion_length"] = _int("data.max_response_length", response or cfg["data.max_response_length"])
    top_k = _int(ROLLOUT + "top_k", cfg[ROLLOUT + "top_k"])
    out["top_k"] = 0 if top_k < 0 else top_k  # verl's -1 and TRL's 0 both mean "no top-k"
    if not cfg[ROLLOUT + "do_sample"]:
        refuse(ROLLOUT + "do_sample", "GRPO needs sampled completions; leave it True")

    # the algorithm
    estimator = cfg["algorithm.adv_estimator"]
    if estimator == "gae":
        refuse(
            "algorithm.adv_estimator",
            "GAE needs a critic model, which is not trained here (verl's default when the key is left out); pass "
            "algorithm.adv_estimator=grpo (or rloo / reinforce_plus_plus / remax)",
        )
    elif estimator not in ESTIMATORS:
        refuse("algorithm.adv_estimator", f"not one of {', '.join(ESTIMATORS)}")
    elif estimator != "grpo":
        out["advantage_estimator"] = estimator
    out["scale_rewards"] = "group" if cfg["algorithm.norm_adv_by_std_in_grpo"] else "none"
    if cfg["algorithm.use_kl_in_reward"]:
        refuse("algorithm.use_kl_in_reward", "a KL penalty inside the reward is not supported; use actor.use_kl_loss")
    if cfg["reward_model.enable"]:
        refuse("reward_model.enable", "a learned reward model is not supported; serve it and use a remote reward")
    if get("custom_reward_function.path"):
        refuse(
            "custom_reward_function.path",
            "verl's compute_score(data_source, solution_str, ground_truth, extra_info) is not a reward function "
            "here; pass --reward_funcs with a function taking (completions, solution, **kwargs) (see the rewards "
            "guide)",
        )
    used.add("custom_reward_function.name")
    if cfg["trainer.val_only"]:
        refuse("trainer.val_only", "use vlm-grpo-eval to only evaluate")

    # the actor's loss
    agg = cfg[ACTOR + "loss_agg_mode"]
    if agg in LOSS_AGG:
        out["loss_type"] = LOSS_AGG[agg]
    else:
        refuse(ACTOR + "loss_agg_mode", f"no TRL loss aggregates this way; one of {', '.join(LOSS_AGG)}")
    if cfg[ACTOR + "policy_loss.loss_mode"] != "vanilla":
        refuse(ACTOR + "policy_loss.loss_mode", "only verl's vanilla (PPO-clip) policy loss is supported")
    if cfg[ACTOR + "entropy_coeff"]:
        refuse(ACTOR + "entropy_coeff", "TRL's GRPO loss has no entropy bonus; set it to 0")
    low = get(ACTOR + "clip_ratio_low")
    high = get(ACTOR + "clip_ratio_high")
    out["epsilon"] = float(low if low is not None else cfg[ACTOR + "clip_ratio"])
    out["epsilon_high"] = float(high if high is not None else cfg[ACTOR + "clip_ratio"])
    if get(ACTOR + "clip_ratio_c") is not None:
        refuse(ACTOR + "clip_ratio_c", "TRL's loss has no dual-clip bound; leave the key out")
    if cfg[ACTOR + "use_kl_loss"]:
        if cfg[ACTOR + "kl_loss_type"] not in ("low_var_kl", "k3"):
            refuse(ACTOR + "kl_loss_type", "TRL's KL term is k3 (low_var_kl); pass that")
        out["beta"] = float(cfg[ACTOR + "kl_loss_coef"])
    else:
        out["beta"] = 0.0
    out["max_grad_norm"] = float(get(ACTOR + "optim.clip_grad") or cfg[ACTOR + "grad_clip"])

    # the optimizer's schedule: verl steps it once per verl step; here once per optimizer step
    betas = cfg[ACTOR + "optim.betas"]
    out["adam_beta1"], out["adam_beta2"] = float(betas[0]), float(betas[1])
    scheduler = get(ACTOR + "optim.warmup_style") or cfg[ACTOR + "optim.lr_scheduler_type"]
    warmup_steps = _int(ACTOR + "optim.lr_warmup_steps", cfg[ACTOR + "optim.lr_warmup_steps"])
    ratio = float(cfg[ACTOR + "optim.lr_warmup_steps_ratio"])
    warm = warmup_steps > 0 or ratio > 0
    if warmup_steps > 0:
        out["warmup_steps"] = warmup_steps * updates
    elif ratio > 0:
        out["warmup_steps"] = ratio  # transformers reads a float in [0, 1) as a ratio of the total steps
    min_ratio = float(cfg[ACTOR + "optim.min_lr_ratio"])
    if scheduler == "constant":
        out["lr_scheduler_type"] = "constant_with_warmup" if warm else "constant"
    elif scheduler == "cosine":
        out["lr_scheduler_type"] = "cosine_with_min_lr" if min_ratio else "cosine"
        if min_ratio:
            out["lr_scheduler_kwargs"] = {"min_lr_rate": min_ratio}
        cycles = get(ACTOR + "optim.num_cycles")
        if cycles not in (None, 0.5):
            refuse(ACTOR + "optim.num_cycles", "only the half cosine (0.5) is supported")
    else:
        refuse(ACTOR + "optim.lr_scheduler_type", "only constant and cosine are supported")
    for key in ("optim.total_training_steps", "optim.optimizer", "optim.optimizer_impl"):
        value = get(ACTOR + key)
        if key == "optim.optimizer" and value not in (None, "AdamW"):
            refuse(ACTOR + key, "the optimizer here is AdamW (--optim adamw_torch)")

    # LoRA
    rank = _int(MODEL + "lora_rank", cfg[MODEL + "lora_rank"])
    if rank > 0:
        out.update(use_peft=True, lora_r=rank, lora_alpha=_int(MODEL + "lora_alpha", cfg[MODEL + "lora_alpha"]))
        targets = cfg[MODEL + "target_modules"]
        out["lora_target_modules"] = targets if isinstance(targets, list) else [targets]

    # data
    if cfg["data.filter_overlong_prompts"]:
        out["skip_bad_rows"] = True
        notes.append("data.filter_overlong_prompts -> skip_bad_rows: every bad row is skipped and counted")
    if cfg["data.truncation"] != "error":
        refuse("data.truncation", "prompts are never truncated here; use data.filter_overlong_prompts=True")

    # the trainer: verl counts steps in verl steps (one generation batch each)
    steps = get("trainer.total_training_steps")
    if steps is not None:
        out["max_steps"] = _int("trainer.total_training_steps", steps) * updates
    save = _int("trainer.save_freq", cfg["trainer.save_freq"])
    if save > 0:
        out["save_strategy"], out["save_steps"] = "steps", save * updates
    else:
        out["save_strategy"] = "no"
    test = _int("trainer.test_freq", cfg["trainer.test_freq"])
    if test > 0 and "eval_file_paths" in out:
        out["eval_strategy"], out["eval_steps"] = "steps", test * updates
        out["eval_on_start"] = bool(cfg.get("trainer.val_before_train", True))
        used.add("trainer.val_before_train")
    elif "eval_file_paths" in out:
        notes.append("data.val_files without trainer.test_freq > 0: the evaluation set is not used")
        del out["eval_file_paths"]
    loggers = cfg["trainer.logger"]
    loggers = [loggers] if isinstance(loggers, str) else list(loggers or [])
    out["report_to"] = [LOGGERS[name] for name in loggers if name in LOGGERS] or "none"
    for name in loggers:
        if name not in LOGGERS and name != "console":
            notes.append(f"trainer.logger '{name}': no equivalent (metrics stay in trainer_state.json)")
    project = cfg["trainer.project_name"]
    notes.append(f"trainer.project_name={project}: set WANDB_PROJECT={project} in the environment")
    out["output_dir"] = str(
        get("trainer.default_local_dir") or f"checkpoints/{project}/{cfg['trainer.experiment_name']}"
    )
    resume = get("trainer.resume_from_path")
    if resume:
        out["resume_from_checkpoint"] = str(resume)

    unknown = []
    for key in overrides:
        if key in used:
            continue
        why = _ignored_reason(key)
        if why is None:
            unknown.append(key)
        else:
            notes.append(f"ignored: {key}={overrides[key]!r} ({why})")
    if unknown:
        errors.append(
            "no translation for " + ", ".join(unknown) + " (the verl guide's table lists every key that is read)"
        )
    if errors:
        raise VerlConfigError("; ".join(errors))
    return out, notes


_OVERRIDE = re.compile(r"^\+{0,2}[A-Za-z_][\w]*(?:\.[\w]+)+=")
#: sections only verl has (EasyR1's overrides share data. / algorithm. / trainer. but not these)
VERL_SECTIONS = ("actor_rollout_ref.", "critic.", "reward_model.", "custom_reward_function.")


def verl_overrides_argv(argv: Sequence[str]) -> list[str]:
    """A training command line holding verl ``key=value`` overrides (recognised by a key of a verl-only section,
    e.g. ``actor_rollout_ref.model.path=...``): those words converted to a temporary ``--config`` YAML (each note
    logged), the ``--flags`` kept after it so they win. Any other command line is returned unchanged."""
    argv = list(argv)
    words = [w for w in argv if _OVERRIDE.match(w)]
    if not any(w.lstrip("+").startswith(VERL_SECTIONS) for w in words):
        return argv
    if any(a == "--config" or a.startswith("--config=") for a in argv):
        raise VerlConfigError("verl key=value overrides and --config both configure the run; pass one of them")
    flags, notes = convert(parse_overrides(words))
    for note in notes:
        logger.warning("verl overrides: %s", note)
    handle = tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="verl_", delete=False, encoding="utf-8")
    with handle:
        handle.write(render(flags, notes))
    return ["--config", handle.name, *(a for a in argv if not _OVERRIDE.match(a))]


def render(flags: dict[str, Any], notes: Sequence[str]) -> str:
    header = ["# vlm-grpo config converted from a verl main_ppo command line"] + [f"# {n}" for n in notes]
    return "\n".join(header) + "\n" + yaml.safe_dump(flags, sort_keys=False, allow_unicode=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vlm-grpo-convert-config verl", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    parser.add_argument("overrides", nargs="*", help="main_ppo's key=value words, as on its command line")
    parser.add_argument("-o", "--output", help="write the vlm-grpo YAML here (default: stdout)")
    words = list(sys.argv[2:] if argv is None else argv)
    while words and (words[0] in LAUNCHER_WORDS or words[0].endswith(("python", "python3"))):
        words.pop(0)  # the pasted launcher: python3 -m verl.trainer.main_ppo
    args = parser.parse_args(words)
    if not args.overrides:
        parser.error("give main_ppo's key=value words")
    try:
        flags, notes = convert(parse_overrides(args.overrides))
    except VerlConfigError as exc:
        print(f"error: verl main_ppo line: {exc}", file=sys.stderr)
        return 2
    return write_converted(render(flags, notes), args.output, notes)
