"""Steps the GRPO and SFT recipes share: cheap checks first, pick the model family's module, load and check
the rows, load the model."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from vlm_grpo.cli_errors import UserError, run_cli
from vlm_grpo.configs import GRPOScriptArguments, VLMGRPOConfig, VLMModelConfig
from vlm_grpo.data import prepare_rows, split_paths, to_datasets
from vlm_grpo.data.sources import ColumnKeys, check_source, read_sources, split_sources
from vlm_grpo.data.video import VideoOptions
from vlm_grpo.modules import ImageLimits, VLMModule, get_vlm_module

logger = logging.getLogger("vlm_grpo")


# --report_to name -> the module it needs (transformers' integrations import these on the first log).
_EXTRAS = ("tensorboard", "wandb")  # integrations with a vlm-grpo extra
_REPORT_MODULES = {
    "wandb": "wandb",
    "tensorboard": ("tensorboard", "tensorboardX"),
    "mlflow": "mlflow",
    "comet_ml": "comet_ml",
    "clearml": "clearml",
    "trackio": "trackio",
    "swanlab": "swanlab",
    "dvclive": "dvclive",
    "neptune": "neptune",
    "aim": "aim",
    "codecarbon": "codecarbon",
    "dagshub": "dagshub",
    "flyte": "flytekit",
    "azure_ml": "azureml",
}


_WRITE_TEST = ".write_test_"  # the temporary file that proves output_dir writable


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def evaluates(training_args: Any) -> bool:
    """Whether the run ever evaluates: with ``--eval_strategy no`` and no ``--eval_on_start``, eval files go unread."""
    return training_args.eval_strategy != "no" or bool(training_args.eval_on_start)


def preflight(script_args: GRPOScriptArguments, training_args: Any) -> None:
    """Checks that take milliseconds, run before the data check and the model load (minutes on a 7B model):
    output_dir usable, --report_to integrations installed, data files and image folders present."""
    check_output_dir(training_args.output_dir)
    check_dataset_name(script_args, training_args.output_dir, training_args.seed)
    report_to = training_args.report_to or []
    for name in report_to:
        if name in ("none", "all"):
            continue
        modules = _REPORT_MODULES.get(name)
        if modules is None:
            raise UserError(
                f"--report_to {name}: unknown integration; use one of {', '.join(sorted(_REPORT_MODULES))} or none"
            )
        modules = (modules,) if isinstance(modules, str) else modules
        if not any(_installed(m) for m in modules):
            extra = f" (or 'vlm-grpo[{name}]')" if name in _EXTRAS else ""
            raise UserError(
                f"--report_to {name}: the '{modules[0]}' package is not installed; "
                f"pip install {modules[0]}{extra}, or pass --report_to none"
            )
    if "wandb" in report_to or ("all" in report_to and _installed("wandb")):
        check_wandb_login(is_main=training_args.process_index == 0)
    for flag, value in (
        ("--data_file_paths", script_args.data_file_paths),
        ("--eval_file_paths", script_args.eval_file_paths if evaluates(training_args) else None),
    ):
        for spec in split_sources(value):
            check_source(spec, flag)
    for folder in [f for f in (script_args.image_folders or "").split(":") if f]:
        if not Path(folder).is_dir():
            raise UserError(f"--image_folders: '{folder}' is not a folder")


def check_sharded_settings(training_args: VLMGRPOConfig) -> None:
    """GRPO's speed settings that DeepSpeed ZeRO-3 / FSDP refuse when set to true: said before the model load
    rather than by the trainer after it."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    from vlm_grpo.fastpath.compiled_layers import resolve_compile_layers
    from vlm_grpo.fastpath.decode_keep import resolve_keep_decode_graphs

    sharded = is_deepspeed_zero3_enabled() or bool(training_args.fsdp)
    try:
        resolve_compile_layers(training_args.compile_layers, "cuda", sharded)
        resolve_keep_decode_graphs(training_args.keep_decode_graphs, sharded)
    except ValueError as exc:
        raise UserError(str(exc)) from None


def run_command(entry: Callable[[list[str]], Any], argv: Sequence[str] | None) -> None:
    """A recipe's command line: :func:`~vlm_grpo.cli_errors.run_cli` (user errors as ``error: ...``), then
    :func:`end_distributed`, with every rank waiting for the others only when the run ended normally."""
    ended = False
    try:
        run_cli(entry, argv)
        ended = True
    finally:
        end_distributed(synchronize=ended)


def end_distributed(synchronize: bool = False) -> None:
    """Tear down ``torch.distributed`` when a command-line run ends (accelerate's ``destroy_process_group``). A process
    group left to the interpreter's exit can abort a rank that has finished ("terminate called without an active
    exception", seen with gloo on CPU), and torchrun then reports the complete run as failed.

    ``synchronize``: the run ended normally, so every rank waits for the others first. A rank that tore its group
    down while rank 0 was still writing the final model aborted the same way (once, on a loaded 2-core machine).
    Not after an error: a rank waiting there would keep torchrun from ending a failed run."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from accelerate import PartialState

        state = PartialState()
        if synchronize:
            state.wait_for_everyone()
        state.destroy_process_group()


def resolve_run(script_args: GRPOScriptArguments, training_args: Any) -> str | None:
    """The checkpoint to resume from, or None for a fresh run (:func:`~vlm_grpo.resume.resolve_resume`); a fresh
    run refuses an output_dir that already holds other files unless ``--overwrite_output_dir``."""
    from vlm_grpo.resume import resolve_resume

    is_main = training_args.process_index == 0
    resume = resolve_resume(
        training_args.output_dir,
        training_args.resume_from_checkpoint,
        script_args.overwrite_output_dir,
        is_main_process=is_main,
        remove_old=False,  # start_fresh_run removes them, once everything else has been checked
    )
    if resume is None and is_main:  # rank 0 only: the other ranks' write tests come and go meanwhile
        check_fresh_output_dir(training_args.output_dir, script_args.overwrite_output_dir)
    return resume


def start_fresh_run(script_args: GRPOScriptArguments, training_args: Any, resume: str | None) -> None:
    """Just before training: a fresh run under ``--overwrite_output_dir`` removes the old run's checkpoints (not
    earlier, in :func:`resolve_run`: a bad reward name or data file found later would have cost them)."""
    from vlm_grpo.resume import remove_old_checkpoints

    if resume is None and script_args.overwrite_output_dir:
        remove_old_checkpoints(training_args.output_dir, training_args.process_index == 0)


def check_fresh_output_dir(output_dir: str, overwrite: bool) -> None:
    """A fresh run writes its model, logs and checkpoints into ``output_dir``: over another run's files only when
    the user says so."""
    found = sorted(p.name for p in Path(output_dir).iterdir() if not p.name.startswith(_WRITE_TEST))
    if not found:
        return
    listed = ", ".join(found[:3]) + (f", ... ({len(found)} entries)" if len(found) > 3 else "")
    if overwrite:
        logger.warning("--overwrite_output_dir: writing over the files in %s (%s)", output_dir, listed)
        return
    raise UserError(
        f"--output_dir {output_dir} is not empty ({listed}) and holds no checkpoint to resume from; pass "
        "--overwrite_output_dir to write over its files, or another --output_dir"
    )


def check_dataset_name(script_args: GRPOScriptArguments, output_dir: str, seed: int) -> None:
    """``--dataset_name`` naming a folder or file (the Lewis seed's PerVA games, a saved dataset, a data file) is
    the data (:func:`vlm_grpo.data.lewis.dataset_name_source`). Any other name is not read (VLM-R1's grpo_jsonl.py
    scripts pass ``this_is_not_used``; its older grpo_rec.py took a data-config YAML there): an error without
    ``--data_file_paths``, else a log line."""
    name = script_args.dataset_name
    if not name:
        return
    if os.path.isdir(name) or (os.path.isfile(name) and not name.endswith((".yaml", ".yml"))):
        if script_args.data_file_paths:
            raise UserError(
                f"--dataset_name {name} and --data_file_paths {script_args.data_file_paths} both name data; pass one"
            )
        from vlm_grpo.data.lewis import dataset_name_source

        script_args.data_file_paths = dataset_name_source(name, output_dir, seed)
        logger.info("--dataset_name %s: training on %s", name, script_args.data_file_paths)
        return
    if not script_args.data_file_paths:
        raise UserError(
            f"--dataset_name {name}: not read here (VLM-R1's grpo_rec.py took a data-config YAML there); pass the "
            "data as --data_file_paths a.jsonl[:b.jsonl] (a YAML's json_path entries, or NAME@SPLIT of a dataset in "
            "the local Hugging Face cache) and the images' folders as --image_folders"
        )
    logger.info("--dataset_name %s is not read: the data comes from --data_file_paths", name)


def check_wandb_login(is_main: bool = True) -> None:
    """``--report_to wandb`` without a W&B API key (no ``WANDB_API_KEY``, no ``wandb login``, no ``WANDB_MODE``):
    wandb would stop the run after the model load (or wait at a prompt there); instead the run logs offline, with
    one warning. A key wandb refuses (a malformed one) is an error now rather than then."""
    if os.environ.get("WANDB_MODE", "").strip().lower() in ("offline", "disabled", "dryrun"):
        return
    import wandb

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            logged_in = wandb.login(prompt=False, verify=False)  # no network: only where a key is configured
    except wandb.errors.Error as exc:
        wandb.teardown()  # the refused settings go with it (a caller that goes on starts from the environment)
        raise UserError(
            f"--report_to wandb: {exc}; fix WANDB_API_KEY or `wandb login`, or pass --report_to none"
        ) from None
    if logged_in:
        return
    os.environ["WANDB_MODE"] = "offline"  # wandb's own switch, read when the trainer starts the run ...
    wandb.teardown()  # ... by a new wandb run setup: the one the check started has read the settings already
    if is_main:
        print(
            "warning: --report_to wandb: no W&B API key (WANDB_API_KEY or `wandb login`): logging offline under "
            f"{os.environ.get('WANDB_DIR') or '.'}/wandb (upload it with `wandb sync`); WANDB_MODE=offline or "
            "--report_to none says so without this warning",
            file=sys.stderr,
            flush=True,
        )


def check_output_dir(output_dir: str | None) -> None:
    """``output_dir`` must be a folder this process can create and write to."""
    if not output_dir:
        raise UserError("--output_dir is required")
    path = Path(output_dir)
    if path.exists() and not path.is_dir():
        raise UserError(f"--output_dir {output_dir} is a file, not a folder; pass a folder path")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=_WRITE_TEST):
            pass
    except OSError as exc:
        raise UserError(
            f"--output_dir {output_dir} is not writable ({exc.strerror or exc}); "
            "pick another folder or fix its permissions"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UserError(f"--output_dir {output_dir} is not writable; pick another folder or fix its permissions")


def pick_module(model_args: VLMModelConfig, trust_remote_code: bool = False) -> tuple[VLMModule, Any]:
    """The adapter (from ``config.json``'s ``model_type`` or ``--vlm_module``) and its processor."""
    if not model_args.model_name_or_path:
        raise UserError("--model_name_or_path is required")
    path = model_args.model_name_or_path
    if path.startswith(("/", "./", "../", "~")) and not Path(path).expanduser().is_dir():
        raise UserError(f"--model_name_or_path {path}: no such folder (a local model folder or a Hub id)")
    try:
        module = get_vlm_module(
            path,
            model_args.vlm_module,
            ImageLimits(model_args.min_pixels, model_args.max_pixels, model_args.max_anyres_num),
            revision=model_args.model_revision,
        )
        processor = module.load_processor(path, trust_remote_code=trust_remote_code, revision=model_args.model_revision)
    except OSError as exc:  # transformers / the Hub: not found, offline, no access
        if isinstance(exc, UserError):
            raise
        raise UserError(f"--model_name_or_path {path}: cannot load its config or processor ({exc})") from exc
    logger.info("VLM module: %s (%s)", module.name, type(module).__name__)
    return module, processor


def load_checked_rows(
    script_args: GRPOScriptArguments, module: VLMModule, processor: Any, data_file_paths: str | None = None
) -> list[dict]:
    """Every row read and checked (file:line errors, or counted skips with ``--skip_bad_rows``);
    ``data_file_paths`` (e.g. the evaluation files) replaces ``--data_file_paths``."""
    keys = ColumnKeys(script_args.prompt_key, script_args.answer_key, script_args.image_key, script_args.video_key)
    folders = script_args.image_folders
    if data_file_paths and len(split_paths(folders)) > 1:
        folders = None  # one folder per training file: the evaluation files use their own folders
    rows, bad_rows = read_sources(
        data_file_paths or script_args.data_file_paths,
        folders,
        keys=keys,
        reward_method=script_args.reward_method,
        task_type=script_args.task_type,
        max_pixels=module.limits.max_pixels,  # images over the pixel limit are bad rows, as in the data check
        format_prompt=script_args.format_prompt,
        video=VideoOptions(script_args.video_fps, script_args.video_max_frames, script_args.video_max_pixels),
    )
    if script_args.vlmr1_solution_tags:
        wrap_solutions(rows)
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
    """The model to train, loaded by its family's adapter with the user's dtype, attention and revision. Then
    transformers' progress bars are turned off: each checkpoint save would draw its "Writing model shards" bar
    through the training bar (the training bar is the Trainer's own, not one of these)."""
    from transformers.utils import logging as hf_logging

    model = module.load_model(
        model_args.model_name_or_path,
        dtype=model_args.dtype,
        attn_implementation=model_args.attn_implementation,
        trust_remote_code=trust_remote_code,
        revision=model_args.model_revision,
    )
    hf_logging.disable_progress_bar()
    return model


def load_datasets(
    script_args: GRPOScriptArguments, module: VLMModule, processor: Any, seed: int, evaluates: bool = True
) -> tuple[Any, Any]:
    """(train, eval or None) datasets: eval from ``--eval_file_paths`` or a ``--val_split_ratio`` hold-out.

    ``evaluates=False`` (``--eval_strategy no`` without ``--eval_on_start``): the eval files are not read, since
    nothing would use them (a run config that names them, as a converted EasyR1 YAML does, still starts when
    they are absent here); one warning says so."""
    rows = load_checked_rows(script_args, module, processor)
    eval_files = script_args.eval_file_paths
    if eval_files and not evaluates:
        logger.warning(
            "--eval_file_paths %s not read: the run never evaluates (--eval_strategy no); to evaluate, add "
            "--eval_strategy steps --eval_steps N (or --eval_on_start)",
            eval_files,
        )
        eval_files = None
    if not eval_files:
        return to_datasets(rows, module, script_args.val_split_ratio, seed)
    if script_args.val_split_ratio:
        raise ValueError("--eval_file_paths and --val_split_ratio both set: pick one source of evaluation rows")
    eval_rows = load_checked_rows(script_args, module, processor, data_file_paths=eval_files)
    return to_datasets(rows, module)[0], to_datasets(eval_rows, module)[0]


def finish_loggers(report_to: Any) -> None:
    """Close the wandb run at the end of ``main`` so its files are complete when ``main`` returns (a script's
    exit would do it; a notebook or a test calling ``main`` would otherwise read a half-written run)."""
    if "wandb" in (report_to or []):
        import wandb

        if wandb.run is not None:
            wandb.finish()
        wandb.teardown()  # stops wandb's service process, which writes the run files out
