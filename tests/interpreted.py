"""Running Triton kernels on CPU in subprocesses, through Triton's interpreter.

``TRITON_INTERPRET=1`` is read when kernels are defined, and must not leak into the session's other tests: the
code runs in subprocesses, side by side (the interpreter is slow, and CI has two cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def python_runs(code: str, runs: list[tuple[str, ...]], interpret: bool) -> list[str]:
    """``code`` in one subprocess per argument tuple, all at once; their standard outputs."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    if len(runs) > 1:
        env["OMP_NUM_THREADS"] = "1"  # one core each: the runs go side by side
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for args in runs
    ]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-4000:]
        outputs.append(out)
    return outputs


def python_run(code: str, *args: str, interpret: bool) -> str:
    return python_runs(code, [args], interpret=interpret)[0]


# fast_decode's sampled tokens against generate's under one seed, per family (argv[1]: {family: checkpoint}), two
# prompts, one left-padded, two samples each. ``{setup}`` patches a kernel in: it defines ``calls`` (the patched
# kernel appends to it) and ``broken`` (while non-empty, the kernel's output is negated: the control).
_DECODE_PARITY = r"""
import json, sys
import torch
from transformers import DynamicCache
from vlm_grpo.fastpath import decode
from vlm_grpo.fastpath.sharing import _generation_positions, _next_positions
from vlm_grpo.modules import get_vlm_module
from vlm_grpo.utils import peft_base

{setup}

def run(model, seed):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(100, 1000, (2, 18), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a left-padded row
    index = torch.arange(2).repeat_interleave(2)
    base = peft_base(model)
    config = base.generation_config
    config.do_sample, config.max_new_tokens, config.min_new_tokens = True, 4, 4
    config.temperature, config.top_k, config.top_p, config.repetition_penalty = 1.0, 0, 1.0, 1.0
    with torch.no_grad():
        cache = DynamicCache(config=base.config)
        prefill = {{"attention_mask": mask[:, :-1]}}
        positions = _generation_positions(base, ids[:, :-1], prefill)
        if positions is not None:
            prefill["position_ids"] = positions
        model(input_ids=ids[:, :-1], **decode.cache_kwarg(model, cache), use_cache=True, **prefill)
        backbone = getattr(base, "model", base)
        nxt = _next_positions(positions, getattr(backbone, "rope_deltas", None))
        torch.manual_seed(seed)
        ours = decode.fast_decode(model, cache, index, ids[index], mask[index], nxt, config, use_graph=False)
        torch.manual_seed(seed)
        plain = model.generate(input_ids=ids[index], attention_mask=mask[index], generation_config=config)
    return ours.tolist(), plain[:, ids.size(1):].tolist()

results = {{}}
for family, path in json.loads(sys.argv[1]).items():
    model = get_vlm_module(path).load_model(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    before = len(calls)
    ours, plain = run(model, seed=3)
    results[family] = {{"equal": ours == plain, "kernel_calls": len(calls) - before,
                       "distinct": len({{t for row in ours for t in row}}),
                       "extra": extra(calls[before:]) if "extra" in globals() else None}}
    if family == "qwen2_5_vl":  # control: the kernel's output negated must change the tokens
        broken.append(True)
        control = run(model, seed=3)
        broken.clear()
        results["control_negated_equal"] = control[0] == control[1]
print(json.dumps(results))
"""


def check_decode_parity(setup: str, tiny_models) -> dict[str, dict]:
    """``fast_decode`` with the kernel ``setup`` patches in (interpreted) samples ``generate``'s tokens in every
    family, the kernel ran in each, and its output negated changes the tokens (so the comparison sees it). Returns
    the per-family results; ``extra``: what ``setup``'s ``extra(calls)`` made of the family's calls, if defined."""
    from vlm_grpo.testing.tiny import FAMILIES

    halves = [FAMILIES[: len(FAMILIES) // 2], FAMILIES[len(FAMILIES) // 2 :]]
    runs = [(json.dumps({family: str(tiny_models[family]) for family in half}),) for half in halves]
    results = {}
    for out in python_runs(_DECODE_PARITY.format(setup=setup), runs, interpret=True):
        results.update(json.loads(out.strip().splitlines()[-1]))
    assert results.pop("control_negated_equal") is False
    assert set(results) == set(FAMILIES)
    for family, result in results.items():
        assert result["kernel_calls"] > 0, family
        assert result["equal"], (family, result)
        assert result["distinct"] > 2, (family, result)
    return results
