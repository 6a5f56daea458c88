"""Several processes on CPU: DDP over gloo, DeepSpeed ZeRO-2 and ZeRO-3 (torchrun, 2 ranks)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText

from e2e_utils import base_args, make_dataset, original_params
from vlm_grpo.resume import COMPLETE_MARKER, checkpoint_problem

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(argv: list[str], nproc: int = 2) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
        str(REPO / "tests" / "dist_entry.py"), *argv,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("dist_data"))


SHARING_OFF = ["--share_prompt", "false", "--share_prefill", "false"]
COMPILED = ["--compile_layers", "true", "--gradient_checkpointing", "true"]


def test_ddp_two_ranks_train_together_and_agree(tiny_models, dataset, tmp_path):
    data, plugin = dataset
    model_dir = tiny_models["qwen2_5_vl"]
    out = tmp_path / "ddp"
    # Group sharing on (the default), with the opt-in compiled decoder layers under gradient checkpointing.
    torchrun(base_args(model_dir, data, plugin, out) + COMPILED)
    for rank in (0, 1):
        info = json.loads((out / f"rank{rank}.json").read_text())
        assert info == {"world_size": 2, "step": 2}, info  # a real 2-process group, not two solo runs
    rank0, rank1 = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    before = original_params(model_dir)
    assert any(not torch.equal(before[k], rank0[k]) for k in before)

    # The same run with TRL's per-row passes gives the same losses.
    plain = tmp_path / "ddp_plain"
    torchrun(base_args(model_dir, data, plugin, plain) + SHARING_OFF)
    shared_losses = json.loads((out / "losses0.json").read_text())
    plain_losses = json.loads((plain / "losses0.json").read_text())
    assert len(shared_losses) == 2 and all(step[1] > 0 for step in shared_losses)  # non-zero gradients
    for shared_step, plain_step in zip(shared_losses, plain_losses, strict=True):  # loss, grad_norm, entropy
        assert shared_step == pytest.approx(plain_step, rel=1e-4, abs=1e-6)


def test_ddp_with_text_only_and_image_batches_on_different_ranks(tiny_models, tmp_path):
    """One rank's batch is text-only while the other's has images: TRL's image gather for the
    completions table deadlocked here; multi-process runs turn it off."""
    data, plugin = make_dataset(tmp_path / "data", kinds=("single", "text"), n=4)
    out = tmp_path / "mixed"
    torchrun([*base_args(tiny_models["qwen2_5_vl"], data, plugin, out), "--max_steps", "3"])
    assert json.loads((out / "rank1.json").read_text()) == {"world_size": 2, "step": 3}


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_trains_saves_and_reloads(stage, tiny_models, dataset, tmp_path):
    data, plugin = dataset
    model_dir = tiny_models["qwen2_5_vl"]
    out = tmp_path / stage
    argv = base_args(model_dir, data, plugin, out)
    argv += [
        "--deepspeed",
        str(REPO / "local_scripts" / f"{stage}.json"),
        "--save_strategy",
        "steps",
        "--save_steps",
        "2",
    ]
    torchrun(argv + (COMPILED if stage == "zero2" else []))  # ZeRO-3 refuses compiled layers
    assert json.loads((out / "rank1.json").read_text()) == {"world_size": 2, "step": 2}
    assert (out / "checkpoint-2").is_dir()
    # marked complete after both ranks wrote their DeepSpeed shards: what --resume_from_checkpoint true picks
    assert (out / "checkpoint-2" / COMPLETE_MARKER).is_file() and checkpoint_problem(out / "checkpoint-2") is None
    assert any(p.name.startswith("global_step") for p in (out / "checkpoint-2").iterdir())
    model, info = AutoModelForImageTextToText.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    before = original_params(model_dir)
    after = dict(model.named_parameters())
    changed = [k for k in before if not torch.equal(before[k], after[k].detach())]
    assert changed, "the saved model equals the initial one"
    if stage == "zero3":  # every optimisation on under ZeRO-3 gives the per-row losses
        plain = tmp_path / "zero3_plain"
        torchrun(base_args(model_dir, data, plugin, plain) + argv[len(base_args(model_dir, data, plugin, out)) :]
                 + SHARING_OFF)  # fmt: skip
        expected = json.loads((plain / "losses0.json").read_text())
        for shared_step, plain_step in zip(json.loads((out / "losses0.json").read_text()), expected, strict=True):
            assert shared_step == pytest.approx(plain_step, rel=1e-4, abs=1e-6)


@pytest.fixture(scope="module")
def mixed_reference(tiny_models, tmp_path_factory):
    """One text-only and one image row: every step, one rank's batch is text-only and the other's has images.
    The DDP run (no sharding, no dummy pass) is the reference for the ZeRO runs."""
    root = tmp_path_factory.mktemp("mixed_ref")
    data, plugin = make_dataset(root / "data", kinds=("single", "text"), n=1)
    out = root / "ddp"
    torchrun(base_args(tiny_models["qwen2_5_vl"], data, plugin, out))
    return data, plugin, out


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_mixed_text_and_image_ranks_train_the_vision_tower(stage, tiny_models, mixed_reference, tmp_path):
    """ZeRO-2/3 with a trainable vision tower, one rank text-only and the other with images in the same step:
    the ranks' collectives used to part ways (gloo: 'Received data size doesn't match expected size'). The
    text-only rank now runs the tower on a dummy image (zero-weighted), and training equals the DDP run."""
    data, plugin, reference = mixed_reference
    model_dir = tiny_models["qwen2_5_vl"]
    out = tmp_path / stage
    torchrun([*base_args(model_dir, data, plugin, out), "--deepspeed", str(REPO / "local_scripts" / f"{stage}.json")])
    assert json.loads((out / "rank1.json").read_text()) == {"world_size": 2, "step": 2}
    dummy = [json.loads((out / f"vision{rank}.json").read_text())["dummy_passes"] for rank in (0, 1)]
    assert sum(dummy) >= 2, dummy  # a text-only rank in both steps (generation prefill + loss pass at least)

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


def _script_torchrun_args(**env: str) -> list[str]:
    """The torchrun flags run_scripts/_common.sh builds from NPROC / NNODES / NODE_RANK / MASTER_* / RDZV_*."""
    clean = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "RDZV_ENDPOINT")}
    result = subprocess.run(
        ["bash", "-c", "source run_scripts/_common.sh && torchrun_args"],
        cwd=REPO, env={**clean, "PYTHON": sys.executable, **env}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_the_run_scripts_place_nodes_and_rendezvous():
    assert _script_torchrun_args() == [
        "--nproc_per_node", "1", "--nnodes", "1", "--node_rank", "0", "--master_addr", "127.0.0.1",
        "--master_port", "29500",
    ]  # fmt: skip
    assert _script_torchrun_args(RDZV_ENDPOINT="head:29400", NNODES="4", NPROC="8") == [
        "--nproc_per_node", "8", "--nnodes", "4", "--rdzv_backend", "c10d", "--rdzv_endpoint", "head:29400",
        "--rdzv_id", "vlm-grpo",
    ]  # fmt: skip


def test_two_nodes_on_loopback_train_like_one_node_with_two_processes(tiny_models, dataset, tmp_path):
    """Two torchrun launchers (--nnodes 2, one process each, gloo over loopback), placed by the run scripts'
    own flags: both nodes end with the same weights, equal to a one-node run of two processes."""
    data, plugin = dataset
    model_dir = tiny_models["qwen2_5_vl"]
    one_node = tmp_path / "one_node"
    torchrun(base_args(model_dir, data, plugin, one_node))

    two_nodes = tmp_path / "two_nodes"
    port = str(_free_port())
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    launchers = []
    for node in ("0", "1"):
        flags = _script_torchrun_args(NNODES="2", NODE_RANK=node, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = [sys.executable, "-m", "torch.distributed.run", *flags, str(REPO / "tests" / "dist_entry.py")]
        cmd += base_args(model_dir, data, plugin, two_nodes)
        launchers.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for launcher in launchers:
        output, _ = launcher.communicate(timeout=600)
        assert launcher.returncode == 0, output[-4000:]

    for rank in (0, 1):
        assert json.loads((two_nodes / f"rank{rank}.json").read_text()) == {"world_size": 2, "step": 2}
    node0, node1 = torch.load(two_nodes / "rank0.pt"), torch.load(two_nodes / "rank1.pt")
    single = torch.load(one_node / "rank0.pt")
    assert all(torch.equal(node0[k], node1[k]) for k in node0)
    assert all(torch.equal(node0[k], single[k]) for k in node0)
    before = original_params(model_dir)
    assert any(not torch.equal(before[k], node0[k]) for k in before)  # it trained
