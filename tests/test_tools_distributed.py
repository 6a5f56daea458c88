"""Tool rollouts under torchrun (2 ranks, gloo on CPU): each rank's sandbox pool, metrics gathered, ranks agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from e2e_utils import base_args, make_dataset
from test_distributed import _free_port

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # torchrun, two ranks
def test_two_ranks_call_the_python_tool_and_agree(tiny_models, tmp_path):
    data, plugin = make_dataset(tmp_path / "data", kinds=("single",))
    out = tmp_path / "out"
    argv = [
        *base_args(tiny_models["internvl"], data, plugin, out),
        "--tools", "python", "--tool_kwargs", '{"python": {"pool_size": 1, "timeout": 30}}',
        "--max_tool_calling_iterations", "1", "--max_completion_length", "200",
        "--per_device_train_batch_size", "2", "--generation_kwargs", '{"max_new_tokens": 16}',
    ]  # fmt: skip
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(_free_port()), str(REPO / "tests" / "tools_dist_entry.py"), *argv,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    ranks = [json.loads((out / f"tools{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in ranks] == [2, 2]
    for entry in ranks[0]["logs"]:  # 4 rollouts a step over 2 ranks, every one called the tool and got an image
        assert entry["tools/calls_per_rollout"] == 1.0 and entry["tools/images_returned"] == 1.0
        assert entry["tools/errors_per_rollout"] == 0.0 and entry["tools/turns"] == 2.0
    assert len(ranks[0]["logs"]) == 2
    params = [torch.load(out / f"rank{r}.pt") for r in (0, 1)]
    assert all(torch.equal(params[0][n], params[1][n]) for n in params[0])
