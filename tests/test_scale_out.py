"""benchmarks/scale_out.py: time in collectives from a profiled step (NCCL kernels counted once, not with their
annotations), the one-way split into driver and worker, and the CPU wiring plan end to end (slow)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"_test_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = load("scale_out_worker")

# (name, kernel, annotation, start us, end us): what torch's profiler puts on rank 0's GPU timeline for each call.
CALLS = [
    ("ncclDevKernel_AllGather_RING_LL", "nccl:_all_gather_base", 100.0, 150.0),  # generation (ZeRO-3 gather)
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "nccl:all_reduce", 300.0, 340.0),  # inside fast_decode
    ("ncclDevKernel_Broadcast_RING_LL", "nccl:broadcast", 1200.0, 1210.0),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "nccl:_reduce_scatter_base", 1500.0, 1600.0),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "nccl:all_reduce", 1700.0, 1800.0),
    ("ncclKernel_AllGather_RING_LL_Sum_int8_t", "nccl:all_gather", 1900.0, 1920.0),  # older NCCL's name
]
PHASES = [("phase:generation", 0.0, 1000.0), ("phase:decode", 200.0, 800.0), ("phase:backward", 1400.0, 1850.0)]


def spans(kernels: bool = True, annotations: bool = True) -> list[tuple[str, bool, float, float]]:
    """A synthetic profiled step: host and GPU phase windows, host c10d ops, a GEMM, NCCL kernels + annotations."""
    out = [(name, on_gpu, s + 5 * on_gpu, t + 5 * on_gpu) for name, s, t in PHASES for on_gpu in (False, True)]
    out += [("c10d::allreduce_", False, 290.0, 295.0), ("sm90_xmma_gemm_bf16bf16", True, 400.0, 500.0)]
    for kernel, annotation, start, end in CALLS:
        out += [(kernel, True, start, end)] * kernels + [(annotation, True, start, end)] * annotations
    return out


def test_collectives_on_gpu_count_the_kernels_once():
    step_s = 0.01
    data = spans()
    kernel_s = sum(t - s for _, _, s, t in CALLS) / 1e6  # 320 us
    # Negative control: the old rule (every GPU event named "nccl") takes each call twice, kernel and annotation.
    old_s = sum(t - s for name, gpu, s, t in data if gpu and "nccl" in name.lower()) / 1e6
    assert old_s == pytest.approx(2 * kernel_s)

    c = worker.collective_summary(data, step_s)
    assert c["source"] == "nccl kernels (GPU time, rank 0)"
    assert c["count"] == len(CALLS) == 6
    assert c["collective_s"] == pytest.approx(kernel_s) and c["collective_s"] != pytest.approx(old_s)
    assert c["share_of_step"] == pytest.approx(kernel_s / step_s)
    assert c["by_kind"] == {
        "AllGather": {"count": 2, "s": 70e-6},
        "AllReduce": {"count": 2, "s": 140e-6},
        "Broadcast": {"count": 1, "s": 10e-6},
        "ReduceScatter": {"count": 1, "s": 100e-6},
    }
    # The GPU phase windows (shifted by 5 us from the host ones) are the ones used: [5, 1005) and [205, 805).
    assert c["generation_calls"] == 1 and c["fast_decode_calls"] == 1
    assert c["in_generation"] == {"count": 2, "s": pytest.approx(90e-6)}
    assert c["in_decode"] == {"count": 1, "s": pytest.approx(40e-6)}
    # Busy GPU time: the union of every non-phase GPU interval (annotations overlap their kernels exactly).
    assert c["gpu_busy_s"] == pytest.approx(kernel_s + 100e-6)


def test_collectives_fall_back_to_nccl_named_events_without_kernel_names():
    c = worker.collective_summary(spans(kernels=False), 0.01)
    assert c["source"].startswith("nccl events (GPU time")
    assert c["count"] == 6 and c["collective_s"] == pytest.approx(320e-6)
    assert {k: v["count"] for k, v in c["by_kind"].items()} == {
        "AllGather": 2,
        "AllReduce": 2,  # "all_reduce": not "reduce"
        "Broadcast": 1,
        "ReduceScatter": 1,
    }
    assert c["in_generation"]["count"] == 2 and c["in_decode"]["count"] == 1


def test_collectives_on_cpu_are_the_c10d_ops():
    data = [(name, False, s, t) for name, s, t in PHASES] + [("c10d::allreduce_", False, 290.0, 295.0)]
    data += [("c10d::_allgather_base_", False, 210.0, 220.0), ("gloo:all_reduce", False, 291.0, 294.0)]
    c = worker.collective_summary(data, 0.0)
    assert c["source"] == "c10d ops (host time, rank 0)"
    assert c["by_kind"] == {"AllGather": {"count": 1, "s": 10e-6}, "AllReduce": {"count": 1, "s": 5e-6}}
    assert c["share_of_step"] is None and c["gpu_busy_s"] is None
    assert c["generation_calls"] == 1 and c["fast_decode_calls"] == 1
    assert c["in_generation"]["count"] == 2 and c["in_decode"]["count"] == 2  # host windows [0, 1000), [200, 800)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "AllReduce"),
        ("nccl:all_reduce", "AllReduce"),
        ("c10d::allreduce_", "AllReduce"),
        ("ncclDevKernel_Reduce_Sum_f32_RING_LL", "Reduce"),
        ("nccl:reduce", "Reduce"),
        ("nccl:_all_gather_base", "AllGather"),
        ("c10d::allgather_into_tensor_coalesced_", "AllGather"),
        ("nccl:reduce_scatter_tensor_coalesced", "ReduceScatter"),
        ("ncclDevKernel_Broadcast_RING_LL", "Broadcast"),
        ("ncclDevKernel_SendRecv", "SendRecv"),
        ("c10d::send", "Send"),
        ("c10d::recv_", "Recv"),
        ("c10d::alltoall_base_", "AllToAll"),
        ("c10d::barrier", "Barrier"),
        ("c10d::gather_", "Gather"),
        ("ncclDevKernel_Generic_1", "ncclDevKernel_Generic_1"),
    ],
)
def test_collective_kind(name, kind):
    assert worker.collective_kind(name) == kind


def test_driver_and_worker_import_one_way_without_torch():
    """The driver never imports the worker (only a rank under torchrun does), the worker never the driver."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import {0}; "
        "assert not {{'{1}', 'torch'}} & set(sys.modules), sorted({{'{1}', 'torch'}} & set(sys.modules))"
    )
    for module, other in (("scale_out", "scale_out_worker"), ("scale_out_worker", "scale_out")):
        cmd = [sys.executable, "-c", code.format(module, other), str(BENCH)]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.slow  # two torchrun launches (1 and 2 ranks, gloo) and a tiny model build: ~30 s on 2 idle cores
def test_scale_out_cpu_plan_reports_every_run(tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable, str(BENCH / "scale_out.py"), "--plan", "cpu", "--work", str(tmp_path / "work"),
        "--out", str(out), "--steps", "1", "--num_generations", "4", "--prompts_per_device", "1",
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert [(r[0], r[1], r[2]) for r in rows] == [("| 1", "none", "ok"), ("| 2", "none", "ok")]
    summary = json.loads((out / "cpu_summary.json").read_text())
    assert [(r["name"], r["status"]) for r in summary["runs"]] == [("cpu_n1_none", "ok"), ("cpu_n2_none", "ok")]
    for r in summary["runs"]:
        assert json.loads((out / f"{r['name']}.json").read_text())["status"] == "ok"
        assert r["step_s"] > 0 and r["samples_per_s"] > 0 and r["base_nproc"] == 1 and r["weak_efficiency"] > 0
        c = r["collectives"]
        assert c["source"] == "c10d ops (host time, rank 0)" and c["count"] > 0
        assert set(c["by_kind"]) <= set(worker.COLLECTIVE_KINDS), c["by_kind"]
        assert c["in_generation"]["count"] > 0 and r["features"]["fast_decode"] == "on"


def test_the_run_without_deepspeed_trains_bf16_weights_on_gpu():
    """The 1-GPU fallback's memory estimate is bf16 AdamW states (8 bytes a parameter): its weights must load in
    bf16, not in TRL's default fp32 (16 bytes a parameter, and fp32 GEMMs under autocast: another speed)."""
    driver = load("scale_out")
    args = driver.parse(["--plan", "zero2", "--device", "cuda"])
    flags = {ds: driver.grpo_argv(args, ds, Path("m"), Path("d.jsonl"), Path("o")) for ds in ("none", "zero2")}
    assert flags["none"][flags["none"].index("--dtype") + 1] == "bfloat16"
    assert "--dtype" not in flags["zero2"] and "--deepspeed" in flags["zero2"]
