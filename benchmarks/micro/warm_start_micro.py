"""Warm start of the decode alone: the same compiled decode in two fresh processes sharing one compile cache folder.

    python benchmarks/micro/warm_start_micro.py --preset qwen2_5_vl_3b --device cuda --out warm_start.json
    python benchmarks/micro/warm_start_micro.py --preset tiny --device cpu --unique 4 --max_new_tokens 24 \\
        --mean 6 --windows_on_cpu true                                                          # CPU run

Each process builds the model, then decodes the same batch twice (EasyR1's geo3k shape per GPU by default, rows
sampled to geometric lengths, as in ``decode_compact_micro.py``) with the step compiled and, on a GPU, captured in
CUDA graphs: the first call pays tracing, compilation or loading, warm-ups and captures; the second is steady. The
first process starts from an empty folder (cold); the second reads what the first left there (warm). Per process:
both calls' seconds, and ``vlm_grpo.fastpath.startup.report()`` after the first (dynamo graphs and seconds, compile
cache loads and compilations, autotuning, decode warm-ups and captures). The warm start's cost is the warm process's
first call less its second.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_common.py is in benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_common import device_defaults, flag_bool, run_stamp
from decode_compact_micro import shaped_decode_args, shaped_model


def child(args: argparse.Namespace) -> dict:
    """One process: the compile cache pointed at ``args.cache``, two decode calls, the start-up counts."""
    from decode_compact_micro import decode_once

    from vlm_grpo.fastpath import decode, startup
    from vlm_grpo.fastpath.compile_cache import use_compile_cache

    on_gpu = device_defaults(args)
    device = torch.device(args.device)
    use_compile_cache(args.cache, device)
    decode._WINDOWS_WITHOUT_GRAPH = args.windows_on_cpu
    model, config = shaped_model(args, on_gpu, device)
    ids = torch.randint(100, 1000, (args.unique, args.prompt_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    calls = []
    for n in range(2):
        record = decode_once(model, config, ids, args.group, args.compile, compact=True, seed=n)
        del record["tokens"]
        calls.append(record)
        if n == 0:
            first = startup.report()
    return {"first_call_s": calls[0]["seconds"], "second_call_s": calls[1]["seconds"], "startup": first,
            "calls": calls}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shaped_decode_args(p)
    p.add_argument("--compile", type=flag_bool, default=True, help="compile the decode step")
    p.add_argument("--windows_on_cpu", type=flag_bool, default=False, help="attention windows without CUDA graphs")
    p.add_argument("--cache", default=None, help="the compile cache folder (default: a new temporary one)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)), flush=True)
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache or str(Path(tmp) / "compile")
        argv = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--child"]
        runs = {}
        for name in ("cold", "warm"):
            cmd = [sys.executable, __file__, *argv, "--cache", cache, "--child"]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                raise SystemExit(f"error: the {name} process failed:\n{result.stderr[-3000:]}")
            runs[name] = json.loads(result.stdout.strip().splitlines()[-1])
            print(name, json.dumps({k: v for k, v in runs[name].items() if k != "calls"}), flush=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    summary = {**run_stamp(), "device": device, "args": vars(args), **runs}
    summary["warm_start_s"] = runs["warm"]["first_call_s"] - runs["warm"]["second_call_s"]
    summary["cold_start_s"] = runs["cold"]["first_call_s"] - runs["cold"]["second_call_s"]
    print(json.dumps({k: summary[k] for k in ("cold_start_s", "warm_start_s")}))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
