"""What the GRPO training loader costs per generation cycle at EasyR1's shape, images decoded at fetch or deferred.

    python benchmarks/micro/loader_micro.py --out loader.json                     # 64 prompts x 5, 512² PNGs
    python benchmarks/micro/loader_micro.py --prompts 4 --image_size 56 --cycles 1   # smoke test

TRL's loader hands every micro-step a whole generation batch (here 320 rows, 80 micro-steps per cycle) and generates
from one of them. The package's training loader decodes a row's images only for the batch a step generates from
(``vlm_grpo.data.deferred``); a transform that is not exactly ``LazyImageTransform`` is read as it is, which is the
control here (every fetch decodes its batch, as vanilla TRL's datasets do). Host work only: no model runs; the
trainer is built on the tiny Qwen2.5-VL for its loader. Reports seconds per cycle and images decoded per cycle.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench_common.py is in benchmarks/

from bench_common import Scenario, ours_dataset, write_images

import vlm_grpo.data.jsonl as jsonl
from vlm_grpo.configs import VLMGRPOConfig
from vlm_grpo.data.deferred import decode_pending
from vlm_grpo.modules import get_vlm_module
from vlm_grpo.testing.tiny import build_model
from vlm_grpo.trainer import VLMGRPOTrainer


def one_cycle(trainer, steps: int) -> tuple[float, int]:
    """Fetch ``steps`` micro-batches as the Trainer does and decode what the generating one needs; (s, decodes)."""
    counted = {"n": 0}
    real = jsonl.decode_rgb

    def decode_rgb(*args, **kwargs):
        counted["n"] += 1
        return real(*args, **kwargs)

    jsonl.decode_rgb = decode_rgb
    try:
        start = time.perf_counter()
        loader = iter(trainer.get_train_dataloader())
        for step in range(steps):
            batch = next(loader)
            if step == 0:  # the micro-step that generates: its rows' images are decoded now
                decode_pending(batch, trainer._pending_transform)
        return time.perf_counter() - start, counted["n"]
    finally:
        jsonl.decode_rgb = real


def zero_reward(completions, **kwargs) -> list[float]:
    return [0.0] * len(completions)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--generations", type=int, default=5)
    p.add_argument("--image_size", type=int, default=512)
    p.add_argument("--micro_batch", type=int, default=4)
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--out")
    args = p.parse_args(argv)
    rows = args.prompts * args.generations
    steps = rows // args.micro_batch
    workdir = Path(tempfile.mkdtemp(prefix="loader_micro_"))
    model, processor = build_model("tiny_qwen2_5_vl", seed=0)
    module = get_vlm_module("", "qwen2_5_vl")
    processor = module.prepare_processor(processor)
    paths = write_images(workdir, Scenario(args.image_size, 1, 16), args.prompts, seed=0)
    results = {}
    for mode in ("deferred", "decoded_at_fetch"):
        dataset = ours_dataset(paths, workdir, module, processor)
        if mode == "decoded_at_fetch":
            dataset = dataset.with_transform(type("AtFetch", (jsonl.LazyImageTransform,), {})(module))
        config = VLMGRPOConfig(
            output_dir=str(workdir / "out"), per_device_train_batch_size=args.micro_batch,
            num_generations=args.generations, steps_per_generation=steps, report_to="none", use_cpu=True,
        )  # fmt: skip
        trainer = VLMGRPOTrainer(
            model=model, reward_funcs=[zero_reward], args=config, vlm_module=module, processing_class=processor,
            train_dataset=dataset,
        )  # fmt: skip
        times, decodes = zip(*(one_cycle(trainer, steps) for _ in range(args.cycles)), strict=True)
        results[mode] = {"seconds_per_cycle": statistics.median(times), "times": times, "images_decoded": decodes[0]}
        print(f"{mode}: {statistics.median(times):.2f} s per cycle ({steps} fetches of {rows} rows), "
              f"{decodes[0]} images decoded")  # fmt: skip
    out = {"args": vars(args), "rows_per_fetch": rows, "fetches_per_cycle": steps, "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
