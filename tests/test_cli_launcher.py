"""A torchrun worker does not outlive its launcher: torchrun starts each worker in a session of its own, so killing
the launcher's process group (a scheduler, Ctrl-C's SIGKILL cousin) left the worker training on as an orphan."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e_utils import base_args, make_dataset

SRC = Path(__file__).resolve().parents[1] / "src"
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie has stopped: only its exit status is left


def _launch(args: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), *args]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    with open(log, "w") as handle:
        return subprocess.Popen(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _kill_group_and_watch(launcher: subprocess.Popen, worker: int, seconds: float = 10.0) -> bool:
    """SIGKILL the launcher's process group; True when the worker is gone within ``seconds``."""
    os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait(timeout=30)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(worker):
            return True
        time.sleep(0.1)
    return False


def test_the_training_worker_dies_with_its_launcher(tiny_models, tmp_path):
    data, plugin = make_dataset(tmp_path / "data", kinds=("single",), n=2)
    args = base_args(tiny_models["qwen2_vl"], data, plugin, tmp_path / "out", steps=100000)
    log = tmp_path / "run.log"
    launcher = _launch(["-m", "vlm_grpo.grpo_jsonl", *args], log)
    worker = None
    try:
        _wait_for(lambda: "step 1:" in log.read_text() or launcher.poll() is not None, 300, "the first step")
        assert launcher.poll() is None, log.read_text()[-3000:]
        (worker,) = _children(launcher.pid)
        assert _kill_group_and_watch(launcher, worker), "the worker trains on after its launcher was killed"
    finally:
        if worker is not None and _alive(worker):
            os.kill(worker, signal.SIGKILL)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


def test_control_a_worker_without_the_parent_death_signal_outlives_its_launcher(tmp_path):
    """The same kill leaves a plain torchrun worker running: what the test above would see without the fix."""
    script = tmp_path / "sleeper.py"
    script.write_text("import time\nprint('ready', flush=True)\ntime.sleep(120)\n")
    log = tmp_path / "run.log"
    launcher = _launch([str(script)], log)
    worker = None
    try:
        _wait_for(lambda: "ready" in log.read_text() or launcher.poll() is not None, 120, "the worker")
        (worker,) = _children(launcher.pid)
        assert not _kill_group_and_watch(launcher, worker, seconds=3.0)
    finally:
        if worker is not None and _alive(worker):
            os.kill(worker, signal.SIGKILL)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
