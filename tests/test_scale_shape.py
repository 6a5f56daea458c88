"""benchmarks/scale_out.py --shape: the EasyR1-shaped cycle on every rank through grpo_jsonl.py's own flags, with
natural (EOS-ended) completion lengths and tokens counted as EasyR1 counts them; --merge of two commands' results
(the 1-GPU and 2-GPU runs made at the same time on different GPUs) into one weak-scaling summary."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
# Per rank and cycle: 2 prompts x G=4 = 8 rows, 2 optimizer steps of 4 rows in micro-batches of 2; EOS mean 12.
TINY_SHAPE = (
    "easyr1_geo3k:prompts=2,generations=4,image_size=56,max_completion=64,mean_completion=12,micro_batch=2,updates=2"
)


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"_test_shape_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


driver = load("scale_out")


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(f"--{name}") + 1]


def test_the_geo3k_shape_becomes_the_cli_flags_a_user_passes():
    """EasyR1's geo3k per GPU: micro-batch 4, 80 rows per optimizer step, 320 rows per generation, 2 cycles of 4
    optimizer steps (cold + measured), no forced length."""
    args = driver.parse(["--plan", "zero2", "--shape", "easyr1_geo3k", "--nproc", "2"])
    argv = driver.grpo_argv(args, "zero2", Path("m"), Path("d.jsonl"), Path("o"))
    got = {k: flag(argv, k) for k in ("per_device_train_batch_size", "gradient_accumulation_steps")}
    got |= {k: flag(argv, k) for k in ("steps_per_generation", "num_generations", "max_completion_length")}
    assert got == {
        "per_device_train_batch_size": "4",
        "gradient_accumulation_steps": "20",
        "steps_per_generation": "80",
        "num_generations": "5",
        "max_completion_length": "2048",
    }
    assert flag(argv, "max_steps") == "8" and "--generation_kwargs" not in argv  # no min_new_tokens
    assert (args.prompts_per_device, args.image_size, args.profile, args.nproc) == (64, 512, False, [2])
    assert args.timeout == args.budget_s  # one run may use the whole budget
    shape_module = load("scale_shape")
    assert shape_module.spec(args.shape_def, args.eos_bias)["eos_bias"] is None  # each rank calibrates
    fixed = driver.parse(["--plan", "zero2", "--shape", "easyr1_geo3k", "--eos_bias", "2.5"])
    assert shape_module.spec(fixed.shape_def, fixed.eos_bias)["eos_bias"] == 2.5  # the worker installs it as given
    # Without a shape: the forced-length small step, as before.
    plain = driver.parse(["--plan", "zero2"])
    argv = driver.grpo_argv(plain, "zero2", Path("m"), Path("d.jsonl"), Path("o"))
    assert flag(argv, "per_device_train_batch_size") == "16" and "min_new_tokens" in flag(argv, "generation_kwargs")


@pytest.mark.parametrize("extra", [["--image_size", "448"], ["--num_generations", "8"], ["--vary_prompts", "2"]])
def test_a_size_flag_beside_a_shape_is_an_error(extra, capsys):
    with pytest.raises(SystemExit, match=r"error: --shape easyr1_geo3k sets the per-GPU sizes; drop --"):
        driver.parse(["--plan", "zero2", "--shape", "easyr1_geo3k", *extra])


def shaped_run(nproc: int, cycle_s: float, tokens_per_gpu: float, **extra) -> dict:
    return {
        "name": f"zero2_easyr1_geo3k_n{nproc}_zero2", "ds": "zero2", "plan": "zero2", "nproc": nproc, "status": "ok",
        "step_s": cycle_s, "cycle_s": cycle_s, "first_cycle_s": 100.0, "samples_per_s": nproc * 320 / cycle_s,
        "tokens_per_s_per_gpu": tokens_per_gpu, "phases_s": {"generation": 10.0, "old_ref_logps": 2.0},
        "update_s": 15.0, "peak_alloc_gib": [70.0] * nproc, "completion_stats": {"mean": 500.0, "p50": 350.0,
        "p90": 1150.0, "max": 2048.0}, **extra,
    }  # fmt: skip


def test_merge_two_commands_into_one_weak_scaling_summary(tmp_path, capsys):
    """The 2-GPU command's own summary calls itself the base (100%); merged with the 1-GPU one it is measured
    against that: cycle time 30 / 33 s, tokens/s/GPU 9,000 / 10,000."""
    cmd = "python3 benchmarks/scale_out.py --plan zero2 --shape easyr1_geo3k --nproc "
    one = {"plan": "zero2", "header": "shape easyr1_geo3k", "args": {"nproc": [1]}, "command": cmd + "1", "runs": [
        shaped_run(1, 30.0, 10_000.0, base_nproc=1, weak_efficiency=1.0, speedup=1.0)]}  # fmt: skip
    own = {"base_nproc": 2, "base": "2 GPU", "weak_efficiency": 1.0, "weak_efficiency_tokens": 1.0}
    two = {"plan": "zero2", "header": "shape easyr1_geo3k", "args": {"nproc": [2]}, "command": cmd + "2",
           "runs": [shaped_run(2, 33.0, 9_000.0, **own)]}  # fmt: skip
    paths = [tmp_path / "n2.json", tmp_path / "n1.json"]  # any order
    for path, data in zip(paths, (two, one), strict=True):
        path.write_text(json.dumps(data))
    out = tmp_path / "merged" / "zero2_shape.json"
    driver.main(["--merge", *map(str, paths), "--out", str(out)])
    merged = json.loads(out.read_text())
    n1, n2 = merged["runs"]
    assert (n1["nproc"], n2["nproc"]) == (1, 2) and n2["base_nproc"] == 1 and n2["base"] == "1 GPU"
    assert n2["weak_efficiency"] == pytest.approx(30 / 33) and n2["weak_efficiency_tokens"] == pytest.approx(0.9)
    assert n2["speedup"] == pytest.approx(2 * 30 / 33) and n1["weak_efficiency"] == 1.0
    assert merged["merged_from"] == list(map(str, paths)) and merged["args"] == {"nproc": [1]}  # the base's
    assert merged["command"].splitlines() == [
        cmd + "2",
        cmd + "1",
        f"python3 benchmarks/scale_out.py --merge {paths[0]} {paths[1]} --out {out}",
    ]
    printed = capsys.readouterr().out
    assert "| 2 | zero2 | ok | 100.0 | 33.00 | 9,000 | 19.39 | 91% / 90% (vs 1 GPU) |" in printed
    assert "weak-scaling efficiency 91% in cycle time, 90% in tokens/s/GPU" in printed
    # The merged file is a scale_out table for RESULTS.md.
    tables = load("results_tables")
    assert tables._kind(merged) == "scale_out"
    assert any("91% (vs 1 GPU)" in line for line in tables.scale_out_table(merged))
    shaped = tables.scale_out_table(merged | {"shape": {"prompts": 64}})  # a shaped run's summary: its own table
    assert "| 2 | zero2 | ok | 100.0 | 33.00 | 9,000 | 19.39 | 91% / 90% (vs 1 GPU) |" in shaped[1]


def test_merge_of_files_without_runs_is_an_error(tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"plan": "zero2", "runs": []}))
    with pytest.raises(SystemExit, match=r"error: --merge .*empty.json: no runs in these files"):
        driver.main(["--merge", str(empty), "--out", str(tmp_path / "m.json")])
    with pytest.raises(SystemExit, match=r"error: --merge .*absent.json: .*give scale_out.py's \*_summary.json"):
        driver.main(["--merge", str(tmp_path / "absent.json"), "--out", str(tmp_path / "m.json")])


def independent_prompt_lengths(model_dir: Path, jsonl: Path) -> list[int]:
    """Each JSONL row's tokens through the tiny model's own processor and chat template (not the package's path)."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    out = []
    for line in jsonl.read_text().splitlines():
        row = json.loads(line)
        text = row["conversations"][0]["value"].replace("<image>", "")
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        image = Image.open(row["image"][0]).convert("RGB")
        out.append(len(processor(text=[prompt], images=[image])["input_ids"][0]))
    return out


@pytest.mark.slow  # one torchrun launch of 2 ranks (gloo, ZeRO-3), tiny model: 20-40 s on 2 cores
def test_two_ranks_train_the_shape_with_natural_lengths_and_easyr1_tokens(tmp_path, tiny_models):
    """Under ZeRO-3, as the 7B command runs: each rank's model is loaded partitioned, the EOS bias is calibrated on
    the gathered weights and its new bias partitioned with the rest."""
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    (work / "model_tiny_qwen2_5_vl").symlink_to(tiny_models["qwen2_5_vl"])  # the session's tiny checkpoint
    cmd = [
        sys.executable, str(BENCH / "scale_out.py"), "--plan", "cpu", "--ds", "zero3", "--shape", TINY_SHAPE,
        "--nproc", "2",
        "--work", str(work), "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "cpu_easyr1_geo3k_n2_summary.json").read_text())
    assert summary["shape"]["prompts"] == 2 and "EasyR1" in summary["shape"]["tokens"]
    (run,) = summary["runs"]
    assert run["status"] == "ok" and run["ds"] == "zero3", run["status"]
    assert "--steps_per_generation 4" in run["command"] and "min_new_tokens" not in run["command"]
    # One cold cycle, one measured: the reported cycle is the second.
    assert run["measured_cycles"] == 1 and len(run["cycle_times_s"]) == 2
    assert run["cycle_s"] == pytest.approx(run["cycle_times_s"][1], abs=1e-3)
    assert run["weak_efficiency"] == 1.0 and run["base_nproc"] == 2  # its own base until merged with a 1-GPU run

    rows = 8
    ranks = [json.loads((work / "runs" / run["name"] / f"rank{r}.json").read_text()) for r in (0, 1)]
    lengths = [x for r in ranks for x in r["lengths"]]
    # Natural lengths: the EOS bias (the same on both ranks) ends rows at different steps, mean near 12, cap 64.
    assert ranks[0]["eos_bias"] == ranks[1]["eos_bias"] and ranks[0]["features"]["zero_stage"] == 3
    assert len(lengths) == 2 * 2 * rows and all(1 <= x <= 64 for x in lengths)
    assert len(set(lengths)) >= 5 and 4 <= run["completion_stats"]["mean"] <= 30  # forced to 64: fails
    assert run["completion_stats"]["n"] == len(lengths)

    # EasyR1's tokens: valid prompt + completion tokens of the measured cycle, all ranks, / cycle s / GPUs.
    jsonl = next(work.glob("data_*/rows.jsonl"))
    alone = independent_prompt_lengths(tiny_models["qwen2_5_vl"], jsonl)
    tokens = []
    for r in ranks:
        prompts, completions = r["prompt_lengths"][rows:], r["lengths"][rows:]  # the measured (second) cycle
        # Every row's prompt is one of the data's prompts, plus the same template tokens for all.
        seen = set(r["prompt_lengths"])
        shifts = [c for c in {min(seen) - a for a in alone} if {p - c for p in seen} <= set(alone)]
        assert len(seen) >= 2 and shifts and shifts[0] >= 0, (seen, alone)
        steps = r["steps"][2:4]
        assert sum(s["_prompt_tokens"] for s in steps) == sum(prompts)
        assert sum(s["_completion_tokens"] for s in steps) == sum(completions)
        tokens.append(sum(prompts) + sum(completions))
    padded = sum(rows * max(r["prompt_lengths"][rows:]) for r in ranks)
    assert padded > sum(sum(r["prompt_lengths"][rows:]) for r in ranks)  # padding would count more: the control
    assert run["tokens_per_cycle"] == tokens
    assert run["tokens_per_s_per_gpu"] == pytest.approx(sum(tokens) / run["cycle_s"] / 2, rel=1e-4)
    assert run["samples_per_s"] == pytest.approx(2 * rows / run["cycle_s"], rel=1e-4)
    assert set(run["phases_s"]) >= {"generation", "old_ref_logps", "loss_forward", "backward", "optimizer"}
    assert run["update_s"] > 0 and run["phases_s"]["generation"] > 0
    table = result.stdout
    assert "| 2 | zero3 | ok |" in table and "tokens/s/GPU" in table


def test_the_full_length_decode_cache_is_predicted_from_the_checkpoint_config(tmp_path):
    """Qwen2.5-VL-3B's text model (36 layers, 2 KV heads of 128): 36,864 bytes of bf16 K/V a token; 320 rows of
    324 image + 120 text + 2,048 completion tokens."""
    text = {"num_hidden_layers": 36, "num_key_value_heads": 2, "hidden_size": 2048, "num_attention_heads": 16}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "text_config": text}))
    shape = importlib.import_module("bench_shape").parse_shape("easyr1_geo3k")  # benchmarks/ is on the path
    expected = 36 * 2 * 2 * 128 * 2 * 320 * (18 * 18 + 120 + 2048) / 2**30
    assert driver.scale_shape.kv_cache_gib(tmp_path, shape) == pytest.approx(expected) == pytest.approx(27.4, abs=0.05)
    assert driver.scale_shape.kv_cache_gib(tmp_path / "absent", shape) is None


@pytest.mark.parametrize("module", ["scale_shape", "scale_report"])
def test_the_helpers_import_neither_the_driver_nor_the_worker_nor_torch(module):
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import {0}; "
        "bad = {{'scale_out', 'scale_out_worker', 'torch'}} & set(sys.modules); assert not bad, sorted(bad)"
    )
    result = subprocess.run([sys.executable, "-c", code.format(module), str(BENCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
