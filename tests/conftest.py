"""Shared pytest fixtures, and the CI rule: under ``CI=true`` a skipped test is a failure."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

# One torch (OpenMP) thread per process unless the user set their own: the suite runs two workers on two cores, and
# the runs they start (torchrun ranks, run scripts, benchmarks) inherit it. More threads than cores make OpenMP's
# waiting threads spin against each other and slow tiny-model runs several times over on a busy machine. Set before
# any test module imports torch, so the workers' own torch reads it too.
os.environ.setdefault("OMP_NUM_THREADS", "1")


class TinyModels(Mapping[str, Path]):
    """family -> folder of a tiny random checkpoint, built on first access and kept for the session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: dict[str, Path] = {}

    def __getitem__(self, family: str) -> Path:
        from vlm_grpo.testing.tiny import TINY_FAMILIES, build_tiny_model

        if family not in TINY_FAMILIES:
            raise KeyError(family)
        if family not in self._built:
            self._built[family] = build_tiny_model(family, self.root / family, seed=0)
        return self._built[family]

    def __iter__(self) -> Iterator[str]:
        from vlm_grpo.testing.tiny import TINY_FAMILIES

        return iter(TINY_FAMILIES)

    def __len__(self) -> int:
        from vlm_grpo.testing.tiny import TINY_FAMILIES

        return len(TINY_FAMILIES)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels | dict[str, Path]:
    """Tiny checkpoints of every family (``tiny_models["qwen2_5_vl"]`` is a folder), built lazily once.

    ``VLM_GRPO_TINY_MODELS=DIR``: read-only checkpoints built beforehand by
    ``python -m vlm_grpo.testing.tiny --family all --out DIR`` (``make mutants`` runs each mutant in a fresh
    process, where building them again would dominate)."""
    prebuilt = os.environ.get("VLM_GRPO_TINY_MODELS")
    if prebuilt:
        from vlm_grpo.testing.tiny import TINY_FAMILIES

        return {family: Path(prebuilt) / family for family in TINY_FAMILIES}
    return TinyModels(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one thread, and do not slow down when the machine is busy
    (use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- no silent skips in CI


def running_in_ci() -> bool:
    """``CI=true`` (GitHub Actions, GitLab, ... set it): every test must run."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _skip_reason(report: pytest.BaseReport) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def _fail_skip_in_ci(report: pytest.BaseReport) -> None:
    if running_in_ci() and report.skipped and not hasattr(report, "wasxfail"):
        report.outcome = "failed"
        report.longrepr = (
            f"CI=true: a test was skipped ({_skip_reason(report)}). Under CI a missing dependency or an "
            "unavailable feature a test needs is a failure: install what it names (`make setup` installs the "
            "test extra, with Triton from the pinned torch wheel) or fix the machine."
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    """A module-level ``pytest.importorskip`` skips the whole file at collection."""
    outcome = yield
    _fail_skip_in_ci(outcome.get_result())


def _session_job() -> str | None:
    import torch.compiler.config

    return torch.compiler.config.job_id


_SESSION_JOB = _session_job()


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Code under test may set process-wide switches (``WANDB_MODE=offline`` for a wandb run without a key):
    each test starts from the environment the session started with."""
    import os

    import torch.compiler.config

    # The compile cache names a compile job (dynamo then reads and writes its profile of dynamic dimensions): every
    # test starts without one, as the session did, even after a module-scoped fixture built a trainer.
    saved = dict(os.environ)
    torch.compiler.config.job_id = _SESSION_JOB
    yield
    os.environ.clear()
    os.environ.update(saved)
    torch.compiler.config.job_id = _SESSION_JOB
