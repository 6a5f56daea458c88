"""What the GRPO and SFT trainers share: the adapter options, crash-safe checkpoints and the checkpoint-reload fix."""

from __future__ import annotations

import dataclasses
import errno
import logging
import shutil
from pathlib import Path
from typing import Any, TypeVar

import torch
from transformers import PreTrainedModel
from transformers.trainer_callback import ProgressCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from vlm_grpo.cli_errors import UserError
from vlm_grpo.modules import VLMModule
from vlm_grpo.resume import mark_complete, newest_complete

logger = logging.getLogger(__name__)

ConfigT = TypeVar("ConfigT")


def as_vlm_config(args: Any, config_cls: type[ConfigT], model: Any, suffix: str) -> ConfigT:
    """The trainer's config as ``config_cls`` (``VLMGRPOConfig`` / ``VLMSFTConfig``), whose fields the trainer
    reads directly: their defaults live in that class alone.

    * an instance of ``config_cls``: used as it is;
    * None: ``config_cls`` with its defaults and ``output_dir="<model name>-<suffix>"`` (what TRL does);
    * a plain TRL config (``trl.GRPOConfig`` / ``trl.SFTConfig``): kept as the user built it -- every value it
      holds, already validated -- with the fields only ``config_cls`` has set to their documented defaults;
    * anything else: TypeError.
    """
    if isinstance(args, config_cls):
        return args
    if args is None:
        name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "")
        return config_cls(output_dir=f"{str(name).rstrip('/').split('/')[-1] or 'model'}-{suffix}")
    base = next(c for c in config_cls.__mro__[1:] if dataclasses.is_dataclass(c))
    if not isinstance(args, base):
        raise TypeError(f"args must be a {config_cls.__name__} (or a trl.{base.__name__}), not {type(args).__name__}")
    converted = config_cls.__new__(config_cls)
    converted.__dict__.update(vars(args))
    added = []
    for f in dataclasses.fields(config_cls):
        if f.name not in converted.__dict__:
            has_factory = f.default_factory is not dataclasses.MISSING
            setattr(converted, f.name, f.default_factory() if has_factory else f.default)
            added.append(f.name)
    logger.info("A plain %s was given: %s's defaults apply to %s", base.__name__, config_cls.__name__, ", ".join(added))
    return converted


def prepare_vlm(
    model: str | torch.nn.Module,
    args: Any,
    vlm_module: VLMModule | str | None,
    processing_class: Any,
    peft_config: Any,
    *,
    freeze_vision_modules: bool = False,
    lora_include_vision: bool = False,
) -> tuple[VLMModule, torch.nn.Module, Any]:
    """(adapter, model, processor) for a trainer: the family's module, then its model and processor
    loaded the family's way when only a path was given, then the freeze/LoRA options applied."""
    from vlm_grpo.modules import get_vlm_module

    name_or_path = model if isinstance(model, str) else getattr(model.config, "_name_or_path", None)
    if not isinstance(vlm_module, VLMModule):
        fallback = None if isinstance(model, str) else model.config.model_type
        vlm_module = get_vlm_module(name_or_path, vlm_module or fallback)
    trust_remote_code = args.trust_remote_code
    if isinstance(model, str):
        init_kwargs = dict(args.model_init_kwargs or {})
        init_kwargs.setdefault("trust_remote_code", trust_remote_code)
        model = vlm_module.load_model(model, **init_kwargs)
        args.model_init_kwargs = None  # consumed here; TRL would warn that they are ignored
    vlm_module.prepare_model(model)
    if processing_class is None:
        processing_class = vlm_module.load_processor(name_or_path, trust_remote_code=trust_remote_code)
    apply_adapter_options(
        vlm_module,
        model,
        peft_config,
        freeze_vision_modules=freeze_vision_modules,
        lora_include_vision=lora_include_vision,
    )
    return vlm_module, model, processing_class


def apply_adapter_options(
    module: VLMModule,
    model: torch.nn.Module,
    peft_config: Any = None,
    *,
    freeze_vision_modules: bool = False,
    lora_include_vision: bool = False,
) -> None:
    """Freeze the vision tower on request and point LoRA at the family's language-model layers."""
    if freeze_vision_modules:
        frozen = module.freeze_vision(model)
        logger.info("Froze %d vision parameters (%s)", frozen, ", ".join(module.vision_prefixes))
    if peft_config is None:
        return
    targets = getattr(peft_config, "target_modules", None)
    if targets in (None, "all-linear"):
        peft_config.target_modules = module.lora_target_modules(include_vision=lora_include_vision)
    elif isinstance(targets, (list, set)):
        peft_config.target_modules = module.lora_target_modules(sorted(targets), include_vision=lora_include_vision)


class CheckpointReloadMixin:
    """Restore full-model weights through ``from_pretrained`` so the family's key conversion applies.

    ``save_pretrained`` writes VLM checkpoints in their original key layout (``visual.*``,
    ``model.layers.*``) while ``Trainer`` reloads them key-for-key into the renamed modules
    (``model.visual.*``, ``model.language_model.*``): every weight is silently skipped and the
    resumed run starts from the base model (a transformers 5 bug). DeepSpeed, FSDP and PEFT
    checkpoints keep their own, already consistent, paths.
    """

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        model = self.model if model is None else model
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or not isinstance(model, PreTrainedModel):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        reloaded = type(model).from_pretrained(resume_from_checkpoint, dtype=model.dtype)
        model.load_state_dict(reloaded.state_dict(), strict=True)
        del reloaded
        return None


class CheckpointSaveError(UserError, OSError):
    pass


def _is_disk_full(exc: BaseException | None) -> bool:
    """ENOSPC as raised by Python, or as wrapped by torch.save / safetensors (their messages keep the cause)."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc)
        if "No space left on device" in text or "StorageFull" in text or "file write failed" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class CompleteCheckpointMixin:
    """A checkpoint counts only once all its files are written: the completion marker of
    :mod:`vlm_grpo.resume` goes in last, after every rank has saved.

    ``save_total_limit`` rotation runs only after the marker, so it can never leave the run without a
    complete checkpoint; a folder left over by a killed run at the same step is replaced, not mixed
    into; a full disk stops the run with a clear message and removes the partial folder, so the
    previous checkpoint stays the one a resume picks.
    """

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        run_dir = self._get_output_dir(trial=trial)
        folder = Path(run_dir) / f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.args.should_save and folder.exists():
            logger.info("Replacing %s, left over by an interrupted run", folder)
            shutil.rmtree(folder)
        self.accelerator.wait_for_everyone()
        limit, self.args.save_total_limit = self.args.save_total_limit, None
        try:
            super()._save_checkpoint(model, trial)
        except Exception as exc:
            if not _is_disk_full(exc):
                raise
            self._fail_disk_full(folder, exc)
        finally:
            self.args.save_total_limit = limit
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            mark_complete(folder)
            rotate_checkpoints(run_dir, limit, self.state.best_model_checkpoint, use_mtime=True)

    def _fail_disk_full(self, folder: Path, exc: BaseException) -> None:
        if self.args.should_save:
            shutil.rmtree(folder, ignore_errors=True)
        previous, _ = newest_complete(folder.parent)
        resume = (
            f"the newest complete checkpoint, {previous}, is intact: free space (or lower --save_total_limit) and "
            "rerun with --resume_from_checkpoint true"
            if previous is not None
            else "there is no earlier complete checkpoint: free space and start again"
        )
        raise CheckpointSaveError(
            f"no space left on the device while saving {folder} ({exc}). The partial checkpoint was removed; {resume}.",
        ) from exc


class LoggedProgressCallback(ProgressCallback):
    """The progress bar, with each step's metrics as one log line (``step N: loss=..., reward=...``) through
    the logger instead of a dict printed into the bar's stream."""

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if not state.is_world_process_zero or not logs:
            return
        shown = {k: v for k, v in logs.items() if k != "total_flos"}
        text = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())
        logging.getLogger("vlm_grpo").info("step %d: %s", state.global_step, text)


def log_metrics_to_logger(trainer: Any) -> None:
    """Swap transformers' progress callback for :class:`LoggedProgressCallback` (recipes call this)."""
    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(LoggedProgressCallback())


def drop_stacked_input_grad_hooks(model: torch.nn.Module) -> int:
    """Remove the input-embedding hooks transformers has lost track of; returns how many.

    TRL turns gradient checkpointing off and on again around every generation (``unwrap_model_for_generation``,
    ``disable_gradient_checkpointing``: twice a step). Each time it comes back on, transformers'
    ``enable_input_require_grads`` registers a new forward hook on the input embeddings and overwrites its handle
    to the previous one without removing it, so the hooks pile up (9 after 4 steps) and every embedding call runs
    all of them: thousands in a long run, and a changed module for a compiled decode step to guard on. A hook
    counts as stacked when it runs the same code as the one transformers holds a handle to
    (``_require_grads_hooks``); other hooks on the embeddings are left alone. That attribute and torch's
    ``RemovableHandle.hooks_dict_ref`` / ``id`` are private: if they change, nothing is removed and
    ``tests/test_long_runs.py`` fails.
    """
    removed = 0
    for owner in model.modules():
        for handle in getattr(owner, "_require_grads_hooks", None) or []:
            ref = getattr(handle, "hooks_dict_ref", None)  # a renamed private: hooks pile up as in TRL, no error
            hooks = ref() if ref is not None else None  # the embedding's ``_forward_hooks``
            code = getattr(hooks.get(handle.id) if hooks is not None else None, "__code__", None)
            if code is None:
                continue
            stale = [k for k, fn in hooks.items() if k != handle.id and getattr(fn, "__code__", None) is code]
            for key in stale:  # registered without kwargs or always_call: ``_forward_hooks`` is their only entry
                del hooks[key]
            removed += len(stale)
    return removed
