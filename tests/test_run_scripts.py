"""run_scripts/_common.sh: which Python, whether DeepSpeed, and the command printed before it runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _bash(script: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "DEEPSPEED", "DEEPSPEED_ON_CPU")}
    full_env["PATH"] = f"/nonexistent-no-nvidia-smi:{full_env['PATH']}"
    return subprocess.run(
        ["bash", "-c", f"source run_scripts/_common.sh\n{script}"],
        cwd=REPO,
        env={**full_env, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def _no_gpu() -> bool:
    return subprocess.run(["bash", "-c", "nvidia-smi -L"], capture_output=True).returncode != 0


def test_deepspeed_none_or_empty_turns_it_off():
    for value in ("none", "", "off", "false"):
        result = _bash('echo "[$(deepspeed_args | tr "\\n" " ")]"', PYTHON=sys.executable, DEEPSPEED=value)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "[]", (value, result.stdout)


def test_deepspeed_without_a_gpu_is_left_out_with_a_message_unless_asked_to_keep():
    assert _no_gpu()  # this test runs on the CPU machines of the suite
    dropped = _bash('echo "[$(deepspeed_args)]"', PYTHON=sys.executable, DEEPSPEED="local_scripts/zero3.json")
    assert dropped.stdout.strip() == "[]" and "no GPU found: running without DeepSpeed" in dropped.stderr
    kept = _bash(
        'echo "[$(deepspeed_args | tr "\\n" " ")]"',
        PYTHON=sys.executable,
        DEEPSPEED="local_scripts/zero3.json",
        DEEPSPEED_ON_CPU="1",
    )
    assert kept.stdout.strip() == "[--deepspeed local_scripts/zero3.json ]"


def test_a_python_without_torch_is_a_clear_error():
    result = _bash("echo reached", PYTHON="/usr/bin/env")  # `env -c ...` fails like a Python without torch
    assert result.returncode == 2 and "reached" not in result.stdout
    assert "error: /usr/bin/env has no torch installed. Run 'make setup'" in result.stderr


def test_the_repo_venv_is_preferred_and_the_command_is_printed(tmp_path):
    # A copy of the scripts in a repo whose .venv holds a Python (this one): PYTHON unset picks it.
    (tmp_path / "run_scripts").mkdir()
    (tmp_path / "run_scripts" / "_common.sh").write_text((REPO / "run_scripts" / "_common.sh").read_text())
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    python = tmp_path / ".venv" / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    result = subprocess.run(
        ["bash", "-c", 'source run_scripts/_common.sh\necho "PYTHON=$PYTHON"; show_and_run echo "two words"'],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert f"PYTHON={tmp_path}/.venv/bin/python" in result.stdout
    assert "+ echo two\\ words" in result.stdout and "\ntwo words" in result.stdout


def test_a_failed_run_fails_the_script(tmp_path):
    """VLM-R1's scripts end in `echo`, so a failed run exits 0; ours exit with the trainer's status."""
    env = {k: v for k, v in os.environ.items() if k not in ("DEEPSPEED", "DEEPSPEED_ON_CPU")}
    env.update(PYTHON=sys.executable, OUTPUT_DIR=str(tmp_path / "out"), DATA=str(tmp_path / "missing.jsonl"))
    result = subprocess.run(
        ["bash", "run_scripts/run_grpo_demo.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode != 0, result.stdout[-2000:] + result.stderr[-2000:]  # torchrun: 1 when a rank fails
    assert "missing.jsonl' does not exist" in result.stdout + result.stderr
