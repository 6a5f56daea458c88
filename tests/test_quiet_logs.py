"""Each library warning at most once per run; transformers' deprecations of its own flag names hidden; a DDP run's
progress bars and torch's notes from rank 0 alone, once."""

from __future__ import annotations

import warnings

import pytest

from vlm_grpo.utils import _shown_warnings, quiet_warnings


def _noisy_library():
    """Like DeepSpeed's collectives: the same torch deprecation on every call, with filter changes between."""
    for _ in range(3):
        warnings.warn("`reduce_scatter_tensor` is deprecated", FutureWarning, stacklevel=1)
        with warnings.catch_warnings():  # any filter change resets the default action's memory
            warnings.simplefilter("ignore", ResourceWarning)
    warnings.warn("`gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning, stacklevel=1)


def _shown(quiet: bool) -> list[str]:
    _shown_warnings.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()
        warnings.simplefilter("default")
        if quiet:
            quiet_warnings()
        _noisy_library()
    return [str(w.message) for w in caught]


def test_a_repeated_warning_is_shown_once_and_own_deprecations_not_at_all(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    assert _shown(quiet=True) == ["`reduce_scatter_tensor` is deprecated"]


def test_other_ranks_leave_warnings_to_rank_0(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    assert _shown(quiet=True) == []


def test_without_it_the_same_warning_repeats():  # negative control: what users saw before
    shown = _shown(quiet=False)
    assert shown.count("`reduce_scatter_tensor` is deprecated") == 3
    assert any("gradient_checkpointing" in m for m in shown)


def test_deepspeeds_cpu_accelerator_line_is_dropped(capfd):
    """DeepSpeed logs "Setting accelerator to CPU" at every import on a machine without a GPU."""
    import subprocess
    import sys

    accelerator = "import deepspeed.accelerator as a; a.get_accelerator()"
    quiet_code = f"from vlm_grpo.utils import quiet_warnings; quiet_warnings(); {accelerator}"
    quiet = subprocess.run([sys.executable, "-c", quiet_code], capture_output=True, text=True, timeout=300)
    loud = subprocess.run([sys.executable, "-c", accelerator], capture_output=True, text=True, timeout=300)
    assert "Setting accelerator to CPU" in loud.stdout + loud.stderr  # the control: DeepSpeed does say it
    assert "Setting accelerator to CPU" not in quiet.stdout + quiet.stderr


def _torchrun_log(tiny_models, tmp_path, **env: str) -> str:
    """Everything a 2-rank DDP run on CPU prints: model load, two steps, a checkpoint after each, final save."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from e2e_utils import base_args, make_dataset

    data, plugin = make_dataset(tmp_path / "data", kinds=("single",), n=2)
    argv = base_args(tiny_models["qwen2_5_vl"], data, plugin, tmp_path / "out")
    argv[argv.index("--save_strategy") + 1] = "steps"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), "-m", "vlm_grpo.grpo_jsonl", *argv, "--save_steps", "1"]  # fmt: skip
    src = Path(__file__).resolve().parents[1] / "src"
    full_env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1", **env}
    result = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout + result.stderr


@pytest.mark.slow
def test_a_ddp_run_says_each_library_note_once(tiny_models, tmp_path):
    """No "Writing model shards" bar per checkpoint; the weights' loading bar and DDP's find_unused_parameters
    note from rank 0 only; no warning twice. The control: a user's own TORCH_CPP_LOG_LEVEL and
    HF_HUB_DISABLE_PROGRESS_BARS are kept, and then every rank says them (what users saw)."""
    log = _torchrun_log(tiny_models, tmp_path / "quiet")
    assert "Writing model shards" not in log
    assert log.count("Loading weights: 100%") == 1
    assert log.count("find_unused_parameters=True was specified") <= 1
    warned = [line for line in log.splitlines() if "Warning: " in line or "FutureWarning" in line]
    assert len(warned) == len(set(warned)), warned

    user_env = {"TORCH_CPP_LOG_LEVEL": "WARNING", "HF_HUB_DISABLE_PROGRESS_BARS": "0"}
    loud = _torchrun_log(tiny_models, tmp_path / "loud", **user_env)
    assert loud.count("Loading weights: 100%") == 2
    assert loud.count("find_unused_parameters=True was specified") == 2
