"""Small helpers every floor may use: unwrap a model, ask for ZeRO-3, warn once, tell a loopback host.

Cheap to import (torch and transformers load on first use), so the CLIs' ``--help`` stays fast."""

from __future__ import annotations

import ipaddress
import logging
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


def warn_once(log: logging.Logger, message: str) -> None:
    """Log ``message`` once per process: the paths that call this run every step."""
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def is_loopback_host(host: str) -> bool:
    """``localhost`` or a loopback IP address (proxies are skipped, services may bind without a token)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
