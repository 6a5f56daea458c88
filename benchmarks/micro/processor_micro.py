"""What TRL's processor call costs per step, for all of a batch's rows against its distinct ones.

Times a Qwen2.5-VL image processor (patch 14, merge 2, no resize limits) on 16 rows (2 distinct images, 8
copies each, as a GRPO batch of 2 prompts x G=8 holds them) and on the 2 distinct rows, at 448 and 896 px;
then the host-to-device copy of the 16 rows' ``pixel_values`` (pageable and pinned) against the 2 rows'.
What ``process_prompts_once`` saves. Needs no model or
download; run on the device: ``python3 benchmarks/micro/processor_micro.py``.
"""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessor


def _ms(fn, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(round((time.perf_counter() - start) * 1000, 1))
    return times


def main() -> None:
    print("torch threads", torch.get_num_threads(), "cpus", os.cpu_count())
    processor = Qwen2VLImageProcessor(
        patch_size=14, temporal_patch_size=2, merge_size=2, size={"shortest_edge": 3136, "longest_edge": 12845056}
    )
    rng = np.random.default_rng(0)
    for side in (448, 896):
        pictures = [Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)) for _ in range(2)]
        for rows in (16, 2):
            images = [pictures[i * 2 // rows].copy() for i in range(rows)]
            print(side, rows, "rows: processor ms", _ms(lambda images=images: processor(images=images), 5))
        two = processor(images=pictures, return_tensors="pt")["pixel_values"]
        sixteen = two.view(2, -1, two.size(-1)).repeat_interleave(8, 0).flatten(0, 1)
        if torch.cuda.is_available():
            pinned = sixteen.pin_memory()
            for label, rows in (("16 rows pageable", sixteen), ("16 rows pinned", pinned), ("2 rows pageable", two)):
                print(side, label, "-> GPU ms", _ms(lambda rows=rows: rows.to("cuda"), 3))


if __name__ == "__main__":
    main()
