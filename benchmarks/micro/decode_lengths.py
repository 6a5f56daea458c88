"""Time ``fast_decode`` over a sequence of prompt lengths: what a new length costs, what a repeat costs.

    python benchmarks/micro/decode_lengths.py --preset qwen2_5_vl_3b --device cuda --mode bucket_static
    python benchmarks/micro/decode_lengths.py --preset tiny --device cpu --new_tokens 4     # smoke test

Each call prefills ``--unique`` random text prompts of one length (no padding), then decodes
``--unique`` x G rows for ``--new_tokens`` forced tokens through ``fast_decode`` (the path the trainer
uses), and records its wall time and the compilations dynamo made during it. ``--mode``:
``old`` cache length = prompt + new tokens (the code before cache buckets); ``bucket_dynamic`` bucketed
cache lengths, default ``torch.compile``: a second bucket recompiles once with dynamic shapes (the
package's default); ``bucket_static`` bucketed lengths, ``dynamic=False``: one compilation per bucket.
Run each mode in its own process: dynamo's caches are per process. Also reports the decode time per
token of the repeat calls and its ratio to the HBM floor (language-model weights read once per token).
``--attention_window N [M ...]``: the decode's attention windows (``decode.ATTENTION_WINDOW``; 0: one window
over the whole cache, the behaviour before windows); ``capture_s`` sums every window's warm-up + capture.
Several values compare them in one process, on one model: each prompt length is decoded once per value, in
turn, and ``by_window`` has each value's medians (the top-level ones are the first value's). A value's first
call compiles its own variant of the step (windows mark the mask's length dynamic); calls that compiled are
left out of the medians. ``--cast_head true false`` does the same for the LM head's bf16 copy under
``--fp32_autocast`` (false: the head cast at every step); with ``--greedy true`` the
summary's ``agreement_with_first_variant`` says how many tokens and rows the variants share. ``--profile FILE``
profiles the last call (its top kernels, and their time by kind per token); ``--trace FILE`` also writes its
Chrome trace (each kernel of each token in order: where a token's time goes, launch gaps included).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_common.py is in benchmarks/

import torch
from bench_common import device_defaults, flag_bool, run_stamp
from bench_policy import WHOLE_K_DOWN, decode_weight_bytes, hbm_bandwidth

CAPTURES: list[float] = []  # seconds of each CUDA-graph warm-up + capture (once per window of a fast_decode call)


def prefilled(model, ids: torch.Tensor, autocast: tuple | None = None) -> tuple:
    """The cache of ``ids[:, :-1]`` (one prefill, as the shared prefill runs it) and each row's next rotary position:
    what ``fast_decode`` starts from."""
    from transformers import DynamicCache

    from vlm_grpo.fastpath import decode
    from vlm_grpo.fastpath.sharing import _generation_positions, _next_positions
    from vlm_grpo.utils import peft_base

    base = peft_base(model)
    cache = DynamicCache(config=model.config)
    prefill = {"attention_mask": torch.ones_like(ids)[:, :-1]}
    positions = _generation_positions(base, ids[:, :-1], prefill)
    if positions is not None:
        prefill["position_ids"] = positions
    with torch.autocast(*autocast) if autocast else contextlib.nullcontext():
        model(input_ids=ids[:, :-1], **decode.cache_kwarg(model, cache), use_cache=True, **prefill)
    return cache, _next_positions(positions, getattr(getattr(base, "model", base), "rope_deltas", None))


def configure(mode: str, compile_mode: str | None = None) -> None:
    import vlm_grpo.fastpath.decode as decode

    if mode == "old":
        decode.CACHE_BUCKET = 1
    if mode == "bucket_static" or compile_mode:
        dynamic = False if mode == "bucket_static" else None
        decode._compiled_forward = torch.compile(decode._decode_forward, dynamic=dynamic, mode=compile_mode)
    capture = decode._Step._capture
    if getattr(capture, "timed", False):
        return  # main() ran before in this process: timed already

    def timed_capture(self, *model) -> None:  # the fixed cost of a call, measured here rather than in the package
        torch.cuda.synchronize()
        start = time.perf_counter()
        capture(self, *model)
        torch.cuda.synchronize()
        CAPTURES.append(time.perf_counter() - start)

    timed_capture.timed = True
    decode._Step._capture = timed_capture


def set_inductor(settings: list[str]) -> None:
    """``KEY=VALUE`` pairs into ``torch._inductor.config`` (values as Python literals; a bare word stays a string)."""
    import ast

    import torch._inductor.config as inductor

    for item in settings:
        name, _, text = item.partition("=")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        setattr(inductor, name, value)  # an unknown name raises AttributeError here, before any model is built


class Variant(NamedTuple):
    """One combination of the switches a call runs under: its fields are :func:`one_call`'s keywords and the keys
    of the call records."""

    attention_window: int | None
    cast_head: bool
    keep: bool
    select_in_graph: bool
    attention_kernel: bool
    compile_select: bool
    mlp_kernel: bool
    shared_prompt: bool
    down_slices: bool


# The switches a Variant varies besides the window: (default, what true means, what false means).
SWITCHES = {
    "cast_head": (True, "with --fp32_autocast: the LM head as a bf16 copy made once per call (the package's)",
                  "cast at every step (before)"),
    "keep": (False, "fast_decode's keep (keep_decode_graphs): the workspace and its CUDA graphs kept from call to "
             "call", "not kept (a call not kept leaves the kept state alone)"),
    "select_in_graph": (True, "the next token chosen inside the decode graph (the package's)", "after each replay"),
    "attention_kernel": (True, "the decode attention as the Triton flash-decoding kernel (the package's, on a GPU)",
                         "two matmuls and a softmax"),
    "compile_select": (True, "a compiled step's in-graph token selection through torch.compile (the package's)",
                       "eagerly"),
    "mlp_kernel": (True, "the decode MLP as two Triton kernels (the package's, on a GPU, up to 32 rows)",
                   "the fused gate|up GEMM, SiLU and down"),
    "shared_prompt": (True, "the G rows of a prompt read its K/V slots from one row in the attention kernel (the "
                      "package's)", "each row its own copy"),
    "down_slices": (True, "the decode MLP's down kernel over slices of K, fp32 partial sums added by the next kernel "
                    "(the package's)", "16 columns per program over the whole K"),
}  # fmt: skip
assert tuple(SWITCHES) == Variant._fields[1:], "a Variant field without its switch, or the order differs"


def one_call(
    model, gen_config, prompt_len: int, unique: int, group: int, device, compile: bool, seed: int, fuse: bool = True,
    attention_window: int | None = None, autocast: tuple[str, torch.dtype] | None = None, cast_head: bool = True,
    keep: bool = False, select_in_graph: bool = True, attention_kernel: bool = True, compile_select: bool = True,
    mlp_kernel: bool = True, shared_prompt: bool = True, down_slices: bool = True,
):  # fmt: skip
    """Prefill ``unique`` prompts of ``prompt_len`` tokens, decode ``unique * group`` rows; (seconds, token ids).
    ``attention_window``: ``decode.ATTENTION_WINDOW`` for this call (None: the package's). ``autocast``: the
    prefill runs under it and the decode enters it, as the trainer's do under ``--bf16`` with fp32 weights.
    ``cast_head`` False: the LM head runs as itself (under that autocast: cast at every step, as before it had a
    stand-in). ``keep``: fast_decode's (the workspace and its graphs kept for the next call). ``select_in_graph``:
    ``decode.SELECT_IN_GRAPH`` for this call (False: the next token is chosen after each replay). The sampler is
    seeded with ``seed`` before the decode, so the variants of one call draw comparable tokens. ``attention_kernel``:
    ``decode_attention.KERNEL`` for this call (False: the two matmuls of ``one_token_attention``). ``compile_select``:
    ``decode_select.COMPILE`` for this call (False: a compiled step's in-graph selection runs eagerly).
    ``mlp_kernel``: ``decode_mlp.KERNEL`` for this call (False: the MLP as the fused gate|up GEMM and down).
    ``shared_prompt``: ``decode_attention.SHARED_PROMPT`` for this call (False: each row reads its own prompt copy).
    ``down_slices`` False: ``decode_mlp``'s down settings as before the slices (16 columns, 512-column blocks, K
    whole)."""
    from vlm_grpo.fastpath import decode, decode_attention, decode_mlp, decode_select

    g = torch.Generator().manual_seed(seed + prompt_len)
    ids = torch.randint(100, 1000, (unique, prompt_len), generator=g).to(device)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        cache, next_pos = prefilled(model, ids, autocast)
        index = torch.arange(unique, device=device).repeat_interleave(group)
        if device.type == "cuda":
            torch.cuda.synchronize()
        window = decode.ATTENTION_WINDOW
        if attention_window is not None:
            decode.ATTENTION_WINDOW = attention_window
        stand_in, select = decode.stand_in, decode.SELECT_IN_GRAPH
        if not cast_head:
            decode.stand_in = lambda decoder, module: module
        decode.SELECT_IN_GRAPH = select_in_graph
        kernel, decode_attention.KERNEL = decode_attention.KERNEL, attention_kernel
        compiled_select, decode_select.COMPILE = decode_select.COMPILE, compile_select
        mlp, decode_mlp.KERNEL = decode_mlp.KERNEL, mlp_kernel
        shared, decode_attention.SHARED_PROMPT = decode_attention.SHARED_PROMPT, shared_prompt
        down = decode_mlp.BN2, decode_mlp.BK2, decode_mlp.DOWN_SLICES
        if not down_slices:
            decode_mlp.BN2, decode_mlp.BK2, decode_mlp.DOWN_SLICES = WHOLE_K_DOWN
        torch.manual_seed(seed)
        start = time.perf_counter()
        try:
            out = decode.fast_decode(
                model, cache, index, ids[index], mask[index], next_pos, gen_config,
                use_graph=device.type == "cuda", compile=compile, fuse=fuse, autocast=autocast, keep=keep,
            )  # fmt: skip
            if device.type == "cuda":
                torch.cuda.synchronize()
        finally:
            decode.ATTENTION_WINDOW, decode.stand_in, decode.SELECT_IN_GRAPH = window, stand_in, select
            decode_attention.KERNEL, decode_select.COMPILE, decode_mlp.KERNEL = kernel, compiled_select, mlp
            decode_attention.SHARED_PROMPT = shared
            decode_mlp.BN2, decode_mlp.BK2, decode_mlp.DOWN_SLICES = down
    return time.perf_counter() - start, out


def _kind(name: str) -> str:
    """A kernel's kind by its name (inductor names a fused kernel after its ops: one that fused an attention op's
    inputs counts as attention)."""
    low = name.lower()
    if "nvjet" in low or "gemm" in low or "splitk" in low or "cublas" in low:
        return "gemm"
    if "fmha" in low or "attention" in low or "flash" in low or "sdpa" in low:
        return "attention"
    if low.startswith("triton_"):
        return "triton (fused pointwise / norms)"
    if "memset" in low or "memcpy" in low:
        return "memset / memcpy"
    return "other (sampling, eager ops)"


def kernel_kinds(averages, tokens: int) -> dict:
    """GPU time of a profiled call's kernels by kind, in ms per decoded token (the device's own events only: the
    CPU-side aten rows carry their kernels' time too, and would count it twice)."""
    kinds: dict[str, float] = {}
    top: list[tuple[str, float]] = []
    for event in averages:
        if event.device_type != torch.autograd.DeviceType.CUDA or event.self_device_time_total <= 0:
            continue
        ms = event.self_device_time_total / 1e3 / tokens
        kind = _kind(event.key)
        kinds[kind] = kinds.get(kind, 0.0) + ms
        top.append((event.key[:120], ms))
    top.sort(key=lambda kv: -kv[1])
    return {"ms_per_token_by_kind": kinds, "total_ms_per_token": sum(kinds.values()), "top_kernels": top[:25]}


def _timings(calls: list[dict], floor_ms: float | None) -> dict:
    """Medians over the repeat calls (not the first, none that compiled): per token, with and without the graph
    warm-ups and captures, and against the HBM floor."""
    repeats = [c for c in calls[1:] if c["graphs_compiled"] == 0]
    ms_per_token = 1e3 * statistics.median(c["seconds"] / c["tokens"] for c in repeats) if repeats else None
    # The same without the graph warm-ups and captures: the decode loop alone.
    loop_ms = (
        1e3 * statistics.median((c["seconds"] - c["capture_s"]) / c["tokens"] for c in repeats) if repeats else None
    )
    return {
        "decode_ms_per_token": ms_per_token,
        "loop_ms_per_token": loop_ms,
        "capture_s_median": statistics.median(c["capture_s"] for c in repeats) if repeats else None,
        "floor_ratio": ms_per_token / floor_ms if ms_per_token and floor_ms else None,
        "loop_floor_ratio": loop_ms / floor_ms if loop_ms and floor_ms else None,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mode", default="bucket_dynamic", choices=["old", "bucket_dynamic", "bucket_static"])
    p.add_argument(
        "--prompt_lengths", type=int, nargs="+", default=[300, 307, 313, 300, 322, 331, 600, 606, 300, 611],
        help="prompt length of each call, in order",
    )  # fmt: skip
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--unique", type=int, default=2, help="unique prompts per call")
    p.add_argument("--group", type=int, default=8, help="rows per unique prompt (G)")
    p.add_argument("--compile", type=flag_bool, default=None)
    p.add_argument("--fuse", type=flag_bool, default=True, help="fuse q|k|v, gate|up")
    p.add_argument(
        "--attention_window", type=int, nargs="+", default=None,
        help="decode attention window in cache slots (0: off, one window over the whole cache; default: the "
        "package's); several values: each prompt length is decoded once per value, in turn",
    )  # fmt: skip
    for name, (default, on, off) in SWITCHES.items():  # each takes 'true false' too: both, in turn, per length
        p.add_argument(
            f"--{name}", type=flag_bool, nargs="+", default=[default],
            help=f"{on}; false: {off}; 'true false': both, in turn, per prompt length (by_window keys "
            f"'.../{name}=...')",
        )  # fmt: skip
    p.add_argument("--greedy", type=flag_bool, default=False, help="greedy decoding (sampled: seeded per call)")
    p.add_argument("--compile_mode", default=None, help="torch.compile mode of the decode step, e.g. max-autotune")
    p.add_argument(
        "--inductor", nargs="*", default=[], metavar="KEY=VALUE",
        help="torch._inductor.config settings for this process (e.g. combo_kernels=True), set before compiling",
    )  # fmt: skip
    p.add_argument(
        "--profile", default=None,
        help="profile the last call (per window value: .w<N> suffixed when several); its top kernels are written here",
    )  # fmt: skip
    p.add_argument("--trace", default=None, help="with --profile: the profiled call's Chrome trace, written here")
    p.add_argument(
        "--cudnn_sdpa", type=flag_bool, default=False,
        help="leave cuDNN's sdpa kernel on (the trainer turns it off unless cudnn_attention=true)",
    )  # fmt: skip
    p.add_argument(
        "--fp32_autocast", type=flag_bool, default=False,
        help="fp32 weights under a bf16 autocast (--bf16 without DeepSpeed and without --dtype bfloat16)",
    )  # fmt: skip
    p.add_argument("--out", default="decode_lengths.json")
    args = p.parse_args(argv)
    device_defaults(args)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(args.cudnn_sdpa)  # as the trainer does by default
    compile = device.type == "cuda" if args.compile is None else args.compile
    set_inductor(args.inductor)
    configure(args.mode, args.compile_mode)

    from torch._dynamo.utils import counters

    from vlm_grpo.testing.tiny import build_model

    dtype = torch.bfloat16 if device.type == "cuda" and not args.fp32_autocast else torch.float32
    autocast = (device.type, torch.bfloat16) if args.fp32_autocast else None
    model, _ = build_model(args.preset, dtype=dtype, device=device)
    model.eval()
    gen_config = model.generation_config
    gen_config.max_new_tokens = gen_config.min_new_tokens = args.new_tokens
    gen_config.do_sample, gen_config.temperature, gen_config.top_p, gen_config.top_k = not args.greedy, 1.0, 1.0, 0

    choices = {field: getattr(args, field) for field in Variant._fields}
    choices["attention_window"] = args.attention_window or [None]
    for name in ("attention_kernel", "compile_select", "mlp_kernel", "shared_prompt", "down_slices"):
        if len(choices[name]) > 1 and True in args.keep:
            p.error(f"--{name} true false needs --keep false: a kept graph would serve both variants")
    windows = [Variant(*combination) for combination in itertools.product(*choices.values())]
    calls = []
    outputs: dict[tuple, torch.Tensor] = {}
    seen: set[int] = set()
    for n, length in enumerate(args.prompt_lengths):
        for variant in windows:
            before = counters["stats"]["unique_graphs"]
            profiler = None
            if args.profile and n == len(args.prompt_lengths) - 1:
                kinds = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * (
                    device.type == "cuda"
                )
                profiler = torch.profiler.profile(activities=kinds)
                profiler.__enter__()
            captured = len(CAPTURES)
            seconds, out = one_call(
                model, gen_config, length, args.unique, args.group, device, compile, n, args.fuse, autocast=autocast,
                **variant._asdict(),
            )  # fmt: skip
            tokens = out.size(1)
            outputs[(n, variant)] = out.cpu()
            if profiler is not None:
                profiler.__exit__(None, None, None)
                sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
                averages = profiler.key_averages()
                table = averages.table(sort_by=sort, row_limit=40, max_name_column_width=90)
                suffix = f".w{variant.attention_window}{'' if variant.cast_head else '.uncast_head'}"
                suffix += (".kept" if variant.keep else "") + ("" if variant.select_in_graph else ".select_after")
                suffix += "" if variant.attention_kernel else ".matmuls"
                suffix += "" if variant.compile_select else ".eager_select"
                suffix += "" if variant.mlp_kernel else ".mlp_gemms"
                suffix += "" if variant.shared_prompt else ".own_prompt_rows"
                suffix += "" if variant.down_slices else ".down_whole_k"
                suffix = suffix if len(windows) > 1 else ""
                Path(args.profile + suffix).write_text(table)
                if args.trace:
                    profiler.export_chrome_trace(args.trace + suffix)
                if device.type == "cuda":
                    kinds = kernel_kinds(averages, tokens)
                    Path(args.profile + suffix + ".json").write_text(json.dumps(kinds, indent=2))
                    print(f"[profile] {json.dumps(kinds)}", flush=True)
            calls.append(
                {
                    "prompt_len": length, **variant._asdict(), "seconds": seconds,
                    "tokens": tokens,
                    "new_length": length not in seen, "graphs_compiled": counters["stats"]["unique_graphs"] - before,
                    "capture_s": sum(CAPTURES[captured:]), "captures": len(CAPTURES) - captured,
                }
            )  # fmt: skip
            print(f"[call] {json.dumps(calls[-1])}", flush=True)
        seen.add(length)
    weights = decode_weight_bytes(model)
    bandwidth = hbm_bandwidth(args.device)
    floor_ms = 1e3 * weights / bandwidth if bandwidth else None

    def key(variant: Variant) -> str:  # the window, then every switch given more than one value
        varied = [f"{f}={getattr(variant, f)}" for f in Variant._fields[1:] if len(choices[f]) > 1]
        return "/".join([str(variant.attention_window), *varied])

    def of(variant: Variant) -> list[dict]:
        return [c for c in calls if Variant(*(c[f] for f in Variant._fields)) == variant]

    by_window = {key(v): _timings(of(v), floor_ms) for v in windows}
    agreement = None
    if len(windows) > 1:  # each variant's tokens against the first's, per call (same seed per call)
        calls_made = range(len(args.prompt_lengths))
        pairs = [(outputs[(n, windows[0])], outputs[(n, v)]) for n in calls_made for v in windows[1:]]
        agreement = {
            "tokens_equal": sum(int((a == b).sum()) for a, b in pairs) / sum(a.numel() for a, _ in pairs),
            "rows_equal": sum(int((a == b).all(1).sum()) for a, b in pairs) / sum(a.size(0) for a, _ in pairs),
        }
    summary = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        **run_stamp(),
        "args": vars(args),
        "calls": calls,
        "first_call_s": calls[0]["seconds"],
        "total_s": sum(c["seconds"] for c in calls),
        **by_window[key(windows[0])],
        "decode_weight_gb": weights / 1e9,
        "hbm_floor_ms_per_token": floor_ms,
        "by_window": by_window,
        "agreement_with_first_variant": agreement,
    }
    print(json.dumps({k: v for k, v in summary.items() if k not in ("calls", "args")}), flush=True)
    Path(args.out).write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
