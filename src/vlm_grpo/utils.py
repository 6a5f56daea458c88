"""Small helpers every floor may use: unwrap a model, ask for ZeRO-3, warn once, quiet library warnings, tell a
loopback host, end a torchrun worker with its launcher.

Cheap to import (torch and transformers load on first use), so the CLIs' ``--help`` stays fast."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any


def peft_base(model: Any) -> Any:
    """The model under a PEFT wrapper (or the model itself): its forward signature and submodules."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def model_base(model: Any) -> Any:
    """The ``PreTrainedModel`` inside DeepSpeed / DDP / FSDP and PEFT wrappers (whose config is the model's)."""
    import torch
    from transformers import PreTrainedModel

    while not isinstance(model, PreTrainedModel) and isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module  # a DeepSpeed engine's own ``config`` is DeepSpeed's, not the model's
    return peft_base(model)


def is_zero3(accelerator: Any) -> bool:
    """DeepSpeed ZeRO-3: parameters are partitioned and gathered module by module."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return plugin is not None and plugin.zero_stage == 3


_warned: set[str] = set()


def generation_model(trainer: Any) -> Any:
    """TRL's ``unwrap_model_for_generation`` with the trainer's settings: the model to generate with (ZeRO-3
    parameters gathered when ``ds3_gather_for_generation``), as TRL's own generation enters it."""
    from trl.models.utils import unwrap_model_for_generation

    return unwrap_model_for_generation(
        trainer.model_wrapped,
        trainer.accelerator,
        gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
        generation_kwargs=trainer.generation_kwargs,
        gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
    )


@contextlib.contextmanager
def per_chunk_kwargs(model: Any, update: Callable[[int, int, dict[str, Any]], dict[str, Any]]) -> Iterator[None]:
    """TRL's per-row log-prob pass calls ``model`` on consecutive chunks of rows, in order: a pre-forward hook counts
    the rows and calls ``update(start, end, kwargs)`` for each chunk, whose result the forward then takes."""
    start = 0

    def hook(_: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        nonlocal start
        end = start + kwargs["input_ids"].size(0)
        out = update(start, end, kwargs)
        start = end
        return args, out

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def warn_once(log: logging.Logger, message: str, level: int = logging.WARNING) -> None:
    """Log ``message`` once per process (at ``level``): the paths that call this run every step."""
    if message not in _warned:
        _warned.add(message)
        log.log(level, message)


def is_loopback_host(host: str) -> bool:
    """``localhost`` or a loopback IP address (proxies are skipped, services may bind without a token)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def start_process() -> None:
    """First thing a recipe's process does, before its slow imports: end with the launcher, quiet warnings."""
    die_with_launcher()
    quiet_warnings()  # warnings raised while importing are said once, by rank 0


def die_with_launcher() -> None:
    """Under torchrun: have Linux SIGKILL this worker when its launcher dies. torchrun starts each worker with
    setsid(), outside the launcher's process group, so a launcher killed with its process group (a job scheduler,
    a SIGKILL) would otherwise leave the workers training on as orphans. A no-op outside torchrun (a run started
    with ``nohup`` or ``&`` must outlive its shell) and on other systems."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    launcher = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != launcher:  # the launcher died before the signal was asked for
        os.kill(os.getpid(), signal.SIGKILL)


# Deprecations transformers raises about its own names, which TRL's configs and trainer (and VLM-R1's
# --gradient_checkpointing flag) still use: nothing a user can act on.
_OWN_DEPRECATIONS = r"`\w*gradient_checkpointing\w*` is deprecated"


_shown_warnings: set[tuple[str, type]] = set()


class _DropMessages(logging.Filter):
    """Drops a library's log records that start with ``prefix`` (a logger-level filter survives its handlers
    being replaced)."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_warnings() -> None:
    """Each warning at most once per run: once per process whatever its source line, and only on rank 0;
    the known deprecations of our own config use hidden. Called before the heavy imports, so warnings raised
    while importing (torch's deprecations in other libraries) count too.

    Python's own "once" and "default" actions remember what they showed in per-module registries that are
    cleared whenever any library touches the filters (``catch_warnings``): DeepSpeed's collectives then
    repeated one torch deprecation on every call. ``warnings.showwarning`` is the documented hook for
    how warnings are shown; ours drops repeats and hands the rest on.
    """
    warnings.filterwarnings("ignore", message=_OWN_DEPRECATIONS, category=FutureWarning)
    if int(os.environ.get("RANK", "0")) > 0:
        # The libraries' own switches, read when they are imported (a recipe calls this first): torch's C++
        # warnings (DDP's find_unused_parameters note) and the Hub's and transformers' progress bars
        # ("Loading weights") from rank 0 alone.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # DeepSpeed logs "Setting accelerator to CPU" on every import when there is no GPU: nothing to act on.
    deepspeed = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DropMessages) for f in deepspeed.filters):
        deepspeed.addFilter(_DropMessages("Setting accelerator to CPU"))
    if int(os.environ.get("RANK", "0")) > 0:  # under torchrun the other ranks repeat rank 0's warnings
        warnings.simplefilter("ignore")
    if getattr(warnings.showwarning, "shows_once", False):
        return
    show = warnings.showwarning

    def show_once(message, category, filename, lineno, file=None, line=None):
        key = (str(message), category)
        if key not in _shown_warnings:
            _shown_warnings.add(key)
            show(message, category, filename, lineno, file, line)

    show_once.shows_once = True
    warnings.showwarning = show_once
