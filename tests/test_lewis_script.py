"""``run_scripts/run_lewis_speaker.sh`` end to end on CPU: listener service up, 2 GRPO steps scored by it, service
stopped afterwards."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vlm_grpo.rewards import REWARDS
from vlm_grpo.serve.threaded import free_port, process_alive

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # torchrun and a served listener
def test_lewis_script_trains_the_speaker_against_a_served_listener(tiny_models, tmp_path):
    out = tmp_path / "lewis"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "MODEL": str(tiny_models["qwen2_5_vl"]),
        "OUTPUT_DIR": str(out),
        "MASTER_PORT": str(free_port()),
        "HEALTH_TIMEOUT": "180",
        "ROWS": "8",
    }
    assert {"listener", "format_speaker", "one_sentence"} <= set(REWARDS.names())
    result = subprocess.run(
        ["bash", str(REPO / "run_scripts" / "run_lewis_speaker.sh")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "[vlm-grpo] step 2; mean rewards:" in output, output[-4000:]
    for reward in ("listener", "format_speaker", "one_sentence"):
        assert re.search(rf"{reward}=\d", output), reward

    listener_log = (out / "listener.log").read_text()
    assert '"GET /health HTTP/1.1" 200' in listener_log
    assert '"POST /batch_score HTTP/1.1" 200' in listener_log, listener_log[-2000:]
    assert "server_failures" in output

    stopped = re.search(r"listener \(pid (\d+)\) stopped", output)
    assert stopped, output[-2000:]
    assert not process_alive(int(stopped.group(1)))
    assert (out / "data" / "train.jsonl").is_file() and (out / "config.json").is_file()
