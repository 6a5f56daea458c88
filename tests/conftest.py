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


# --------------------------------------------------------------------------- longest files first

# Seconds each long file takes (its tests' durations summed, from `pytest -n 2 --dist loadfile --durations=0`). Under
# `--dist loadfile` the two workers take whole files from one queue. xdist orders it by test count, which puts the
# long files with few tests (multi-process launches, end-to-end runs) last, where one worker runs them while the
# other sits idle; dealt out longest first, the files that end the run are short ones. A file not listed counts as
# short; a new file over ~10 s belongs here (its place changes the wall time only, never what runs).
FILE_SECONDS = {
    "test_family_matrix_dist.py": 124,
    "test_distributed.py": 106,
    "test_docs_examples.py": 98,
    "test_bench_smoke.py": 92,
    "test_trl_options.py": 68,
    "test_group_sharing.py": 60,
    "test_fused_update.py": 60,
    "test_family_matrix.py": 55,
    "test_lewis_game.py": 53,
    "test_zero3_tool_rounds.py": 51,
    "test_sandbox_corpus.py": 44,
    "test_decode_mlp.py": 39,
    "test_compile_cache.py": 40,
    "test_scale_out.py": 36,
    "test_decode_sized_parity.py": 34,
    "test_learning.py": 34,
    "test_quiet_logs.py": 34,
    "test_pipeline.py": 30,
    "test_tools_e2e.py": 30,
    "test_kill_resume.py": 29,
    "test_scale_shape.py": 25,
    "test_decode_kernel.py": 24,
    "test_train_e2e.py": 23,
    "test_mixed_precision.py": 22,
    "test_demo_tools.py": 21,
    "test_tools_distributed.py": 20,
    "test_tool_protocols_e2e.py": 18,
    "test_ci_skips.py": 18,
    "test_decode_compact.py": 18,
    "test_cli_errors.py": 17,
    "test_early_tool_calls.py": 24,
    "test_tool_turns_fast.py": 16,
    "test_docs.py": 16,
    "test_sandbox.py": 15,
    "test_lewis_speaker_external.py": 15,
    "test_vision_attention.py": 14,
    "test_lewis_script.py": 14,
    "test_presets.py": 13,
    "test_turn_cache.py": 13,
    "test_run_scripts.py": 13,
    "test_multiturn_sharing.py": 11,
    "test_vlm_r1_script.py": 11,
    "test_cli_launcher.py": 11,
    "test_sft_tools.py": 10,
    "test_help_speed.py": 10,
    "test_varlen_blocks.py": 10,
}


def longest_first(scopes: list[str]) -> list[str]:
    """``scopes`` (xdist's file node ids, in its order) with the files of ``FILE_SECONDS`` first, longest first; the
    others after them in the order given."""
    return sorted(scopes, key=lambda scope: -FILE_SECONDS.get(Path(scope.split("::")[0]).name, 0))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """``--dist loadfile`` deals the files out longest first (``FILE_SECONDS``); other modes are xdist's own."""
    if config.getoption("dist") != "loadfile":
        return None
    from collections import OrderedDict

    from xdist.scheduler import LoadFileScheduling

    class LongestFileFirst(LoadFileScheduling):
        def _assign_work_unit(self, node) -> None:
            # The queue is complete before the first file is dealt out (xdist 3.x builds it in ``schedule``).
            if not getattr(self, "_ordered", False):
                self.workqueue = OrderedDict((s, self.workqueue[s]) for s in longest_first(list(self.workqueue)))
                self._ordered = True
            super()._assign_work_unit(node)

    return LongestFileFirst(config, log)


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
