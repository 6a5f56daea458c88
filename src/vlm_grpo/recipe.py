"""Steps the GRPO and SFT recipes share: pick the model family's module, load and check the rows, load the model."""

from __future__ import annotations

import logging
from typing import Any

from vlm_grpo.configs import GRPOScriptArguments, VLMModelConfig
from vlm_grpo.data import prepare_rows
from vlm_grpo.data.records import read_any_rows
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


def load_checked_rows(script_args: GRPOScriptArguments, module: VLMModule, processor: Any) -> list[dict]:
    """Every row read and checked (file:line errors, or counted skips with ``--skip_bad_rows``)."""
    rows, bad_rows = read_any_rows(
        script_args.data_file_paths,
        script_args.image_folders,
        reward_method=script_args.reward_method,
        task_type=script_args.task_type,
        max_pixels=module.limits.max_pixels,  # images over the pixel limit are bad rows, as in the data check
    )
    return prepare_rows(
        rows,
        bad_rows,
        module,
        processor,
        max_prompt_length=script_args.max_prompt_length,
        mm_max_length=script_args.mm_max_length,
        skip_bad_rows=script_args.skip_bad_rows,
    )


def wrap_solutions(rows: list[dict]) -> None:
    """``--vlmr1_solution_tags``: solutions as VLM-R1's loader hands them to rewards, ``<answer> s </answer>``."""
    for row in rows:
        solution = row.get("solution")
        if isinstance(solution, str) and "<answer>" not in solution:
            row["solution"] = f"<answer> {solution} </answer>"


def load_model(module: VLMModule, model_args: VLMModelConfig, trust_remote_code: bool = False) -> Any:
    """The model to train, loaded by its family's adapter with the user's dtype, attention and revision."""
    return module.load_model(
        model_args.model_name_or_path,
        dtype=model_args.dtype,
        attn_implementation=model_args.attn_implementation,
        trust_remote_code=trust_remote_code,
        revision=model_args.model_revision,
    )
