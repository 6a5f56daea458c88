"""SFT (the chain-of-thought stage before GRPO) on the same rows, modules and options as ``grpo_jsonl.py``.

    torchrun --nproc_per_node N src/vlm_grpo/sft_jsonl.py --config configs/sft_demo.yaml [--flag value ...]
    python -m vlm_grpo.sft_jsonl ...     |     vlm-grpo-sft ...

Reads top to bottom like the GRPO recipe: parse -> resolve resume -> pick module -> load data -> load
model -> train -> save. Each row is trained as its GRPO prompt (system, question template, images where
the ``<image>`` markers stand) answered by its solution; the loss is on the assistant's tokens only.
The output directory is a ``--model_name_or_path`` for GRPO (with LoRA: the merged model; the adapter
goes to ``output_dir/adapter``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vlm_grpo.help_cache import answer_help
from vlm_grpo.utils import start_process

if TYPE_CHECKING:
    from vlm_grpo.configs import GRPOScriptArguments, VLMModelConfig
    from vlm_grpo.sft_trainer import VLMSFTConfig, VLMSFTTrainer

logger = logging.getLogger("vlm_grpo")


def parse_args(argv: Sequence[str] | None = None) -> tuple[GRPOScriptArguments, VLMSFTConfig, VLMModelConfig]:
    from vlm_grpo.cli_parser import VLMParser
    from vlm_grpo.configs import GRPOScriptArguments, VLMModelConfig
    from vlm_grpo.sft_trainer import VLMSFTConfig
    from vlm_grpo.utils import quiet_warnings

    quiet_warnings()  # before parsing: TrainingArguments warns about its own flag names there
    parser = VLMParser((GRPOScriptArguments, VLMSFTConfig, VLMModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config(args=argv)
    return script_args, training_args, model_args


def main(script_args: GRPOScriptArguments, training_args: VLMSFTConfig, model_args: VLMModelConfig) -> VLMSFTTrainer:
    from tqdm.contrib.logging import logging_redirect_tqdm

    from vlm_grpo.plot import finish_run
    from vlm_grpo.recipe import start_fresh_run
    from vlm_grpo.trainer_common import log_metrics_to_logger
    from vlm_grpo.utils import quiet_warnings

    is_main = training_args.process_index == 0
    logging.basicConfig(
        level=logging.INFO if is_main else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    quiet_warnings()
    trainer, resume = build_trainer(script_args, training_args, model_args)
    log_metrics_to_logger(trainer)
    start_fresh_run(script_args, training_args, resume)
    with logging_redirect_tqdm():  # log lines above the progress bar, not through it
        trainer.train(resume_from_checkpoint=resume)
    save_final_model(trainer, training_args, model_args.model_name_or_path)
    finish_run(trainer, training_args.output_dir, script_args.plot)
    if is_main:
        summary = loss_summary(trainer.state.log_history, training_args)
        print(f"[vlm-grpo-sft] step {trainer.state.global_step}; {summary}; model in {training_args.output_dir}")
    return trainer


def loss_summary(log_history: list[dict[str, Any]], args: Any) -> str:
    """First and last logged loss; a run shorter than ``logging_steps`` logs none, but its mean (train_loss)."""
    losses = [e["loss"] for e in log_history if "loss" in e]
    if losses:
        return f"first loss {losses[0]:.4f}, last loss {losses[-1]:.4f}"
    mean = next((e["train_loss"] for e in reversed(log_history) if "train_loss" in e), None)
    if mean is None:
        return "no loss logged"
    return f"mean loss {mean:.4f} (no step logged its own: logging_steps={args.logging_steps})"


def build_trainer(
    script_args: GRPOScriptArguments, training_args: VLMSFTConfig, model_args: VLMModelConfig
) -> tuple[VLMSFTTrainer, str | None]:
    """Everything before ``train()``: the trainer and the checkpoint to resume from (None: a fresh run)."""
    # Imported here, not at the top: `--help` needs none of it (see vlm_grpo.help_cache).
    from vlm_grpo.recipe import evaluates, load_datasets, load_model, pick_module, preflight, resolve_run
    from vlm_grpo.sft_trainer import SFTTransform, assistant_masks_supported

    check_tool_flags(script_args)
    refuse_reward_flags(script_args)
    preflight(script_args, training_args)
    resume = resolve_run(script_args, training_args)

    module, processor = pick_module(model_args, training_args.trust_remote_code)
    train_dataset, eval_dataset = load_datasets(
        script_args, module, processor, training_args.seed, evaluates(training_args)
    )
    if script_args.tools:
        return build_tool_trainer(script_args, training_args, model_args, module, processor, train_dataset,
                                  eval_dataset), resume  # fmt: skip

    # Loss on the assistant's tokens: from the template's generation markers, or else prompt/completion rows.
    prompt_completion = training_args.assistant_only_loss and not assistant_masks_supported(processor)
    if prompt_completion:
        logger.info(
            "No assistant-token mask from this chat template/processor: prompt/completion rows, loss on the completion"
        )
        training_args.assistant_only_loss = False
        training_args.completion_only_loss = True
    transform = SFTTransform(module, prompt_completion=prompt_completion)
    train_dataset = train_dataset.with_transform(transform)
    eval_dataset = eval_dataset.with_transform(transform) if eval_dataset is not None else None
    logger.info("Data: %d training rows, %d evaluation rows", len(train_dataset), len(eval_dataset or []))

    model = load_model(module, model_args, training_args.trust_remote_code)
    return make_trainer(model, training_args, model_args, module, processor, train_dataset, eval_dataset), resume


def make_trainer(
    model: Any,
    training_args: VLMSFTConfig,
    model_args: VLMModelConfig,
    module: Any,
    processor: Any,
    train_dataset: Any,
    eval_dataset: Any,
    **extra: Any,
) -> VLMSFTTrainer:
    """The SFT trainer around a loaded model (``extra``: e.g. a ``data_collator``)."""
    from trl import get_peft_config

    from vlm_grpo.sft_trainer import VLMSFTTrainer

    return VLMSFTTrainer(
        model=model,
        args=training_args,
        vlm_module=module,
        freeze_vision_modules=model_args.freeze_vision_modules,
        lora_include_vision=model_args.lora_include_vision,
        processing_class=processor,
        peft_config=get_peft_config(model_args),
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        **extra,
    )


def check_tool_flags(script_args: GRPOScriptArguments) -> None:
    """``--tools`` (with ``--tool_kwargs``, ``--tool_protocol``) trains on whole tool rollouts; the generation
    budgets of GRPO's tool loop mean nothing without generation, and tool flags need ``--tools``: errors."""
    from vlm_grpo.cli_errors import UserError

    budgets = [f"--{name}" for name in _TOOL_BUDGETS if getattr(script_args, name) is not None]
    if budgets:
        raise UserError(
            f"{', '.join(budgets)}: vlm-grpo-sft generates nothing, so the tool loop's generation budgets do not "
            "apply; drop these flags (the rows' assistant_turns are trained as written)"
        )
    given = [f"--{name}" for name in ("tool_kwargs", "tool_protocol") if getattr(script_args, name) not in (None, "")]
    if given and not script_args.tools:
        raise UserError(f"{', '.join(given)} without --tools: name the tools the rows call, e.g. --tools zoom_in")
    if script_args.tools:
        from vlm_grpo.tools.rollouts import check_tool_flags as check_run_tool_flags

        check_run_tool_flags(script_args)  # unknown tool or protocol, a bad option: before any model loads


def build_tool_trainer(
    script_args: GRPOScriptArguments,
    training_args: VLMSFTConfig,
    model_args: VLMModelConfig,
    module: Any,
    processor: Any,
    train_dataset: Any,
    eval_dataset: Any,
) -> VLMSFTTrainer:
    """The trainer for ``--tools``: rows replayed as the GRPO run's tool rollouts (:mod:`vlm_grpo.sft_tools`)."""

    from vlm_grpo.cli_errors import UserError
    from vlm_grpo.recipe import load_model
    from vlm_grpo.sft_tools import ToolRolloutCollator, tool_rollout_dataset, type_key

    if training_args.max_length is not None or not training_args.assistant_only_loss:
        given = "--max_length" if training_args.max_length is not None else "--assistant_only_loss false"
        raise UserError(
            f"{given} with --tools: a tool rollout is trained whole (its images' tokens cannot be cut) with the loss "
            "on the model's turns only; drop the flag, or shorten the rows' assistant_turns"
        )
    train = tool_rollout_dataset(train_dataset, script_args, module, processor)
    evaluation = tool_rollout_dataset(eval_dataset, script_args, module, processor) if eval_dataset else None
    train[0]  # the first row has its turns, and they replay (calls parse and run), before the model loads
    logger.info("Data: %d tool rollouts for training, %d for evaluation", len(train), len(evaluation or []))
    # The collator renders and masks; TRL's own preparation and assistant masks are not used.
    training_args.dataset_kwargs = {**(training_args.dataset_kwargs or {}), "skip_prepare_dataset": True}
    training_args.assistant_only_loss = training_args.completion_only_loss = False
    model = load_model(module, model_args, training_args.trust_remote_code)
    tokenizer = getattr(processor, "tokenizer", processor)
    collator = ToolRolloutCollator(tokenizer.pad_token_id, type_key(model))
    return make_trainer(model, training_args, model_args, module, processor, train, evaluation, data_collator=collator)


_TOOL_BUDGETS = ("max_turn_tokens", "max_tool_images", "max_context_tokens")
_REWARD_FLAGS = (
    "reward_funcs",
    "reward_kwargs",
    "reward_aliases",
    "reward_max_failed_batches",
    "is_reward_customized_from_vlm_module",
)


def refuse_reward_flags(script_args: GRPOScriptArguments) -> None:
    """SFT scores nothing: a reward flag set away from its default would be ignored, so say so."""
    import dataclasses

    defaults = {f.name: f.default_factory() if callable(f.default_factory) else f.default
                for f in dataclasses.fields(script_args) if f.name in _REWARD_FLAGS}  # fmt: skip
    given = [f"--{name}" for name in _REWARD_FLAGS if getattr(script_args, name) != defaults[name]]
    if given:
        from vlm_grpo.cli_errors import UserError

        raise UserError(
            f"{', '.join(given)}: vlm-grpo-sft trains on the rows' solutions and computes no rewards; drop these "
            "flags (vlm-grpo-eval scores a checkpoint with rewards)"
        )


def save_final_model(trainer: VLMSFTTrainer, args: VLMSFTConfig, base: str) -> None:
    """Full fine-tuning: the model and processor in output_dir. LoRA: the adapter in output_dir/adapter and
    the merged model in output_dir (unless --save_merged_model false, or ZeRO-3 where weights are sharded:
    then the adapter goes to output_dir and ``vlm-grpo-merge-lora`` merges it)."""
    from peft import PeftModel

    from vlm_grpo.utils import is_zero3

    model = trainer.model
    if not isinstance(model, PeftModel):
        trainer.save_model(args.output_dir)
        return
    zero3 = is_zero3(trainer.accelerator)
    if not args.save_merged_model or zero3:
        trainer.save_model(args.output_dir)
        if zero3 and args.save_merged_model:
            logger.warning(
                "ZeRO-3: saved the adapter only; merge it with vlm-grpo-merge-lora --adapter %s", args.output_dir
            )
        return
    trainer.save_model(f"{args.output_dir}/adapter")
    trainer.accelerator.wait_for_everyone()
    if trainer.accelerator.is_main_process:
        from vlm_grpo.merge_lora import save_merged

        save_merged(trainer.accelerator.unwrap_model(model), trainer.processing_class, args.output_dir, base)
        logger.info(
            "Merged the LoRA adapter: %s is a full model (adapter in %s/adapter)", args.output_dir, args.output_dir
        )


def cli(argv: Sequence[str] | None = None) -> None:
    if answer_help(argv, parse_args):
        return
    start_process()
    from vlm_grpo.recipe import run_command  # after the help: recipes import the heavy modules

    run_command(lambda args: main(*parse_args(args)), argv)


if __name__ == "__main__":
    cli(sys.argv[1:])
