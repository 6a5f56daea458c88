"""One log-prob pass over a multi-turn tool batch: the packed pass (``share_prompt``) against TRL's per-row pass.

A tiny model of each family asked for, 2 prompts (one and two images) x G rollouts from TRL's tool loop with a
scripted policy: per group a third of the rollouts zoom twice, a third answer at once, a third fail a call and
then zoom (``zoom_in`` views of ``--view`` px). Times the no-grad pass (old / reference log-probs) and the
training pass (forward + backward), the two paths alternated, best (and median) of ``--repeats``, and counts
what the vision tower and the decoder are given. CPU; the numbers say how much work each path does, not how fast
a GPU runs it.

    PYTHONPATH=src python benchmarks/micro/multiturn_logps_micro.py --families qwen2_5_vl internvl --G 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

from vlm_grpo.configs import VLMGRPOConfig
from vlm_grpo.data import prepare_rows, read_rows, to_datasets
from vlm_grpo.modules import get_vlm_module
from vlm_grpo.testing.tiny import FAMILIES, build_tiny_model
from vlm_grpo.trainer import VLMGRPOTrainer

BOX = {"qwen2_5_vl": [4, 4, 28, 28]}  # Qwen2.5-VL: pixels of the resized image; the others 0-1000
ANSWER = "<answer>1</answer><|im_end|>"


def write_rows(root: Path) -> Path:
    gen = torch.Generator().manual_seed(0)
    for name, (w, h) in (("a.png", (64, 48)), ("b.png", (56, 90))):
        Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8).numpy()).save(root / name)

    def row(images, question):
        return {"image": images, "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": "1"}]}

    rows = [row("a.png", "<image>Red?"), row(["a.png", "b.png"], "Compare <image> with <image>: which is larger?")]
    (root / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "rows.jsonl"


def scripted(family: str):
    box = BOX.get(family, [100, 100, 500, 500])
    call = f"<tool_call>\n{json.dumps({'name': 'zoom_in', 'arguments': {'bbox_2d': box}})}\n</tool_call><|im_end|>"
    bad = call.replace(json.dumps(box), "[50, 50, 10, 10]")
    state = {"round": 0}

    def turn(self, prompt_ids, images, fields, num_generations, has_tool_images=False):
        encode = self._tokenizer.encode
        if num_generations > 1:
            state["round"] = 0
            return [encode([call, ANSWER, bad][i % 3], add_special_tokens=False) for i in range(len(prompt_ids))], None
        state["round"] += 1
        text = call if state["round"] == 1 else ANSWER
        return [encode(text, add_special_tokens=False) for _ in prompt_ids], None

    return turn


def make_batch(family: str, root: Path, G: int, view: int):
    model_dir = build_tiny_model(family, root / family)
    module = get_vlm_module(str(model_dir))
    processor = module.load_processor(str(model_dir))
    model = module.load_model(str(model_dir), dtype=torch.float32)
    rows, bad = read_rows([str(write_rows(root))], task_type="raw")
    dataset, _ = to_datasets(prepare_rows(rows, bad, module, processor), module)
    args = VLMGRPOConfig(
        output_dir=str(root / "out"), per_device_train_batch_size=2 * G, num_generations=G,
        max_completion_length=2048, max_tool_calling_iterations=3, report_to="none", gradient_checkpointing=False,
    )  # fmt: skip
    trainer = VLMGRPOTrainer(
        model=model, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)], args=args,
        vlm_module=module, processing_class=processor, train_dataset=dataset,
        tools=["zoom_in"], tool_kwargs={"zoom_in": {"size": view}},
    )  # fmt: skip
    trainer.model.eval()
    original = VLMGRPOTrainer._generate_single_turn
    VLMGRPOTrainer._generate_single_turn = scripted(family)
    try:
        batch = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    finally:
        VLMGRPOTrainer._generate_single_turn = original
    return trainer, batch


def one_pass(trainer, batch, share: bool, grad: bool) -> float:
    trainer.args.share_prompt = share
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    keys = ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids", "token_type_ids")
    mm = {k: batch[k] for k in keys if batch.get(k) is not None}
    width = batch["completion_ids"].size(1)
    start = time.perf_counter()
    with torch.set_grad_enabled(grad):
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, mask, width, **mm)
        if grad:
            (logps * batch["completion_mask"]).sum().backward()
    elapsed = time.perf_counter() - start
    trainer.model.zero_grad(set_to_none=True)
    return elapsed


def measure(family: str, root: Path, G: int, view: int, repeats: int) -> dict:
    trainer, batch = make_batch(family, root, G, view)
    tower = dict(trainer.model.named_modules())[trainer.vlm_module.vision_prefixes[0]]
    decoder = trainer.model.get_decoder()
    counts = {"vision_rows": 0, "decoder_tokens": 0}

    def vision(m, args, kwargs, out):
        counts["vision_rows"] += (args[0] if args else kwargs["pixel_values"]).shape[0]

    def text(m, args, kwargs, out):
        embeds = kwargs.get("inputs_embeds")
        counts["decoder_tokens"] += embeds.shape[0] * embeds.shape[1]

    hooks = [tower.register_forward_hook(vision, with_kwargs=True)]
    hooks.append(decoder.register_forward_hook(text, with_kwargs=True))
    result = {
        "family": family, "G": G, "rows": batch["completion_ids"].size(0), "view_px": view,
        "prompt_width": batch["prompt_ids"].size(1), "completion_width": batch["completion_ids"].size(1),
        "images": sum(batch["num_images"]), "device": "cpu", "threads": torch.get_num_threads(),
    }  # fmt: skip
    for grad in (False, True):
        kind = "train" if grad else "nograd"
        times: dict[str, list[float]] = {"trl": [], "packed": []}
        for share in (False, True):  # warm-up, and the work each path does
            one_pass(trainer, batch, share, grad)
            counts.update(vision_rows=0, decoder_tokens=0)
            one_pass(trainer, batch, share, grad)
            name = "packed" if share else "trl"
            result[f"{name}_vision_rows"] = counts["vision_rows"]
            result[f"{name}_decoder_tokens"] = counts["decoder_tokens"]
        for _ in range(repeats):  # alternated, so both paths see the same machine load
            for share in (False, True):
                times["packed" if share else "trl"].append(one_pass(trainer, batch, share, grad))
        for name, values in times.items():
            result[f"{name}_{kind}_ms"] = round(1000 * min(values), 1)
            result[f"{name}_{kind}_median_ms"] = round(1000 * statistics.median(values), 1)
        result[f"speedup_{kind}"] = round(result[f"trl_{kind}_ms"] / result[f"packed_{kind}_ms"], 2)
    for hook in hooks:
        hook.remove()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--G", type=int, default=8, help="rollouts per prompt")
    parser.add_argument("--view", type=int, default=112, help="longer side of each zoom_in view (px)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="also write the results (a JSON list) here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            results.append(measure(family, Path(tmp), args.G, args.view, args.repeats))
            print(json.dumps(results[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
