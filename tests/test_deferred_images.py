"""The GRPO training loader decodes a row's images only when a step generates from the row.

TRL's loader fetches a whole generation batch at every micro-step and drops all but the one it generates from, so
decoding at fetch time decoded each image ``steps_per_generation`` times (about 45 s per optimizer step at EasyR1's
shape). What a user would notice if this broke: a step much slower than its GPU work (counted here as image
decodes per generated batch), or different prompts / images / rows reaching the generation (compared here with
the immediate transform, a damaged image's replacement row included).
"""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from PIL import Image

import vlm_grpo.data.jsonl as jsonl
from vlm_grpo.configs import VLMGRPOConfig
from vlm_grpo.data import prepare_rows, read_rows, to_datasets
from vlm_grpo.data.deferred import PendingImages, decode_pending, deferred_view
from vlm_grpo.modules import get_vlm_module
from vlm_grpo.trainer import VLMGRPOTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

COLORS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (90, 90, 10)]


def write_rows(root, n=4):
    rows = []
    for i in range(n):
        Image.new("RGB", (40 + 8 * i, 48), COLORS[i % len(COLORS)]).save(root / f"{i}.png")
        question = "<image>" + " ".join(["What colour is this?"] * (1 + i % 3))  # mixed prompt lengths
        rows.append({"image": f"{i}.png", "conversations": [{"from": "human", "value": question},
                                                            {"from": "gpt", "value": str(i)}]})  # fmt: skip
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class Decodes:
    """Counts images decoded by the data pipeline (``decode_rgb`` as the transform calls it)."""

    def __init__(self, monkeypatch):
        self.count = 0
        real = jsonl.decode_rgb

        def counted(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(jsonl, "decode_rgb", counted)


def dataset_of(model_dir, path):
    module = get_vlm_module(str(model_dir))
    processor = module.load_processor(str(model_dir))
    rows, bad = read_rows([str(path)], task_type="raw")
    return module, processor, to_datasets(prepare_rows(rows, bad, module, processor), module)[0]


def _reward(completions, **kwargs):
    return [float(len(str(c)) % 3) for c in completions]


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "control_decoded_at_fetch"])
def test_a_generation_cycle_decodes_each_generated_rows_images_once(defer, tiny_models, tmp_path, monkeypatch):
    model_dir = tiny_models["qwen2_5_vl"]
    module, processor, dataset = dataset_of(model_dir, write_rows(tmp_path))
    if not defer:  # the control: a transform the loader does not defer (any other than exactly LazyImageTransform)
        dataset = dataset.with_transform(type("Eager", (jsonl.LazyImageTransform,), {})(module))
    model = module.load_model(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    args = VLMGRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, num_generations=2, steps_per_generation=4,
        max_completion_length=3, report_to="none", seed=0, gradient_checkpointing=False,
    )  # fmt: skip
    trainer = VLMGRPOTrainer(model=model, reward_funcs=[_reward], args=args, vlm_module=module,
                             processing_class=processor, train_dataset=dataset)  # fmt: skip
    decodes = Decodes(monkeypatch)
    trainer.model.train()
    loader = iter(trainer.get_train_dataloader())
    generated_rows = 0
    for _ in range(args.steps_per_generation):  # one generation cycle of micro-steps, as the Trainer runs them
        batch = next(loader)
        generate = trainer._step % args.steps_per_generation == 0
        generated_rows += len(batch) if generate else 0
        inputs = trainer._prepare_inputs(batch)
        trainer._step += 1
        assert inputs["completion_ids"].size(0) == args.per_device_train_batch_size
    assert generated_rows == 8
    if defer:
        assert decodes.count == generated_rows  # one image per row, decoded for the generation only
    else:
        assert decodes.count == generated_rows * args.steps_per_generation  # every fetch decoded its batch


def test_deferred_rows_reach_generation_as_the_immediate_transform_gives_them(tiny_models, tmp_path):
    model_dir = tiny_models["qwen2_5_vl"]
    _, _, dataset = dataset_of(model_dir, write_rows(tmp_path))
    _, _, immediate = dataset_of(model_dir, tmp_path / "rows.jsonl")
    (tmp_path / "1.png").write_bytes(b"not a png any more")  # damaged after the check: row 1 gets a replacement
    view, transform = deferred_view(dataset)
    order = [3, 1, 0, 2]  # shuffled, as the sampler hands them
    fetched = [view[i] for i in order]
    assert all(isinstance(r["images"], PendingImages) for r in fetched)
    got = decode_pending(fetched, transform)
    want = [immediate[i] for i in order]
    assert [r["source"] for r in got] == [r["source"] for r in want]
    assert got[1]["source"] != fetched[1]["source"]  # the replacement row, all its columns, took the place
    for g, w in zip(got, want, strict=True):
        assert set(g) == set(w)
        assert g["prompt"] == w["prompt"] and g["solution"] == w["solution"]
        assert [im.tobytes() for im in g["images"]] == [im.tobytes() for im in w["images"]]


def test_pending_rows_pickle_for_loader_workers_and_other_datasets_are_left_alone(tiny_models, tmp_path):
    _, _, dataset = dataset_of(tiny_models["qwen2_5_vl"], write_rows(tmp_path))
    view, transform = deferred_view(dataset)
    row = pickle.loads(pickle.dumps(view[2]))
    assert decode_pending([row], transform)[0]["images"][0].getpixel((0, 0)) == COLORS[2]
    from datasets import Dataset

    own = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}]], "images": [[]]})
    assert deferred_view(own) is None  # a user's own dataset is read as it is
    assert decode_pending([own[0]], transform) == [own[0]]
