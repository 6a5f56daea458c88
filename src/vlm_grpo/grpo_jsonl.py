"""GRPO on image-path JSONL data.

    torchrun --nproc_per_node N src/vlm_grpo/grpo_jsonl.py --config configs/demo.yaml [--flag value ...]
    python -m vlm_grpo.grpo_jsonl ...     |     vlm-grpo ...

Reads top to bottom: parse -> resolve resume -> pick module -> load data -> load model ->
build rewards -> train -> report.
"""

from __future__ import annotations

import logging
import math
import sys
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vlm_grpo.help_cache import answer_help
from vlm_grpo.utils import start_process

if TYPE_CHECKING:
    from vlm_grpo.configs import GRPOScriptArguments, VLMGRPOConfig, VLMModelConfig
    from vlm_grpo.trainer import VLMGRPOTrainer

logger = logging.getLogger("vlm_grpo")


def parse_args(argv: Sequence[str] | None = None) -> tuple[GRPOScriptArguments, VLMGRPOConfig, VLMModelConfig]:
    from vlm_grpo.cli_parser import VLMParser
    from vlm_grpo.configs import GRPOScriptArguments, VLMGRPOConfig, VLMModelConfig
    from vlm_grpo.convert_verl import verl_overrides_argv
    from vlm_grpo.easyr1_args import easyr1_argv
    from vlm_grpo.utils import quiet_warnings

    quiet_warnings()  # before parsing: TrainingArguments warns about its own flag names there
    parser = VLMParser((GRPOScriptArguments, VLMGRPOConfig, VLMModelConfig))
    argv = verl_overrides_argv(sys.argv[1:] if argv is None else argv)  # verl main_ppo key=value words
    argv = easyr1_argv(argv)  # EasyR1's config=x.yaml a.b=c / --config
    script_args, training_args, model_args = parser.parse_args_and_config(args=argv)
    return script_args, training_args, model_args


def reward_means(log_history: list[dict]) -> dict[str, float]:
    """Mean over the run of each logged ``rewards/<name>/mean``."""
    values: dict[str, list[float]] = defaultdict(list)
    for entry in log_history:
        for key, value in entry.items():
            if key.startswith("rewards/") and key.endswith("/mean") and isinstance(value, (int, float)):
                if math.isfinite(value):  # a step where no sample had this reward logs NaN/None
                    values[key.split("/")[1]].append(value)
    return {name: sum(v) / len(v) for name, v in values.items()}


def main(script_args: GRPOScriptArguments, training_args: VLMGRPOConfig, model_args: VLMModelConfig) -> VLMGRPOTrainer:
    # Imported here, not at the top: `--help` needs none of it (see vlm_grpo.help_cache).
    import torch
    from tqdm.contrib.logging import logging_redirect_tqdm
    from trl import get_peft_config

    from vlm_grpo.plot import finish_run
    from vlm_grpo.recipe import (
        check_sharded_settings,
        evaluates,
        finish_loggers,
        load_datasets,
        load_model,
        pick_module,
        preflight,
        resolve_run,
        start_fresh_run,
    )
    from vlm_grpo.rewards import build_reward_funcs
    from vlm_grpo.tools.rollouts import check_tool_flags
    from vlm_grpo.trainer import VLMGRPOTrainer
    from vlm_grpo.trainer_common import log_metrics_to_logger
    from vlm_grpo.utils import quiet_warnings

    is_main = training_args.process_index == 0
    logging.basicConfig(
        level=logging.INFO if is_main else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    quiet_warnings()
    preflight(script_args, training_args)
    check_sharded_settings(training_args)
    resume = resolve_run(script_args, training_args)

    check_tool_flags(script_args)  # unknown tool or protocol, bad option, no sandbox: say so before loading
    module, processor = pick_module(model_args, training_args.trust_remote_code)
    overrides = module.reward_overrides if script_args.is_reward_customized_from_vlm_module else None
    reward_funcs = build_reward_funcs(
        script_args.reward_funcs,
        overrides,
        script_args.reward_kwargs,
        script_args.reward_max_failed_batches,
        processing_class=processor,
        seed_aliases=script_args.reward_aliases,
    )

    train_dataset, eval_dataset = load_datasets(
        script_args, module, processor, training_args.seed, evaluates(training_args)
    )
    logger.info("Data: %d training rows, %d evaluation rows", len(train_dataset), len(eval_dataset or []))

    model = load_model(module, model_args, training_args.trust_remote_code)

    trainer = VLMGRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        vlm_module=module,
        freeze_vision_modules=model_args.freeze_vision_modules,
        lora_include_vision=model_args.lora_include_vision,
        processing_class=processor,
        peft_config=get_peft_config(model_args),
        tools=script_args.tools,
        tool_kwargs=script_args.tool_kwargs,
        tool_protocol=script_args.tool_protocol,
        max_turn_tokens=script_args.max_turn_tokens,
        max_tool_images=script_args.max_tool_images,
        max_context_tokens=script_args.max_context_tokens,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
    )
    log_metrics_to_logger(trainer)
    start_fresh_run(script_args, training_args, resume)
    with logging_redirect_tqdm():  # log lines above the progress bar, not through it
        trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(training_args.output_dir)
    finish_loggers(training_args.report_to)
    finish_run(trainer, training_args.output_dir, script_args.plot)
    if is_main:
        means = reward_means(trainer.state.log_history)
        summary = ", ".join(f"{name}={value:.3f}" for name, value in sorted(means.items()))
        logger.info("Finished at step %d. Mean rewards over the run: %s", trainer.state.global_step, summary or "n/a")
        print(f"[vlm-grpo] step {trainer.state.global_step}; mean rewards: {summary or 'n/a'}", flush=True)
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 2**30
        print(f"[vlm-grpo] rank {training_args.process_index}: peak GPU memory {peak:.1f} GiB", flush=True)
    return trainer


def cli(argv: Sequence[str] | None = None) -> None:
    if answer_help(argv, parse_args):
        return
    start_process()
    from vlm_grpo.recipe import run_command  # after the help: recipes import the heavy modules

    run_command(lambda args: main(*parse_args(args)), argv)


if __name__ == "__main__":
    cli(sys.argv[1:])
