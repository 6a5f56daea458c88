"""--max_prompt_length: lengths computed from headers match what the processor really produces."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from vlm_grpo.data import DataValidationError, build_messages, prepare_rows, read_rows
from vlm_grpo.data.jsonl import prompt_lengths
from vlm_grpo.modules import get_vlm_module
from vlm_grpo.testing.tiny import FAMILIES


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("plen")
    Image.new("RGB", (100, 60), "red").save(root / "a.png")
    Image.new("RGB", (56, 90), "blue").save(root / "b.png")
    rows = [
        {
            "image": "a.png",
            "conversations": [{"from": "human", "value": "<image>How many?"}, {"from": "gpt", "value": "1"}],
        },
        {
            "image": ["a.png", "b.png"],
            "conversations": [
                {"from": "human", "value": "Left <image> right <image> - same colour?"},
                {"from": "gpt", "value": "no"},
            ],
        },
        {"conversations": [{"from": "human", "value": "No image at all here."}, {"from": "gpt", "value": "ok"}]},
    ]
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_lengths_match_the_processor(family, tiny_models, rows_file):
    module = get_vlm_module(str(tiny_models[family]))
    processor = module.load_processor(str(tiny_models[family]))
    rows, bad = read_rows([str(rows_file)], task_type="raw")
    assert not bad
    predicted = prompt_lengths(rows, module, processor)
    for row, length in zip(rows, predicted, strict=True):
        messages = build_messages(row, module.question_template(row["task_type"]))
        images = [Image.open(p).convert("RGB") for p in row["image_path"]]
        text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        real = processor(text=[text], images=images or None, return_tensors="pt")["input_ids"].shape[1]
        assert length == real, (row["source"], length, real)


def test_too_long_prompts_are_bad_rows(tiny_models, rows_file):
    module = get_vlm_module(str(tiny_models["qwen2_5_vl"]))
    processor = module.load_processor(str(tiny_models["qwen2_5_vl"]))
    rows, bad = read_rows([str(rows_file)], task_type="raw")
    lengths = prompt_lengths(rows, module, processor)
    limit = sorted(lengths)[1]  # the longest row (two images) is over it
    with pytest.raises(DataValidationError, match=rf"rows\.jsonl:2: field 'prompt': prompt is {max(lengths)} tokens"):
        prepare_rows(list(rows), list(bad), module, processor, max_prompt_length=limit)
    kept = prepare_rows(list(rows), [], module, processor, max_prompt_length=limit, skip_bad_rows=True)
    assert [r["source"].rsplit(":", 1)[1] for r in kept] == ["1", "3"]
