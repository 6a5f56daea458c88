"""EasyR1 YAML (nested ``data`` / ``algorithm`` / ``worker`` / ``trainer``) -> a vlm-grpo ``--config`` YAML.

    vlm-grpo-convert-config easyr1.yaml -o vlm_grpo.yaml      # the fields it ignored are listed on stderr
    vlm-grpo --config easyr1.yaml                             # the same conversion, on the fly

Fields with an equivalent are mapped; the rest (FSDP, offload, vLLM, Ulysses, padding-free, ...) are
listed as ignored, each with its value, at the top of the written YAML and on stderr. Batch sizes follow
EasyR1's meaning: ``data.rollout_batch_size`` prompts are generated per rollout and
``worker.actor.global_batch_size`` prompts make one optimizer step, over ``nnodes x n_gpus_per_node``
processes, in micro-batches of ``micro_batch_size_per_device_for_update`` rows.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from vlm_grpo.config_words import override_value, write_converted, yaml_problem
from vlm_grpo.easyr1_keys import REFUSED_UNLESS, ignore_reason

logger = logging.getLogger(__name__)

EASYR1_SECTIONS = ("data", "algorithm", "worker", "trainer")

#: EasyR1 dotted key -> vlm-grpo flag, for the one-to-one fields
DIRECT = {
    "data.train_files": "data_file_paths",
    "data.prompt_key": "prompt_key",
    "data.answer_key": "answer_key",
    "data.image_key": "image_key",
    "data.video_key": "video_key",
    "data.video_fps": "video_fps",
    "data.image_dir": "image_folders",
    "data.max_prompt_length": "max_prompt_length",
    "data.max_response_length": "max_completion_length",
    "data.format_prompt": "format_prompt",
    "data.shuffle": "shuffle_dataset",
    "data.seed": "seed",
    "data.min_pixels": "min_pixels",
    "data.max_pixels": "max_pixels",
    "algorithm.online_filtering": "dynamic_sampling",
    "algorithm.filter_key": "filter_key",
    "algorithm.filter_low": "filter_low",
    "algorithm.filter_high": "filter_high",
    "worker.actor.max_grad_norm": "max_grad_norm",
    "worker.actor.clip_ratio_low": "epsilon",
    "worker.actor.clip_ratio_high": "epsilon_high",
    "worker.actor.ppo_epochs": "num_iterations",
    "worker.actor.model.model_path": "model_name_or_path",
    "worker.actor.model.enable_gradient_checkpointing": "gradient_checkpointing",
    "worker.actor.model.trust_remote_code": "trust_remote_code",
    "worker.actor.model.freeze_vision_tower": "freeze_vision_modules",
    "worker.actor.optim.lr": "learning_rate",
    "worker.actor.optim.weight_decay": "weight_decay",
    "worker.rollout.n": "num_generations",
    "worker.rollout.temperature": "temperature",
    "worker.rollout.top_p": "top_p",
    "worker.rollout.val_override_config.n": "num_generations_eval",
    "trainer.total_epochs": "num_train_epochs",
    "trainer.max_steps": "max_steps",
    "trainer.experiment_name": "run_name",
    "trainer.save_limit": "save_total_limit",
    "trainer.load_checkpoint_path": "resume_from_checkpoint",
    "trainer.save_checkpoint_path": "output_dir",
}
#: EasyR1's defaults where they decide what is trained (a key left out of the YAML means these)
DEFAULTS = {
    "algorithm.adv_estimator": "grpo",
    "algorithm.gamma": 1.0,
    "algorithm.disable_kl": False,
    "algorithm.use_kl_loss": False,
    "algorithm.kl_penalty": "kl",
    "algorithm.kl_coef": 1e-3,
    "algorithm.filter_key": "overall",
    "worker.actor.clip_ratio_low": 0.2,
    "worker.actor.clip_ratio_high": 0.3,
    "worker.actor.loss_avg_mode": "token",
    "worker.actor.loss_type": "default",
    "worker.actor.optim.lr_scheduler_type": "constant",
    "worker.rollout.n": 1,
}
#: values kept as one leaf (mappings of the user's own), not split into dotted keys
LEAF_DICTS = ("worker.reward.reward_function_kwargs", "worker.actor.model.override_config")
LOGGERS = {"wandb": "wandb", "tensorboard": "tensorboard", "swanlab": "swanlab", "mlflow": "mlflow"}
ESTIMATORS = {name: name for name in ("grpo", "rloo", "reinforce_plus_plus", "remax")}
SCHEDULERS = {"constant": "constant_with_warmup", "cosine": "cosine", "linear": "linear"}


class ConfigError(ValueError):
    """An EasyR1 config this converter cannot read."""


def is_easyr1_config(config: Any) -> bool:
    """A mapping whose top level is EasyR1's sections (and nothing else)."""
    return (
        isinstance(config, dict)
        and bool(config)
        and set(config) <= set(EASYR1_SECTIONS)
        and all(isinstance(v, dict) for v in config.values())
    )


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value and dotted not in LEAF_DICTS:
            flat.update(_flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def _paths(value: Any) -> str:
    return ":".join(value) if isinstance(value, list) else str(value)


def convert(config: dict, accept_differences: bool = False) -> tuple[dict[str, Any], list[str]]:
    """(vlm-grpo flags, notes on what was ignored or changed) for an EasyR1 config.

    A setting that would train differently here raises :class:`ConfigError` naming every such key, unless
    ``accept_differences`` (then each is a note); GAE and ReMax always raise."""
    if not is_easyr1_config(config):
        raise ConfigError(f"not an EasyR1 config: expected top-level sections among {', '.join(EASYR1_SECTIONS)}")
    given = _flatten(config)
    flat = {**DEFAULTS, **{k: v for k, v in given.items() if v is not None}}  # null: EasyR1's "not set"
    out: dict[str, Any] = {}
    notes: list[str] = []
    refused: list[str] = []
    used: set[str] = set()

    def take(key: str, default: Any = None) -> Any:
        used.add(key)
        return flat.get(key, default)

    for key, flag in DIRECT.items():
        value = take(key)
        if value is not None:
            out[flag] = _paths(value) if flag == "data_file_paths" else value
    if take("worker.rollout.top_k") not in (None, -1, 0):
        out["top_k"] = int(flat["worker.rollout.top_k"])
    _convert_batches(out, notes, take)
    _convert_algorithm(out, refused, take)
    _convert_optimizer(out, refused, take)
    _convert_lora(out, refused, take)
    _convert_trainer(out, notes, take)

    reward, reward_kwargs = take("worker.reward.reward_function"), take("worker.reward.reward_function_kwargs")
    if reward:
        spec = reward if ":" in str(reward) else f"{reward}:main"  # EasyR1's default function name
        out["reward_funcs"] = [spec]
        if reward_kwargs:
            out["reward_kwargs"] = {spec: dict(reward_kwargs)}
    if flat.get("worker.actor.model.tokenizer_path") == flat.get("worker.actor.model.model_path"):
        take("worker.actor.model.tokenizer_path")  # the model's own tokenizer, named twice

    for key, value in given.items():
        if key in used or key in DEFAULTS:
            continue
        if value is None and (key in REFUSED_UNLESS or ignore_reason(key)):
            continue
        if key in REFUSED_UNLESS:
            fine, why = REFUSED_UNLESS[key]
            if not fine(value):
                refused.append(f"{key}={value!r}: {why}")
                continue
            notes.append(f"ignored: {key}={value!r} (at this value it changes nothing here)")
            continue
        reason = ignore_reason(key)
        if reason is None:
            raise ConfigError(f"unknown EasyR1 key {key}={value!r}: EasyR1 has no such key (a typo?)")
        notes.append(f"ignored: {key}={value!r} ({reason})")
    if refused and not accept_differences:
        raise ConfigError(
            "these settings would train differently here: "
            + "; ".join(refused)
            + ". Change them, or pass --accept_easyr1_differences to train without them"
        )
    notes += [f"accepted difference: {item}" for item in refused]
    return out, notes


def _convert_batches(out: dict[str, Any], notes: list[str], take: Any) -> None:
    """Prompts per rollout / per optimizer step (EasyR1) -> rows per device and micro-steps (TRL)."""
    n = int(out.get("num_generations", 1))
    world = int(take("trainer.nnodes") or 1) * int(take("trainer.n_gpus_per_node") or 1)
    rollout, update = take("data.rollout_batch_size"), take("worker.actor.global_batch_size")
    micro = take("worker.actor.micro_batch_size_per_device_for_update")
    update = update or rollout
    if update:
        rows_per_device = update * n // world
        if (update * n) % world:
            notes.append(f"global_batch_size x n = {update * n} rows do not split over {world} processes; rounded")
        micro = micro if micro and rows_per_device % micro == 0 else rows_per_device
        out["per_device_train_batch_size"] = micro
        out["gradient_accumulation_steps"] = max(1, rows_per_device // micro)
        updates_per_rollout = max(1, (rollout or update) // update)
        out["steps_per_generation"] = out["gradient_accumulation_steps"] * updates_per_rollout
        notes.append(
            f"batch: {rollout or update} prompts x n={n} per rollout over {world} process(es) -> "
            f"per_device_train_batch_size {micro}, gradient_accumulation_steps "
            f"{out['gradient_accumulation_steps']}, steps_per_generation {out['steps_per_generation']} "
            f"(run it with torchrun --nproc_per_node {take('trainer.n_gpus_per_node') or 1})"
        )
    out["per_device_eval_batch_size"] = n  # TRL evaluates whole groups: one prompt's n samples per device
    if take("data.filter_overlong_prompts"):
        out["skip_bad_rows"] = True
        notes.append(
            "data.filter_overlong_prompts -> skip_bad_rows: every bad row is skipped and counted, not only long ones"
        )


def _convert_algorithm(out: dict[str, Any], refused: list[str], take: Any) -> None:
    """Advantage estimator, KL, loss: EasyR1's KL as a loss term (use_kl_loss, k3 = low_var_kl) is TRL's beta."""
    from vlm_grpo.advantages import REFUSED  # here: the converter's command line needs no torch otherwise

    estimator = take("algorithm.adv_estimator")
    if estimator in REFUSED:
        raise ConfigError(f"algorithm.adv_estimator={estimator}: {REFUSED[estimator]}")
    if estimator not in ESTIMATORS:
        raise ConfigError(f"algorithm.adv_estimator={estimator}: unknown; use one of {', '.join(ESTIMATORS)}")
    out["advantage_estimator"] = ESTIMATORS[estimator]
    gamma = take("algorithm.gamma")
    if estimator == "reinforce_plus_plus" and float(gamma) != 1.0:
        refused.append(f"algorithm.gamma={gamma}: REINFORCE++ here takes the undiscounted outcome reward (gamma 1)")
    disable_kl, use_kl_loss = take("algorithm.disable_kl"), take("algorithm.use_kl_loss")
    kl_coef, penalty = float(take("algorithm.kl_coef")), take("algorithm.kl_penalty")
    if disable_kl or kl_coef == 0.0:
        out["beta"] = 0.0
    elif use_kl_loss:
        out["beta"] = kl_coef
        if penalty != "low_var_kl":
            refused.append(f"algorithm.kl_penalty={penalty}: the KL loss term here is k3 (low_var_kl)")
    else:
        out["beta"] = 0.0
        refused.append(
            f"algorithm.use_kl_loss=false with kl_coef={kl_coef}: a KL penalty inside the reward is not available; "
            "set algorithm.use_kl_loss=true (KL as a loss term, kl_penalty=low_var_kl) or algorithm.disable_kl=true"
        )
    avg, loss_type = take("worker.actor.loss_avg_mode"), take("worker.actor.loss_type")
    out["loss_type"] = {"token": "dapo", "seq": "grpo"}.get(avg, "dapo")
    if avg not in ("token", "seq"):
        refused.append(f"worker.actor.loss_avg_mode={avg}: use token or seq")
    if loss_type == "gspo":
        out["importance_sampling_level"] = "sequence"
    elif loss_type != "default":
        refused.append(f"worker.actor.loss_type={loss_type}: use default or gspo (TRL's cispo/sapo differ)")
    tries = take("trainer.max_try_make_batch")
    if tries is not None:
        out["max_sampling_rounds"] = int(tries) if tries > 0 else 1_000_000  # -1: no limit


def _convert_optimizer(out: dict[str, Any], refused: list[str], take: Any) -> None:
    """Betas, the scheduler (EasyR1's default is constant) and warmup (transformers' warmup_steps takes a ratio)."""
    betas = take("worker.actor.optim.betas")
    if betas is not None:
        out["adam_beta1"], out["adam_beta2"] = (float(b) for b in betas)
    scheduler = take("worker.actor.optim.lr_scheduler_type")
    if scheduler in SCHEDULERS:
        out["lr_scheduler_type"] = SCHEDULERS[scheduler]
    else:
        refused.append(f"worker.actor.optim.lr_scheduler_type={scheduler}: use one of {', '.join(SCHEDULERS)}")
    steps, ratio = take("worker.actor.optim.lr_warmup_steps"), take("worker.actor.optim.lr_warmup_ratio")
    if steps is not None and steps > 0:
        out["warmup_steps"] = int(steps)
    elif ratio:
        if not 0.0 <= float(ratio) < 1.0:
            raise ConfigError(f"worker.actor.optim.lr_warmup_ratio={ratio}: a fraction of the steps in [0, 1)")
        out["warmup_steps"] = float(ratio)  # transformers reads a value below 1 as a ratio of the total steps


def _convert_lora(out: dict[str, Any], refused: list[str], take: Any) -> None:
    rank, alpha = take("worker.actor.model.lora.rank"), take("worker.actor.model.lora.alpha")
    targets, exclude = take("worker.actor.model.lora.target_modules"), take("worker.actor.model.lora.exclude_modules")
    if not rank:
        return
    out.update(use_peft=True, lora_r=int(rank), lora_alpha=int(alpha or 64))
    if targets and targets != "all-linear":
        out["lora_target_modules"] = [t.strip() for t in str(targets).split(",")]
    elif targets:
        out["lora_target_modules"] = "all-linear"
    if exclude not in (None, ".*visual.*"):
        refused.append(f"worker.actor.model.lora.exclude_modules={exclude}: the vision tower is always excluded "
                       "(--lora_include_vision puts it in); other exclusions are not available")  # fmt: skip


def _convert_trainer(out: dict[str, Any], notes: list[str], take: Any) -> None:
    """Loggers, output folder, checkpoint and evaluation cadence."""
    loggers = take("trainer.logger") or []
    loggers = [loggers] if isinstance(loggers, str) else list(loggers)
    kept = [LOGGERS[name] for name in loggers if name in LOGGERS]
    out["report_to"] = kept or "none"
    for name in loggers:
        if name not in LOGGERS:
            notes.append(f"trainer.logger '{name}': no equivalent (metrics stay in trainer_state.json / the console)")
    project = take("trainer.project_name")
    if project:
        notes.append(f"trainer.project_name={project}: WANDB_PROJECT={project} (unless set in the environment)")
    if "output_dir" not in out:
        out["output_dir"] = f"checkpoints/{project or 'easy_r1'}/{out.get('run_name', 'run')}"
    save_freq = take("trainer.save_freq")
    if save_freq and save_freq > 0:
        out["save_strategy"], out["save_steps"] = "steps", int(save_freq)
    val_files, val_freq = take("data.val_files"), take("trainer.val_freq")
    before = take("trainer.val_before_train")
    if val_files and ((val_freq and val_freq > 0) or before):
        out["eval_file_paths"] = _paths(val_files)
        if val_freq and val_freq > 0:
            out["eval_strategy"], out["eval_steps"] = "steps", int(val_freq)
        else:  # before training only: evaluate once, at step 0, with a period longer than any run
            out["eval_strategy"], out["eval_steps"] = "steps", 10**9
        out["eval_on_start"] = bool(before)
    elif val_files:
        notes.append(f"data.val_files={val_files}: not loaded (trainer.val_freq <= 0 and no val_before_train)")
    if take("trainer.find_last_checkpoint") and "resume_from_checkpoint" not in out:
        notes.append(
            "trainer.find_last_checkpoint: pass --resume_from_checkpoint true to continue a run (see the resume rules)"
        )


def apply_override(config: dict, dotted: str, value: Any) -> None:
    node = config
    *parents, leaf = dotted.split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}={value!r}: '{part}' holds a value, not a section")
        node = child
    node[leaf] = value


def render(flags: dict[str, Any], notes: Sequence[str], source: str) -> str:
    header = [f"# vlm-grpo config converted from the EasyR1 config {source}"] + [f"# {note}" for note in notes]
    return "\n".join(header) + "\n" + yaml.safe_dump(flags, sort_keys=False, allow_unicode=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["verl"]:  # vlm-grpo-convert-config verl key=value ...: a verl main_ppo line
        from vlm_grpo.convert_verl import main as verl_main

        return verl_main(argv[1:])
    parser = argparse.ArgumentParser(prog="vlm-grpo-convert-config", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="EasyR1 YAML (data / algorithm / worker / trainer)")
    parser.add_argument("overrides", nargs="*", help="EasyR1 overrides section.key=value, as its scripts pass them")
    parser.add_argument("-o", "--output", help="write the vlm-grpo YAML here (default: stdout)")
    parser.add_argument(
        "--accept_easyr1_differences",
        action="store_true",
        help="convert settings that would train differently here (each listed as a note) instead of refusing",
    )
    args = parser.parse_args(argv)
    try:
        config = yaml.safe_load(Path(args.config).read_text(encoding="utf-8"))
        for item in args.overrides:
            key, _, text = item.partition("=")
            if not text and "=" not in item:
                raise ConfigError(f"override {item!r}: write section.key=value")
            apply_override(config, key, override_value(text))
        flags, notes = convert(config, accept_differences=args.accept_easyr1_differences)
    except yaml.YAMLError as exc:
        print(f"error: {args.config}: not valid YAML: {yaml_problem(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {args.config}: cannot read the config: {exc}", file=sys.stderr)
        return 2
    except (ConfigError, ValueError) as exc:
        print(f"error: {args.config}: {exc}", file=sys.stderr)
        return 2
    return write_converted(render(flags, notes, " ".join([args.config, *args.overrides])), args.output, notes)


def cli() -> None:
    sys.exit(main())
