"""The decode step's token selection (``decode_select.Selection.select``), captured in a CUDA graph as the decode
step captures it: eager (torch.softmax and torch.multinomial) and through inductor
(``compiled_select``, the draw spelled out as ``sample_one``, as a compiled step runs it now). us per token, and
whether the compiled selection's tokens are the eager one's under one seed. 16 rows x Qwen2.5's vocabulary, fresh
logits each token (not in L2); ``--processors tuned`` adds temperature, top-k and top-p."""

from __future__ import annotations

import argparse
import json

import torch
from skinny_linear_micro import graph_us
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from vlm_grpo.fastpath.decode_select import InStep, Selection

PROFILE = False
VARIANTS = ("eager", "compiled")
PROCESSORS = {
    "none": list,  # TRL's defaults (temperature 1, no top-k / top-p): no processor
    "tuned": lambda: [TemperatureLogitsWarper(0.7), TopKLogitsWarper(50), TopPLogitsWarper(0.9)],
}


def run(variant: str, rows: int, vocab: int, tokens: int, processors: str) -> tuple[float, torch.Tensor]:
    dev = torch.device("cuda")
    sel = Selection(rows, 16 + tokens + 1, 1, dev)

    class Config:  # the generation config's special tokens, as generate prepares them
        _eos_token_tensor = torch.tensor([vocab - 1], device=dev)
        _pad_token_tensor = torch.tensor(0, device=dev)

    procs = LogitsProcessorList(PROCESSORS[processors]())
    prompt = torch.zeros(rows, 16, dtype=torch.long, device=dev)
    g = torch.Generator(device=dev).manual_seed(1)
    logits = [torch.randn(rows, vocab, device=dev, generator=g).to(torch.bfloat16) for _ in range(tokens)]
    tok = torch.zeros(rows, 1, dtype=torch.long, device=dev)
    pos = torch.zeros(1, 1, dtype=torch.long, device=dev)
    mask = torch.zeros(rows, 1, 1, 16 + tokens + 1, device=dev)
    sel.load(prompt, 16, Config, procs)
    step = InStep(sel, mask, 0.0, True, tok, pos, compile=variant == "compiled")

    def every_token() -> None:
        sel.load(prompt, 16, Config, procs)  # the column restarts
        for t in range(tokens):
            step.after(logits[t])

    torch.manual_seed(7)  # both variants draw the same numbers of the same sizes from here: their tokens compare
    us = graph_us(every_token, tokens)  # two warm-ups, a capture, 20 replays
    torch.cuda.synchronize()
    out = sel.out[:, 16 : 16 + tokens].clone()  # the last replay's
    if PROFILE:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            every_token()  # the kernels a replay runs, launched one by one
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70)
        print(variant, processors, table)
    return us, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--out", default=None)
    p.add_argument("--processors", nargs="+", default=list(PROCESSORS), choices=list(PROCESSORS))
    p.add_argument("--profile", action="store_true", help="print the kernels of one replay per variant")
    a = p.parse_args()
    global PROFILE
    PROFILE = a.profile
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": a.rows}
    for processors in a.processors:
        first = None
        for variant in VARIANTS:
            us, out = run(variant, a.rows, a.vocab, a.tokens, processors)
            first = out if first is None else first
            row = {"us_per_token": round(us, 1), "same_tokens_as_eager": (out == first).float().mean().item()}
            result[f"{processors}/{variant}"] = row
            print(processors, variant, row, flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
