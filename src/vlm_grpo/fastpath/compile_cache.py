"""One on-disk home for compiled artifacts, so that a second run of the same command skips the compilation.

``compile_decode`` and ``compile_layers`` go through ``torch.compile``; the speed path's own Triton kernels are
compiled by Triton at first use. Both compilers already keep on-disk caches (inductor: its FX graphs, AOTAutograd
graphs and autotuning results under ``TORCHINDUCTOR_CACHE_DIR``; Triton: its binaries under ``TRITON_CACHE_DIR``),
each keyed on the graph, the shapes, the settings and the compiler's own source. By default they live in the
system's temporary folder, which a reboot or a fresh container empties. :func:`use_compile_cache` points both at a
sub-folder of one documented cache folder instead, named after the torch and Triton versions and the device, so a
new torch never reads an older one's entries and one folder is easy to move, share or delete.

What those caches skip is inductor's work (code generation, the C++ / Triton compilers, autotuning); dynamo still
traces each compiled function once per process. Left alone it traces a function again each time a dimension it
compiled static first changes (the decode step's row count when finished rows leave the batch, the packed passes'
lengths): a trace and a cache load each. Dynamo can keep a profile of the dimensions it saw change (its
"automatic dynamic" profile, ``dynamo/code_state_<job>.pkl`` in the same folder), read by a later process, which
then traces those dimensions dynamic at once: one trace per function. torch keeps that profile only for a named job
(``torch.compiler.config.job_id``); :func:`use_compile_cache` names it :data:`JOB` unless the process already has one.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ENV = "VLM_GRPO_COMPILE_CACHE"
OFF = ("off", "none", "false", "0")
# The compilers' own variables: set by a user, they win over the default folder.
COMPILER_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
# The job name dynamo's profile of dynamic dimensions is kept under (see the module's docstring).
JOB = "vlm_grpo"


def default_dir() -> Path:
    """``$VLM_GRPO_COMPILE_CACHE``, else ``compile`` in the package's cache folder (``$VLM_GRPO_CACHE``, else
    ``~/.cache/vlm_grpo``, where video frames are cached too)."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    return Path(os.environ.get("VLM_GRPO_CACHE") or Path("~") / ".cache" / "vlm_grpo").expanduser() / "compile"


def version_key(device: torch.device | str | None = None) -> str:
    """The sub-folder's name: torch and Triton versions and the device (its name and compute capability)."""
    parts = [f"torch{torch.__version__}"]
    try:
        import triton

        parts.append(f"triton{triton.__version__}")
    except ImportError:
        pass
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        parts.append(f"{torch.cuda.get_device_name(device)}-sm{major}{minor}")
    else:
        parts.append(device.type)
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", "-".join(parts))


def check_setting(setting: str | None) -> None:
    """Refuse a ``compile_cache_dir`` that cannot be created (a file in the way, a folder not writable) before
    anything is loaded; nothing is created here."""
    if setting is None or setting.lower() in OFF:
        return
    path = Path(setting).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        what = "is a file" if not existing.is_dir() else "is not writable"
        raise ValueError(
            f"compile_cache_dir: cannot create {path} ({existing} {what}); give a writable folder with "
            f"--compile_cache_dir or ${ENV}, or turn the cache off with --compile_cache_dir off"
        )


def use_compile_cache(setting: str | None, device: torch.device | str | None = None) -> Path | None:
    """Point inductor's and Triton's caches at ``<folder>/<version_key>`` for this process; returns that folder.

    ``setting`` None: the default folder (:func:`default_dir`), unless ``TORCHINDUCTOR_CACHE_DIR`` or
    ``TRITON_CACHE_DIR`` holds a folder someone chose, which then stays in charge (returns None); torch's own
    default written there does not count (:func:`_chosen`). ``off``: nothing persists: both caches
    go to a temporary folder removed when the process ends. A path: that folder (over any compiler variable set).
    In every case dynamo keeps its profile of dynamic dimensions with inductor's cache (see the module's docstring).
    """
    keep_dynamic_profile()
    if setting is not None and setting.lower() in OFF:
        folder = Path(tempfile.mkdtemp(prefix="vlm_grpo_compile_"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _point_at(folder)
        logger.info("compile_cache_dir=off: compiled artifacts go to %s and are removed at exit", folder)
        return None
    given = [name for name in COMPILER_ENV if _chosen(name)]
    if setting is None and given:
        logger.info("%s is set: compiled artifacts are cached where it says, not in %s", given[0], default_dir())
        return None
    folder = (Path(setting).expanduser() if setting else default_dir()) / version_key(device)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(
            f"compile_cache_dir: cannot create {folder} ({err.strerror}); give a writable folder with "
            f"--compile_cache_dir or ${ENV}, or turn the cache off with --compile_cache_dir off"
        ) from err
    if given:
        logger.info("compile_cache_dir=%s replaces %s for this process", setting, " and ".join(given))
    _point_at(folder)
    return folder


def keep_dynamic_profile() -> None:
    """Name the job (:data:`JOB`) so that dynamo reads and writes its profile of dynamic dimensions in inductor's
    cache folder; a job name the process set already stays."""
    import torch.compiler.config

    if torch.compiler.config.job_id is None:
        torch.compiler.config.job_id = JOB


# What this module last set the compilers' variables to (a later trainer in the process may point them elsewhere).
_pointed: dict[str, str] = {}


def _chosen(name: str) -> bool:
    """Whether the compiler variable ``name`` holds a folder someone chose: not unset, not ours, and not the one
    torch writes into it itself. Inductor sets ``TORCHINDUCTOR_CACHE_DIR`` to its default folder the first time it
    needs one (``import torch._dynamo`` does, and transformers imports it before any trainer exists), and
    ``TRITON_CACHE_DIR`` to a folder under that default when it first builds a Triton kernel."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    value = os.environ.get(name)
    if not value or value == _pointed.get(name):
        return False
    default = os.path.abspath(default_cache_dir())
    value = os.path.abspath(value)
    if name == "TRITON_CACHE_DIR":
        default = os.path.join(default, "triton")
        return os.path.commonpath([value, default]) != default
    return value != default


def _point_at(folder: Path) -> None:
    _pointed.update(TORCHINDUCTOR_CACHE_DIR=str(folder), TRITON_CACHE_DIR=str(folder / "triton"))
    os.environ.update(_pointed)
