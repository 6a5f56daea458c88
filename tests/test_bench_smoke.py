"""The benchmark harness runs on CPU with the tiny preset and reports both trainers (CI smoke test)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_utils import run_main

REPO = Path(__file__).resolve().parents[1]


def test_bench_grpo_tiny_cpu_prints_both_rows(tmp_path, monkeypatch, capsys):
    out = tmp_path / "bench.json"
    argv = [
        "--preset", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "1", "--num_generations", "4",
        "--out", str(out), "--vary_prompts", "4", "--profile_dir", str(tmp_path / "prof"),
    ]  # fmt: skip
    run_main("bench_grpo.py", argv, tmp_path, monkeypatch)
    result = capsys.readouterr()
    for kind in ("vanilla", "ours"):  # the profiled extra step: top ops, and the loss forward + backward window
        assert "Self CPU" in (tmp_path / "prof" / f"56px_x1_C8_{kind}.txt").read_text()
        window = (tmp_path / "prof" / f"56px_x1_C8_{kind}.train.txt").read_text()
        assert window.startswith("training window (loss forward + backward): ") and "aten::mm" in window
    table = result.out[result.out.index("\nscenario ") + 1 :]  # the table after the per-run JSON lines
    rows = [line.split() for line in table.splitlines()[2:] if line.strip()]
    assert [r[3] for r in rows] == ["vanilla", "ours"]  # the scenario "56px x1 C8" is three words
    payload = json.loads(out.read_text())
    assert [r["trainer"] for r in payload["results"]] == ["vanilla", "ours"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", payload["date"]) and payload["versions"]["trl"]  # RESULTS.md states them
    for r in payload["results"]:
        assert r["samples_per_s"] > 0 and r["phases_s"]["generation"] > 0 and r["completion_tokens"] > 0


def test_train_window_times_each_variant_on_one_batch(tmp_path, monkeypatch, capsys):
    """Both variants take turns on one generated batch: every repeat timed, a median each; a config field given
    as a variant's switch is refused (it would be silently ignored: the variants share one trainer)."""
    out = tmp_path / "window.json"
    argv = [
        "--preset", "tiny", "--device", "cpu", "--repeats", "2", "--warmup", "1", "--num_generations", "4",
        "--trainer", "ours:compile_layers=false", "--out", str(out),
    ]  # fmt: skip
    run_main("micro/train_window.py", argv, tmp_path, monkeypatch)
    payload = json.loads(out.read_text())
    assert set(payload["times_s"]) == {"ours", "text"} and all(len(t) == 2 for t in payload["times_s"].values())
    assert all(m > 0 for m in payload["median_s"].values())
    capsys.readouterr()
    with pytest.raises(SystemExit) as bad:
        run_main("micro/train_window.py", ["--variants", "x:compile_layers=true"], tmp_path, monkeypatch)
    err = capsys.readouterr().err
    assert bad.value.code != 0 and "['compile_layers'] are config fields; give them to --trainer" in err


def test_varlen_check_compares_the_varlen_calls_with_the_islands_and_trl(tmp_path, monkeypatch):
    """On CPU through the stand-in kernel: the varlen variant runs no island call (text or vision), and all agree."""
    import vlm_grpo.fastpath.block_attention as block_attention
    import vlm_grpo.fastpath.varlen as varlen
    import vlm_grpo.fastpath.vision_attention as vision_attention

    # The script sets these for the rest of its process: the session's values come back after the test.
    for module, names in ((varlen, ("CPU_STAND_IN",)), (block_attention, ("_packed_sdpa", "VARLEN")),
                          (vision_attention, ("_segmented_sdpa", "VARLEN"))):  # fmt: skip
        for name in names:
            monkeypatch.setattr(module, name, getattr(module, name))
    out = tmp_path / "check.json"
    argv = [
        "--preset", "tiny", "--device", "cpu", "--completion_length", "8", "--num_generations", "4", "--cpu_stand_in",
        "--out", str(out),
    ]  # fmt: skip
    run_main("micro/varlen_check.py", argv, tmp_path, monkeypatch)
    report = json.loads(out.read_text())
    calls = report["island_calls"]
    assert calls["varlen"] == {"text": 0, "vision": 0}, calls
    assert calls["island"]["text"] > 0 == calls["island"]["vision"], calls
    assert calls["vision_island"]["vision"] > 0 == calls["vision_island"]["text"], calls
    for pair in (
        "varlen_vs_island",
        "varlen_vs_vision_island",
        "varlen_vs_trl",
        "island_vs_trl",
        "vision_island_vs_trl",
    ):
        assert report[pair]["logp_max_abs"] < 1e-4 and report[pair]["grad_rel_l2"] < 1e-4, (pair, report[pair])


def test_spy_summary_keeps_the_window_and_drops_compilation(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks" / "micro"))
    try:
        from spy_summary import summarise
    finally:
        sys.path.remove(str(REPO / "benchmarks" / "micro"))
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "thread (1): MainThread;main (w.py:1);window (w.py:9);mm (torch/a.py:3);cudaLaunchKernel (libcuda.so) 7\n"
        "thread (1): MainThread;main (w.py:1);window (w.py:9);fx (torch/_inductor/compile_fx.py:5) 50\n"
        "thread (1): MainThread;main (w.py:1);load (w.py:2) 4\n"
        "thread (2);apply (torch/autograd/function.py:9) 3\n"
    )
    groups = summarise(raw, "window", 10)["groups"]
    assert groups["within"]["samples"] == 7 and groups["compiling"]["samples"] == 50
    assert groups["within"]["leaf"] == [("cudaLaunchKernel (libcuda.so)", 7)]
    assert groups["within"]["py_leaf"] == [("mm (torch/a.py:3)", 7)]
    assert ("window (w.py)", 7) in groups["within"]["py_incl"]
    assert groups["main, elsewhere"]["samples"] == 4 and groups["other threads"]["samples"] == 3


def test_max_fit_tiny_cpu_doubles_then_bisects(tmp_path, monkeypatch, capsys):
    """Both modes train real steps; a simulated OOM above 2 prompts drives doubling (1, 2, 4) then bisection (3)."""
    out = tmp_path / "max_fit.json"
    argv = [
        "--preset", "tiny", "--device", "cpu", "--modes", "full", "lora", "--max_prompts", "4",
        "--num_generations", "2", "--simulate_oom_above", "2", "--out", str(out),
    ]  # fmt: skip
    run_main("max_fit.py", argv, tmp_path, monkeypatch)
    stdout = capsys.readouterr().out
    table = stdout[stdout.index("preset") :]
    rows = [line.split() for line in table.splitlines()[2:] if line.strip()]
    assert [r[:2] for r in rows] == [["tiny_qwen2_5_vl", "full"], ["tiny_qwen2_5_vl", "lora"]]
    payload = json.loads(out.read_text())
    assert payload["device"] == "cpu" and payload["args"]["image_size"] == 56
    for r in payload["results"]:
        assert r["status"] == "ok" and r["fits_one_prompt"] and not r["capped"]
        assert (r["largest_prompts"], r["samples_per_step"], r["first_oom_prompts"]) == (2, 4, 3)
        assert [(t["prompts"], t["fits"]) for t in r["tries"]] == [(1, True), (2, True), (4, False), (3, False)]
        assert r["peak_gib"] > 0 and all(t["seconds"] > 0 for t in r["tries"])
        assert "OOM in loss forward" in r["tries"][-1]["error"]
    full, lora = payload["results"]
    assert 0 < lora["trainable_params"] < full["trainable_params"] == full["params"]


def test_sdpa_shapes_cpu_times_both_backend_settings(tmp_path):
    out = tmp_path / "shapes.json"
    cmd = [
        sys.executable, str(REPO / "benchmarks" / "micro" / "sdpa_shapes.py"), "--device", "cpu", "--lengths", "2",
        "--first_length", "20", "--completion_length", "4", "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"default", "no_cudnn"}
    assert all(r["first_call_ms"] > 0 and r["repeat_ms"] > 0 for r in rows.values())


def test_loader_micro_decodes_only_the_generating_fetch(tmp_path, monkeypatch):
    out = tmp_path / "loader.json"
    argv = ["--prompts", "4", "--image_size", "56", "--cycles", "1", "--out", str(out)]
    run_main("micro/loader_micro.py", argv, tmp_path, monkeypatch)
    data = json.loads(out.read_text())
    rows, fetches = data["rows_per_fetch"], data["fetches_per_cycle"]
    assert data["results"]["deferred"]["images_decoded"] == rows  # the generating fetch only
    assert data["results"]["decoded_at_fetch"]["images_decoded"] == rows * fetches  # the control: every fetch


def test_decode_lengths_tiny_cpu_times_each_call_and_profiles_the_last(tmp_path, monkeypatch):
    import vlm_grpo.fastpath.decode as decode

    # The script times every graph capture of its process (with CUDA syncs) and may swap the compiled step: the
    # session's decode comes back after the test.
    monkeypatch.setattr(decode._Step, "_capture", decode._Step._capture)
    for name in ("_compiled_forward", "CACHE_BUCKET"):
        monkeypatch.setattr(decode, name, getattr(decode, name))
    out, profile, trace = tmp_path / "lengths.json", tmp_path / "profile.txt", tmp_path / "trace.json"
    argv = [
        "--preset", "tiny", "--device", "cpu", "--new_tokens", "4", "--prompt_lengths", "20", "24",
        "--profile", str(profile), "--out", str(out), "--trace", str(trace), "--keep", "true", "false",
        "--greedy", "true",
    ]  # fmt: skip
    run_main("micro/decode_lengths.py", argv, tmp_path, monkeypatch)
    summary = json.loads(out.read_text())
    assert [(c["prompt_len"], c["keep"]) for c in summary["calls"]] == [
        (20, True),
        (20, False),
        (24, True),
        (24, False),
    ]
    assert all(c["tokens"] == 4 for c in summary["calls"]) and set(summary["by_window"]) == {
        "None/keep=True",
        "None/keep=False",
    }
    assert summary["agreement_with_first_variant"] == {"tokens_equal": 1.0, "rows_equal": 1.0}
    assert summary["decode_ms_per_token"] > 0 and "Self CPU" in Path(f"{profile}.wNone.kept").read_text()
    assert json.loads(Path(f"{trace}.wNone.kept").read_text())["traceEvents"]  # the profiled call's Chrome trace


def test_decode_lengths_sorts_kernels_into_kinds():
    """The kinds the decode profile reports, for kernel names from an H100 profile of the decode step."""
    paths = [str(REPO / "benchmarks" / "micro"), str(REPO / "benchmarks")]  # decode_lengths imports bench_common
    sys.path[:0] = paths
    try:
        from decode_lengths import _kind
    finally:
        for path in paths:
            sys.path.remove(path)
    assert _kind("nvjet_sm90_tst_192x16_64x8_4x1_v_bz_TNT") == "gemm"
    assert _kind("void cublasLt::splitKreduce_kernel<32, 16, int, float>") == "gemm"
    assert _kind("fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel)") == "attention"
    norm = "triton_red_fused__to_copy__unsafe_view_add_mean_mul_pow_rsqrt_13"
    assert _kind(norm) == "triton (fused pointwise / norms)"
    assert _kind("triton_poi_fused__scaled_dot_product_efficient_attention__to_copy_add_cat") == "attention"
    assert _kind("Memset (Device)") == "memset / memcpy"
    assert _kind("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, ArgMaxOp>>") == (
        "other (sampling, eager ops)"
    )


def test_vary_images_gives_the_vision_tower_segments_of_several_lengths(tmp_path):
    """``--vary_images N``: images shrink by 0..N patch pairs (28 px), height and width by different amounts, so
    Qwen2.5-VL's edge windows differ; without it, every image is the scenario's square."""
    from PIL import Image

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from bench_common import Scenario, write_images
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    scenario = Scenario(448, 1, 8)
    sizes = [Image.open(p).size for row in write_images(tmp_path, scenario, 6, 0, vary=4) for p in row]
    assert all(336 <= s <= 448 and s % 28 == 0 for size in sizes for s in size), sizes
    assert len(set(sizes)) >= 4 and any(w != h for w, h in sizes), sizes
    same = [Image.open(p).size for row in write_images(tmp_path, scenario, 3, 0) for p in row]
    assert same == [(448, 448)] * 3


def test_bench_tools_tiny_cpu_counts_prefill_and_vision_work(tmp_path, monkeypatch):
    """Both trainers on T2 and T4h: the held caches prefill fewer tokens and encode fewer images than TRL's loop, and
    the half scenario makes half the tool calls of its rounds."""
    out = tmp_path / "tools.json"
    argv = [
        "--preset", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--num_generations", "4",
        "--tool_scenarios", "T2", "T4h", "--out", str(out),
    ]  # fmt: skip
    run_main("bench_tools.py", argv, tmp_path, monkeypatch)
    payload = json.loads(out.read_text())
    assert payload["args"]["tool_scenarios"] == ["T2", "T4h"]  # RESULTS.md's command line names them
    runs = [(r["scenario"].split()[-1], r["trainer"]) for r in payload["results"]]
    assert runs == [("T2", "vanilla"), ("T2", "ours"), ("T4h", "vanilla"), ("T4h", "ours")]
    tools = payload["tools"]
    for name in ("T2", "T4h"):
        vanilla, ours = tools[f"56px x1 C8 {name} vanilla"], tools[f"56px x1 C8 {name} ours"]
        assert 0 < ours["prefill_tokens_per_step"] < vanilla["prefill_tokens_per_step"] / 2
        assert vanilla["tool_calls_per_rollout"] == ours["tool_calls_per_rollout"]
        # The host work of the loop: templates and image preprocessing once per reply shape / image, not per round.
        assert 0 < ours["chat_templates_per_step"] < vanilla["chat_templates_per_step"] / 2
        assert 0 < ours["images_preprocessed_per_step"] < vanilla["images_preprocessed_per_step"] / 4
        assert ours["decode_workspaces_per_step"] >= 1 and vanilla["decode_workspaces_per_step"] == 0
        assert vanilla["loop_host_s_per_step"] > 0 and ours["loop_host_s_per_step"] > 0
    # 2 prompts x G=4: each prompt image once per group, then one new tool image per rollout and round (T2: 2 rounds;
    # T4h: 8 rollouts in round 1, the 4 that go on in rounds 2-4); TRL's loop encodes every image of every history.
    assert tools["56px x1 C8 T2 ours"]["vision_images_per_step"] == 2 + 8 * 2
    assert tools["56px x1 C8 T2 vanilla"]["vision_images_per_step"] == 8 + 8 * 2 + 8 * 3
    assert tools["56px x1 C8 T4h ours"]["vision_images_per_step"] == 2 + 8 + 4 * 3
    assert tools["56px x1 C8 T4h ours"]["tool_calls_per_rollout"] == 2.5  # (1 + 4) / 2
    assert payload["results"][1]["decode_ms_per_token"] > 0


def test_bench_grpo_easyr1_shape_tiny_cpu_reports_cycles_and_natural_lengths(tmp_path, monkeypatch, capsys):
    """The EasyR1-shaped run: one cycle (a generation and its 4 optimizer steps) per trainer, completions ended by
    the model's own EOS at different lengths (not all forced to the maximum), tokens counted per cycle."""
    out = tmp_path / "shape.json"
    shape = "easyr1_geo3k:prompts=4,image_size=56,max_completion=24,mean_completion=6,micro_batch=5"
    argv = ["--preset", "tiny", "--device", "cpu", "--shape", shape, "--steps", "1", "--warmup", "0", "--out", str(out)]
    run_main("bench_grpo.py", argv, tmp_path, monkeypatch)
    result = capsys.readouterr()
    assert "counted as EasyR1 counts them" in result.out
    assert result.out.count("[cycle] ") == 2  # one cycle per trainer, printed as it ends
    payload = json.loads(out.read_text())
    assert payload["shape"]["prompts"] == 4 and payload["shape"]["updates"] == 4
    assert [r["trainer"] for r in payload["results"]] == ["vanilla", "ours"]
    for r in payload["results"]:
        assert r["status"] == "ok" and len(r["cycle_times_s"]) == 1 and len(r["step_times_s"]) == 4
        stats = r["completion_stats"]
        assert stats["n"] == 20  # 4 prompts x G=5, each row counted once over the 4 micro-batch groups
        assert 2 <= stats["mean"] <= 14 and stats["p50"] < stats["max"] <= 24, stats  # geometric, mean ~6
        assert r["tokens_per_s"] == pytest.approx((r["prompt_tokens"] + r["completion_tokens"]) / r["step_s"], 0.01)
        assert r["completion_tokens"] == pytest.approx(stats["mean"] * 20, abs=1)
        for span in ("first_step", "run"):  # start-up counts: nothing compiled on CPU, no graph captured
            assert r["startup"][span]["fxgraph_cache_miss"] == 0 and r["startup"][span]["decode_captures"] == 0
    assert payload["results"][0]["decode_cache_gib"] is None and payload["results"][1]["decode_cache_gib"] > 0
    ours, vanilla = payload["results"][1]["packed_tokens"], payload["results"][0]["packed_tokens"]
    assert ours["old_ref_ran"] < ours["old_ref_layout"] == vanilla["old_ref_ran"]  # each rollout at its own length
    assert result.out.count(" ours: log-prob passes ran") == 2  # as the run ends, and in the summary


def test_shape_eos_bias_sets_the_stop_probability():
    """The calibrated EOS bias makes EOS about 1/mean of the sampled mass; without it EOS is ~1/vocab (control)."""
    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from bench_shape import calibrated_bias, install_eos_bias, parse_shape
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    from vlm_grpo.testing.tiny import build_model

    model, _ = build_model("tiny_qwen2_5_vl", dtype=torch.float32)
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(1))

    def p_eos() -> float:
        with torch.no_grad():
            return float(model(input_ids=ids).logits.softmax(-1)[..., eos].mean())

    assert p_eos() < 0.01  # control: the random model alone almost never stops
    install_eos_bias(model, eos, mean=20)
    assert 0.8 / 20 < p_eos() < 1.25 / 20
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # the tie is kept
    assert install_eos_bias(model, eos, mean=20, bias=1.25) == 1.25  # a given bias is installed as it is
    assert float(model.get_output_embeddings().bias[eos]) == 1.25
    # Spread log-odds: the average stop probability is what sets a geometric mean length, not the median's.
    spread = torch.tensor([-9.0, -6.0, -3.0])
    b = calibrated_bias(spread, 1 / 500)
    assert float(torch.sigmoid(spread + b).mean()) == pytest.approx(1 / 500, rel=1e-6)
    from_median = math.log((1 / 500) / (1 - 1 / 500)) - float(spread.median())
    assert float(torch.sigmoid(spread + from_median).mean()) > 1.5 / 500  # control: the median's bias stops early
    with pytest.raises(SystemExit, match="must split into 4 updates"):
        parse_shape("easyr1_geo3k:prompts=3")
    with pytest.raises(SystemExit, match="'bogus' is not a shape field"):
        parse_shape("easyr1_geo3k:bogus=1")


def test_shape_stop_rate_reads_each_row_to_its_first_eos():
    """The stop rate is the rows that ended over the tokens sampled; the padding after an EOS may be an EOS id too,
    and a row without one counts its full budget (cut, not ended)."""
    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from bench_shape import stop_rate
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    eos, pad = 7, 8  # both end a row (Qwen's generation config lists <|im_end|> and the padding <|endoftext|>)
    ids = torch.tensor([[1, 2, eos, pad, pad, pad], [3, pad, pad, pad, pad, pad], [1, 1, 1, 1, 1, 1]])
    rate, lengths = stop_rate(ids, {eos, pad}, max_completion=6)
    assert lengths == [3, 2, 6] and rate == pytest.approx(2 / 11)
    assert stop_rate(ids[2:], {eos, pad}, 6)[0] == pytest.approx(0.5 / 6)  # none ended: half a stop, not zero


def test_shape_eos_bias_is_corrected_by_the_first_generation(tmp_path, monkeypatch):
    """The bias calibrated on random ids can miss the model's own stop rate: after the warm-up cycle the bias moves so
    that the measured cycle's lengths have the asked mean. Here the calibration is made to aim 4x too long (the first
    cycle's mean ~48 for an asked 12); the measured cycle comes back near 12. Control: the same bias fixed with
    --eos_bias (as the warm and vanilla runs take the cold run's) is not corrected, and its lengths stay long."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import bench_shape

    real = bench_shape.calibrated_bias
    monkeypatch.setattr(bench_shape, "calibrated_bias", lambda log_odds, p: real(log_odds, p / 4))
    shape = "easyr1_geo3k:prompts=8,generations=4,image_size=56,max_completion=96,mean_completion=12,micro_batch=2"
    base = ["--preset", "tiny", "--device", "cpu", "--trainers", "ours", "--shape", shape, "--warmup", "1"]

    def run(name: str, *extra: str) -> dict:
        out = tmp_path / f"{name}.json"
        run_main("bench_grpo.py", [*base, "--steps", "1", "--out", str(out), *extra], tmp_path, monkeypatch)
        return json.loads(out.read_text())["results"][0]

    corrected = run("corrected")
    bias = corrected["eos_bias"]
    assert bias["first_mean"] > 30 and bias["corrected"] > bias["installed"] + 1, bias  # ~log(4) more likely to stop
    assert corrected["completion_stats"]["n"] == 32  # the measured cycle's rows only
    assert 6 <= corrected["completion_stats"]["mean"] <= 20, corrected["completion_stats"]
    printed = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_shape.py"), "--bias_of", str(tmp_path / "corrected.json")],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert float(printed) == pytest.approx(bias["corrected"])  # what shape_run.sh hands the warm and vanilla runs
    fixed = run("fixed", "--eos_bias", repr(bias["installed"]))
    assert "corrected" not in fixed["eos_bias"] and fixed["completion_stats"]["mean"] > 25, fixed["eos_bias"]


def test_warm_start_micro_runs_a_cold_and_a_warm_process(tmp_path):
    """The decode warm-start benchmark's plumbing (uncompiled here: CPU compilation takes minutes): two processes on
    one cache folder, each with both calls and the start-up counts; the windowed cache grows and narrows."""
    out = tmp_path / "warm.json"
    cmd = [
        sys.executable, str(REPO / "benchmarks" / "micro" / "warm_start_micro.py"), "--preset", "tiny",
        "--device", "cpu", "--unique", "4", "--group", "3", "--prompt_len", "20", "--max_new_tokens", "24",
        "--mean", "6", "--compile", "false", "--windows_on_cpu", "true", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    payload = json.loads(out.read_text())
    for name in ("cold", "warm"):
        run = payload[name]
        assert run["startup"]["dynamo_graphs"] == 0 and run["startup"]["decode_warmups"] >= 1, run["startup"]
        assert len(run["calls"]) == 2 and all(c["peak_cache_gib"] > 0 for c in run["calls"])
    assert "warm_start_s" in payload and payload["args"]["compile"] is False
