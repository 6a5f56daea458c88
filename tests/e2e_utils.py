"""Helpers for end-to-end runs of grpo_jsonl.py on tiny models (in-process or under torchrun), and of the
benchmark scripts in-process."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

REWARD_PLUGIN = '''
from vlm_grpo.rewards import completion_text


def text_shape(completions, **kwargs):
    """Depends on the text, so a group's completions get different rewards (non-zero advantages)."""
    return [float(len(completion_text(c)) % 5) + 0.1 * completion_text(c).count("a") for c in completions]


def flaky(completions, id, **kwargs):
    """Raises on every multi-image row: those samples must get no reward, the others theirs."""
    if any(i.startswith("multi") for i in id):
        raise RuntimeError("flaky reward cannot score multi-image rows")
    return [1.0 for _ in completions]
'''


def make_dataset(root: Path, kinds: tuple[str, ...] = ("single", "multi"), n: int = 4) -> tuple[Path, Path]:
    """A small JSONL set (VLM-R1 format) of ``single``-image rows, ``multi``-image rows with mid-text
    ``<image>`` markers, and ``text``-only rows; ``n`` rows of each kind asked for."""
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    colors = [(220, 30, 30), (30, 200, 30), (30, 30, 220), (220, 220, 30)]
    for i, color in enumerate(colors):
        img = Image.new("RGB", (48 + 16 * i, 56), (250, 250, 250))
        img.paste(color, (8, 8, 28, 28))
        img.save(images / f"img{i}.png")
    rows = []
    for i in range(4):
        rows.append(
            {
                "id": f"text-{i}",
                "conversations": [
                    {"from": "human", "value": f"What is {i} + {i}?"},
                    {"from": "gpt", "value": f"<answer>{2 * i}</answer>"},
                ],
            }
        )
        rows.append(
            {
                "id": f"single-{i}",
                "image": f"img{i}.png",
                "conversations": [
                    {"from": "human", "value": "<image>What colour is the square?"},
                    {"from": "gpt", "value": "<answer>red</answer>"},
                ],
            }
        )
        rows.append(
            {
                "id": f"multi-{i}",
                "image": [f"img{i}.png", f"img{(i + 1) % 4}.png"],
                "conversations": [
                    {"from": "human", "value": "Here is one <image> and another <image> - are they the same colour?"},
                    {"from": "gpt", "value": "<answer>no</answer>"},
                ],
            }
        )
    rows = [r for r in rows if r["id"].split("-")[0] in kinds and int(r["id"].split("-")[1]) < n]
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plugin = root / "my_rewards.py"
    plugin.write_text(REWARD_PLUGIN)
    return data, plugin


def base_args(model: Path, data: Path, plugin: Path, output_dir: Path, steps: int = 2) -> list[str]:
    return [
        "--model_name_or_path", str(model),
        "--data_file_paths", str(data),
        "--image_folders", str(data.parent / "images"),
        "--reward_funcs", f"{plugin}:text_shape", "format",
        "--output_dir", str(output_dir),
        "--max_steps", str(steps),
        "--per_device_train_batch_size", "4",
        "--num_generations", "4",
        "--max_completion_length", "8",
        "--learning_rate", "1e-3",
        "--gradient_checkpointing", "false",
        "--logging_steps", "1",
        "--save_strategy", "no",
        "--report_to", "none",
        "--seed", "7",
        "--dataloader_num_workers", "0",
    ]  # fmt: skip


def original_params(model_dir: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def own_forward_logps(trainer, input_ids, attention, completion_mask, row: int, images: list) -> torch.Tensor:
    """The completion log-probs of one row of a Qwen tool batch by an independent plain forward of the model, fed
    ``images`` (what the rollout saw: the prompt's image, then the tool's): the reference for the batched passes."""
    image_pad = trainer._tokenizer.convert_tokens_to_ids("<|image_pad|>")
    row_ids = input_ids[row][attention[row].bool()].unsqueeze(0)
    pixels = trainer.processing_class.image_processor(images=images, return_tensors="pt")
    with torch.no_grad():
        logits = trainer.model(
            input_ids=row_ids,
            attention_mask=torch.ones_like(row_ids),
            pixel_values=pixels["pixel_values"],
            image_grid_thw=pixels["image_grid_thw"],
            mm_token_type_ids=(row_ids == image_pad).long(),
        ).logits[0, :-1]
    n = int(completion_mask[row].sum())
    return torch.log_softmax(logits.float(), -1).gather(-1, row_ids[0, 1:, None])[-n:, 0]


def run_main(script: str, argv: list[str], cwd: Path, monkeypatch: pytest.MonkeyPatch):
    """``python benchmarks/SCRIPT ARGV`` in this process: the script's ``main(argv)`` with its folder and benchmarks/
    first on the path and ``cwd`` as the working directory, as the interpreter would run it, without what a new
    interpreter pays before and at its first steps (imports, first model builds: 4-8 s on a CPU). Its return value;
    a failure raises (``SystemExit`` included)."""
    path = BENCH / script
    for folder in dict.fromkeys((BENCH, path.parent)):
        monkeypatch.syspath_prepend(str(folder))
    monkeypatch.chdir(cwd)
    spec = importlib.util.spec_from_file_location(f"_bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    before = inherited_reassigned()
    out = module.main(argv)
    leaked = inherited_reassigned() - before
    assert not leaked, f"{script} left inherited methods set on subclasses (restore with unittest.mock.patch): {leaked}"
    return out


def inherited_reassigned() -> set[str]:
    """Methods of processor, image processor and trainer classes set on a subclass to the very object it inherits:
    what ``Cls.name = saved`` leaves behind after patching an inherited method. In a process that runs a benchmark
    script and then other tests, such an attribute hides every later patch of the base class."""
    from transformers.image_processing_utils import ImageProcessingMixin
    from transformers.processing_utils import ProcessorMixin
    from trl import GRPOTrainer

    found, todo, seen = set(), [ProcessorMixin, ImageProcessingMixin, GRPOTrainer], set()
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo += cls.__subclasses__()
        for name, value in vars(cls).items():
            if (name.startswith("__") and name != "__call__") or not callable(value) or isinstance(value, type):
                continue  # plain values (None, numbers) repeat a base's default legitimately
            inherited = next((vars(base)[name] for base in cls.__mro__[1:] if name in vars(base)), None)
            if inherited is value:
                found.add(f"{cls.__module__}.{cls.__qualname__}.{name}")
    return found
