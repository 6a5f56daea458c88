"""The family matrix's multi-process row: ZeRO-2 and ZeRO-3 on 2 CPU processes for every family, in ONE launch.

One text-only and one image row: in every step one rank's batch is text-only and the other's has images (the vision
tower's dummy pass keeps the ranks' collectives in step). ``matrix_dist_entry.py`` runs the selected families'
runs in turn in one process group; each family's test reads what its two runs left. Qwen2.5-VL's runs are also
checked against a DDP run of the same rows (no sharding, no dummy pass), planned first in the same launch. See
``test_family_matrix.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText

from e2e_utils import base_args, make_dataset, original_params
from test_distributed import ran, torchrun_runs
from vlm_grpo.testing.presets import TINY_FAMILIES

REPO = Path(__file__).resolve().parents[1]
EACH_FAMILY = pytest.mark.parametrize("family", TINY_FAMILIES)
STAGES = ("zero2", "zero3")


@pytest.fixture(scope="module")
def zero_runs(request, tiny_models, tmp_path_factory):
    """Every selected family under ZeRO-2 and ZeRO-3 in ONE 2-process launch (``matrix_dist_entry.py`` runs them in
    turn), after Qwen2.5-VL's DDP reference where the vision-tower test is selected: ``(family, stage) -> output
    folder``, the launch's return code, the end of its log."""
    root = tmp_path_factory.mktemp("matrix_zero")
    data, plugin = make_dataset(root / "data", kinds=("single", "text"), n=1)
    tests = [item for item in request.session.items if getattr(item, "module", None) is request.module]
    params = [item.callspec.params for item in tests if hasattr(item, "callspec")]
    selected = {p["family"] for p in params if "family" in p}
    reference = any(item.originalname == "test_qwen2_5_vl_zero_runs_train_the_vision_tower_like_ddp" for item in tests)
    argvs = {}
    if reference:  # DDP first: DeepSpeed's ZeRO-3 state must not reach a DDP run
        selected.add("qwen2_5_vl")
        argvs["qwen2_5_vl", "ddp"] = base_args(tiny_models["qwen2_5_vl"], data, plugin, root / "qwen2_5_vl" / "ddp")
    for family in [f for f in TINY_FAMILIES if f in selected]:
        for stage in STAGES:
            argv = base_args(tiny_models[family], data, plugin, root / family / stage)
            argvs[family, stage] = [*argv, "--deepspeed", str(REPO / "local_scripts" / f"{stage}.json")]
    return torchrun_runs(argvs, root)


@pytest.mark.slow
@EACH_FAMILY
def test_zero2_and_zero3_with_a_text_only_rank(family, zero_runs):
    results = {}
    for stage in STAGES:
        out = ran(zero_runs, (family, stage))
        assert json.loads((out / "rank1.json").read_text()) == {"world_size": 2, "step": 2}
        dummy = [json.loads((out / f"vision{rank}.json").read_text())["dummy_passes"] for rank in (0, 1)]
        assert sum(dummy) >= 2, dummy  # the text-only rank kept in step through the vision tower
        results[stage] = json.loads((out / "losses0.json").read_text())
    assert len(results["zero2"]) == 2 and all(step[1] > 0 for step in results["zero2"])  # non-zero gradients
    for two, three in zip(results["zero2"], results["zero3"], strict=True):  # loss, grad_norm, entropy
        assert two == pytest.approx(three, rel=1e-4, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_qwen2_5_vl_zero_runs_train_the_vision_tower_like_ddp(stage, tiny_models, zero_runs):
    """ZeRO-2/3 with a trainable vision tower, one rank text-only and the other with images in the same step:
    the ranks' collectives used to part ways (gloo: 'Received data size doesn't match expected size'). The
    text-only rank now runs the tower on a dummy image (zero-weighted), and training equals the DDP run."""
    out, reference = ran(zero_runs, ("qwen2_5_vl", stage)), ran(zero_runs, ("qwen2_5_vl", "ddp"))
    model_dir = tiny_models["qwen2_5_vl"]
    after = dict(AutoModelForImageTextToText.from_pretrained(out).named_parameters())
    before = original_params(model_dir)
    vision = [k for k in before if k.startswith("model.visual.")]
    assert vision and all(not torch.equal(before[k], after[k].detach()) for k in vision)  # the tower trained
    expected = torch.load(reference / "rank0.pt")
    for name, value in expected.items():
        torch.testing.assert_close(after[name].detach(), value, rtol=1e-4, atol=1e-5, msg=name)
    losses = json.loads((out / "losses0.json").read_text())
    for step, ref_step in zip(losses, json.loads((reference / "losses0.json").read_text()), strict=True):
        assert step == pytest.approx(ref_step, rel=1e-4, abs=1e-6)
