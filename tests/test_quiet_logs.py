"""Each library warning at most once per run; transformers' deprecations of its own flag names hidden."""

from __future__ import annotations

import warnings

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
