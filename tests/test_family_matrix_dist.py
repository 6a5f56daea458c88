"""The family matrix's multi-process row: ZeRO-2 and ZeRO-3 on 2 CPU processes for every family, in ONE launch.

One text-only and one image row: in every step one rank's batch is text-only and the other's has images (the vision
tower's dummy pass keeps the ranks' collectives in step). ``matrix_dist_entry.py`` runs the selected families'
runs in turn in one process group; each family's test reads what its two runs left. See ``test_family_matrix.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_utils import base_args, make_dataset
from test_distributed import _free_port
from vlm_grpo.testing.presets import TINY_FAMILIES

REPO = Path(__file__).resolve().parents[1]
EACH_FAMILY = pytest.mark.parametrize("family", TINY_FAMILIES)


@pytest.fixture(scope="module")
def zero_runs(request, tiny_models, tmp_path_factory):
    """Every selected family under ZeRO-2 and ZeRO-3 in ONE 2-process launch (``matrix_dist_entry.py`` runs them in
    turn). One text-only and one image row: in every step one rank's batch is text-only and the other's has images."""
    root = tmp_path_factory.mktemp("matrix_zero")
    data, plugin = make_dataset(root / "data", kinds=("single", "text"), n=1)
    selected = {
        item.callspec.params["family"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_zero2_and_zero3_with_a_text_only_rank"
    }
    plan = []
    for family in [f for f in TINY_FAMILIES if f in selected]:
        for stage in ("zero2", "zero3"):
            out = root / family / stage
            argv = base_args(tiny_models[family], data, plugin, out)
            argv += ["--deepspeed", str(REPO / "local_scripts" / f"{stage}.json")]
            plan.append({"family": family, "stage": stage, "out": str(out), "argv": argv})
    (root / "plan.json").write_text(json.dumps(plan))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(_free_port()), str(REPO / "tests" / "matrix_dist_entry.py"), str(root / "plan.json"),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    log = result.stdout[-4000:] + result.stderr[-4000:]
    return {(p["family"], p["stage"]): Path(p["out"]) for p in plan}, result.returncode, log


@pytest.mark.slow
@EACH_FAMILY
def test_zero2_and_zero3_with_a_text_only_rank(family, zero_runs):
    outs, returncode, log = zero_runs
    results = {}
    for stage in ("zero2", "zero3"):
        out = outs[family, stage]
        error = out / "error0.txt"
        assert not error.exists(), f"{family} {stage}: {error.read_text()[-3000:]}"
        assert (out / "rank1.json").is_file(), f"{family} {stage} did not finish (rc {returncode}): {log}"
        assert json.loads((out / "rank1.json").read_text()) == {"world_size": 2, "step": 2}
        dummy = [json.loads((out / f"vision{rank}.json").read_text())["dummy_passes"] for rank in (0, 1)]
        assert sum(dummy) >= 2, dummy  # the text-only rank kept in step through the vision tower
        results[stage] = json.loads((out / "losses0.json").read_text())
    assert len(results["zero2"]) == 2 and all(step[1] > 0 for step in results["zero2"])  # non-zero gradients
    for two, three in zip(results["zero2"], results["zero3"], strict=True):  # loss, grad_norm, entropy
        assert two == pytest.approx(three, rel=1e-4, abs=1e-6)
