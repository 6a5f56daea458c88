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
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

logger = logging.getLogger(__name__)

EASYR1_SECTIONS = ("data", "algorithm", "worker", "trainer")

#: EasyR1 dotted key -> vlm-grpo flag, for the one-to-one fields
DIRECT = {
    "data.train_files": "data_file_paths",
    "data.val_files": "eval_file_paths",
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
    "worker.actor.model.model_path": "model_name_or_path",
    "worker.actor.model.enable_gradient_checkpointing": "gradient_checkpointing",
    "worker.actor.model.trust_remote_code": "trust_remote_code",
    "worker.actor.model.freeze_vision_tower": "freeze_vision_modules",
    "worker.actor.optim.lr": "learning_rate",
    "worker.actor.optim.weight_decay": "weight_decay",
    "worker.actor.optim.lr_warmup_ratio": "warmup_ratio",
    "worker.rollout.n": "num_generations",
    "worker.rollout.temperature": "temperature",
    "worker.rollout.top_p": "top_p",
    "worker.rollout.top_k": "top_k",
    "trainer.total_epochs": "num_train_epochs",
    "trainer.max_steps": "max_steps",
    "trainer.experiment_name": "run_name",
    "trainer.save_limit": "save_total_limit",
    "trainer.val_before_train": "eval_on_start",
    "trainer.load_checkpoint_path": "resume_from_checkpoint",
    "trainer.save_checkpoint_path": "output_dir",
}
LOGGERS = {"wandb": "wandb", "tensorboard": "tensorboard", "swanlab": "swanlab", "mlflow": "mlflow"}


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
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def _paths(value: Any) -> str:
    return ":".join(value) if isinstance(value, list) else str(value)


def convert(config: dict) -> tuple[dict[str, Any], list[str]]:
    """(vlm-grpo flags, notes on what was ignored or changed) for an EasyR1 config."""
    if not is_easyr1_config(config):
        raise ConfigError(f"not an EasyR1 config: expected top-level sections among {', '.join(EASYR1_SECTIONS)}")
    flat = _flatten(config)
    out: dict[str, Any] = {}
    notes: list[str] = []
    used: set[str] = set()

    def take(key: str, default: Any = None) -> Any:
        used.add(key)
        return flat.get(key, default)

    for key, flag in DIRECT.items():
        value = take(key)
        if value is not None:
            out[flag] = _paths(value) if flag in ("data_file_paths", "eval_file_paths") else value

    # batch sizes: prompts per rollout / per optimizer step (EasyR1) -> rows per device and micro-steps (TRL)
    n = int(out.get("num_generations", take("worker.rollout.n") or 8))
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
    # KL: EasyR1 adds it as a loss term (use_kl_loss) with kl_coef, k3 ("low_var_kl") as TRL does
    disable_kl, use_kl_loss, kl_coef = (
        take("algorithm.disable_kl"),
        take("algorithm.use_kl_loss"),
        take("algorithm.kl_coef"),
    )
    penalty = take("algorithm.kl_penalty")
    out["beta"] = 0.0 if disable_kl or use_kl_loss is False else float(kl_coef or 0.0)
    if penalty not in (None, "low_var_kl"):
        notes.append(f"algorithm.kl_penalty={penalty}: TRL's KL is k3 (low_var_kl); used that")
    estimator = take("algorithm.adv_estimator")
    if estimator not in (None, "grpo"):
        notes.append(f"algorithm.adv_estimator={estimator}: only GRPO advantages here; used grpo")
    avg = take("worker.actor.loss_avg_mode")
    if avg is not None:
        out["loss_type"] = {"token": "dapo", "seq": "grpo"}.get(avg, "dapo")
    tries = take("trainer.max_try_make_batch")
    if tries is not None:
        if tries > 0:
            out["max_sampling_rounds"] = int(tries)
        else:
            notes.append("trainer.max_try_make_batch<=0 (unlimited): kept max_sampling_rounds' default")
    if take("data.filter_overlong_prompts"):
        out["skip_bad_rows"] = True
        notes.append(
            "data.filter_overlong_prompts -> skip_bad_rows: every bad row is skipped and counted, not only long ones"
        )

    reward, reward_kwargs = take("worker.reward.reward_function"), take("worker.reward.reward_function_kwargs")
    if reward:
        spec = reward if ":" in str(reward) else f"{reward}:main"  # EasyR1's default function name
        out["reward_funcs"] = [spec]
        if reward_kwargs:
            out["reward_kwargs"] = {spec: reward_kwargs}
    take("worker.reward.reward_type")

    loggers = take("trainer.logger") or []
    loggers = [loggers] if isinstance(loggers, str) else list(loggers)
    kept = [LOGGERS[name] for name in loggers if name in LOGGERS]
    out["report_to"] = kept or "none"
    for name in loggers:
        if name not in LOGGERS:
            notes.append(f"trainer.logger '{name}': no equivalent (metrics stay in trainer_state.json / the console)")
    project = take("trainer.project_name")
    if project:
        notes.append(f"trainer.project_name={project}: set WANDB_PROJECT={project} in the environment")
    if "output_dir" not in out:
        out["output_dir"] = f"checkpoints/{project or 'easy_r1'}/{out.get('run_name', 'run')}"
    save_freq = take("trainer.save_freq")
    if save_freq and save_freq > 0:
        out["save_strategy"], out["save_steps"] = "steps", int(save_freq)
    val_freq = take("trainer.val_freq")
    if val_freq and val_freq > 0 and "eval_file_paths" in out:
        out["eval_strategy"], out["eval_steps"] = "steps", int(val_freq)
    if take("trainer.find_last_checkpoint") and "resume_from_checkpoint" not in out:
        notes.append(
            "trainer.find_last_checkpoint: pass --resume_from_checkpoint true to continue a run (see the resume rules)"
        )

    ignored = [f"{key}={value!r}" for key, value in flat.items() if key not in used and value is not None]
    notes += [f"ignored (no equivalent): {item}" for item in ignored]
    return out, notes


def convert_file(path: str | Path) -> tuple[dict[str, Any], list[str]]:
    try:
        config = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read the config: {exc}") from exc
    return convert(config)


def render(flags: dict[str, Any], notes: Sequence[str], source: str) -> str:
    header = [f"# vlm-grpo config converted from the EasyR1 config {source}"] + [f"# {note}" for note in notes]
    return "\n".join(header) + "\n" + yaml.safe_dump(flags, sort_keys=False, allow_unicode=True)


def easyr1_config_argv(argv: Sequence[str]) -> list[str]:
    """``--config easyr1.yaml`` on the training command line: converted to a temporary vlm-grpo YAML (each
    note logged); any other ``--config`` passes through unchanged."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            index, path = i + 1, argv[i + 1]
        elif arg.startswith("--config="):
            index, path = i, arg.split("=", 1)[1]
        else:
            continue
        try:
            config = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            return argv  # TrlParser reports it
        if not is_easyr1_config(config):
            return argv
        flags, notes = convert(config)
        for note in notes:
            logger.warning("EasyR1 config %s: %s", path, note)
        handle = tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="easyr1_", delete=False, encoding="utf-8")
        with handle:
            handle.write(render(flags, notes, path))
        argv[index] = handle.name if index != i else f"--config={handle.name}"
        return argv
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["verl"]:  # vlm-grpo-convert-config verl key=value ...: a verl main_ppo line
        from vlm_grpo.convert_verl import main as verl_main

        return verl_main(argv[1:])
    parser = argparse.ArgumentParser(prog="vlm-grpo-convert-config", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="EasyR1 YAML (data / algorithm / worker / trainer)")
    parser.add_argument("-o", "--output", help="write the vlm-grpo YAML here (default: stdout)")
    args = parser.parse_args(argv)
    try:
        flags, notes = convert_file(args.config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = render(flags, notes, args.config)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return 0


def cli() -> None:
    sys.exit(main())
