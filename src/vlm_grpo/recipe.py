"""Steps the GRPO and SFT recipes share: pick the model family's module, load and check the rows, load the model."""

from __future__ import annotations

import logging
from typing import Any

from vlm_grpo.configs import GRPOScriptArguments, VLMModelConfig
from vlm_grpo.data import prepare_rows, split_paths, to_datasets
from vlm_grpo.data.sources import ColumnKeys, read_sources
from vlm_grpo.data.video import VideoOptions
from vlm_grpo.modules import ImageLimits, VLMModule, get_vlm_module

logger = logging.getLogger("vlm_grpo")


def pick_module(model_args: VLMModelConfig, trust_remote_code: bool = False) -> tuple[VLMModule, Any]:
    """The adapter (from ``config.json``'s ``model_type`` or ``--vlm_module``) and its processor."""
    if not model_args.model_name_or_path:
        raise ValueError("--model_name_or_path is required")
    module = get_vlm_module(
        model_args.model_name_or_path,
        model_args.vlm_module,
        ImageLimits(model_args.min_pixels, model_args.max_pixels, model_args.max_anyres_num),
        revision=model_args.model_revision,
    )
    processor = module.load_processor(
        model_args.model_name_or_path, trust_remote_code=trust_remote_code, revision=model_args.model_revision
    )
    logger.info("VLM module: %s (%s)", module.name, type(module).__name__)
    return module, processor


def load_checked_rows(
    script_args: GRPOScriptArguments, module: VLMModule, processor: Any, data_file_paths: str | None = None
) -> list[dict]:
    """Every row read and checked (file:line errors, or counted skips with ``--skip_bad_rows``);
    ``data_file_paths`` (e.g. the evaluation files) replaces ``--data_file_paths``."""
    keys = ColumnKeys(
        getattr(script_args, "prompt_key", None),
        getattr(script_args, "answer_key", None),
        getattr(script_args, "image_key", None),
        getattr(script_args, "video_key", None),
    )
    folders = script_args.image_folders
    if data_file_paths and len(split_paths(folders)) > 1:
        folders = None  # one folder per training file: the evaluation files use their own folders
    rows, bad_rows = read_sources(
        data_file_paths or script_args.data_file_paths,
        folders,
        keys=keys,
        reward_method=script_args.reward_method,
        task_type=script_args.task_type,
        format_prompt=getattr(script_args, "format_prompt", None),
        video=VideoOptions(
            getattr(script_args, "video_fps", 2.0),
            getattr(script_args, "video_max_frames", 16),
            getattr(script_args, "video_max_pixels", None),
        ),
    )
    return prepare_rows(
        rows,
        bad_rows,
        module,
        processor,
        max_prompt_length=script_args.max_prompt_length,
        skip_bad_rows=script_args.skip_bad_rows,
    )


def load_model(module: VLMModule, model_args: VLMModelConfig, trust_remote_code: bool = False) -> Any:
    """The model to train, loaded by its family's adapter with the user's dtype, attention and revision."""
    return module.load_model(
        model_args.model_name_or_path,
        dtype=model_args.dtype,
        attn_implementation=model_args.attn_implementation,
        trust_remote_code=trust_remote_code,
        revision=model_args.model_revision,
    )


def load_datasets(script_args: GRPOScriptArguments, module: VLMModule, processor: Any, seed: int) -> tuple[Any, Any]:
    """(train, eval or None) datasets: eval from ``--eval_file_paths`` or a ``--val_split_ratio`` hold-out."""
    rows = load_checked_rows(script_args, module, processor)
    eval_files = getattr(script_args, "eval_file_paths", None)
    if not eval_files:
        return to_datasets(rows, module, script_args.val_split_ratio, seed)
    if script_args.val_split_ratio:
        raise ValueError("--eval_file_paths and --val_split_ratio both set: pick one source of evaluation rows")
    eval_rows = load_checked_rows(script_args, module, processor, data_file_paths=eval_files)
    return to_datasets(rows, module)[0], to_datasets(eval_rows, module)[0]


class LoggerUnavailableError(ValueError):
    """``--report_to`` names an integration whose package is not installed."""


#: --report_to name -> what to install (the vlm-grpo extra where there is one)
_LOGGER_PACKAGES = {"tensorboard": "vlm-grpo[tensorboard]", "wandb": "vlm-grpo[wandb]", "swanlab": "swanlab"}


def check_report_to(report_to: Any) -> None:
    """Refuse, before anything loads, a ``--report_to`` integration that is not installed (transformers would
    only fail once the model is loaded and the trainer built)."""
    from transformers.integrations import get_available_reporting_integrations

    requested = [report_to] if isinstance(report_to, str) else list(report_to or [])
    available = set(get_available_reporting_integrations())
    missing = [name for name in requested if name not in ("none", "all") and name not in available]
    if missing:
        hints = ", ".join(f"{name}: pip install '{_LOGGER_PACKAGES.get(name, name)}'" for name in missing)
        raise LoggerUnavailableError(
            f"--report_to {' '.join(missing)}: not installed ({hints}); or drop it from --report_to"
        )


def finish_loggers(report_to: Any) -> None:
    """Close the wandb run at the end of ``main`` so its files are complete when ``main`` returns (a script's
    exit would do it; a notebook or a test calling ``main`` would otherwise read a half-written run)."""
    if "wandb" in (report_to or []):
        import wandb

        if wandb.run is not None:
            wandb.finish()
        wandb.teardown()  # stops wandb's service process, which writes the run files out
