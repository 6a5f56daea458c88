"""Tool-loop turns after a tool result decode with ``fast_decode``, with the tokens TRL's own path gives.

Each rollout's first turn is a scripted ``zoom_in`` call, every other one with a bad box; the turn after the tool
result (the zoomed image, or an error text, in the conversation: one batch holds both) is the tiny model's own
greedy continuation. The same run with ``share_prefill`` off goes
through TRL's ``_generate_single_turn`` (``generate``) for every turn: the continuations must be equal, token
for token. Negative control: the tool images blanked on the fast path must change them, so the comparison does
see what the images contribute.
"""

from __future__ import annotations

import shutil

import pytest

from e2e_utils import base_args, make_dataset
from test_early_calls_unit import fresh_tool_threads  # noqa: F401  (autouse: each test its own tool threads)
from test_generation_parity import INIT_STD
from vlm_grpo.fastpath import decode
from vlm_grpo.grpo_jsonl import main, parse_args
from vlm_grpo.testing.tiny import FAMILIES, build_tiny_model
from vlm_grpo.trainer import VLMGRPOTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# A box valid in each family's frame: Qwen2.5-VL writes resized-image pixels (>= 56 here), the others 0-1000.
BOX = {"qwen2_5_vl": [4, 4, 44, 44], "qwen2_vl": [100, 100, 800, 800], "qwen3_vl": [100, 100, 800, 800]}
BOX["internvl"] = BOX["qwen2_vl"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("fast_turns"), kinds=("single",))


@pytest.fixture(scope="module")
def sharp_models(tmp_path_factory):
    """Tiny checkpoints with larger weights: their greedy tokens depend on what the images show."""
    root = tmp_path_factory.mktemp("sharp_tools")
    return {f: build_tiny_model(f, root / f, seed=0, init_std=INIT_STD) for f in FAMILIES}


def call_turn(family: str, models, call: dict) -> str:
    """The assistant turn that makes ``call``, as the family's chat template writes it, ended by its end of turn."""
    from transformers import AutoProcessor

    from vlm_grpo.tools.rollouts import prepare_for_tools

    processor = AutoProcessor.from_pretrained(models[family])
    prepare_for_tools(None, processor)  # the chat template a tool run renders with
    tokenizer = processor.tokenizer
    prompt = [{"role": "user", "content": "Zoom in."}]
    turn = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}
    head = processor.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    whole = processor.apply_chat_template([*prompt, turn], tokenize=False)
    assert whole.startswith(head)
    text = whole[len(head) :]
    end = text.find(tokenizer.eos_token)
    return text[: end + len(tokenizer.eos_token)] if end >= 0 else text + tokenizer.eos_token


def run(
    family: str, sharp_models, dataset, out, share: bool, blank_tool_images: bool = False, all_bad: bool = False,
    box: list[int] | None = None, budget: int = 240,
) -> dict:  # fmt: skip
    """One GRPO step; returns the later turns' token ids and the rows ``fast_decode`` decoded. ``all_bad``: every
    call fails, so the round after it holds no tool image (only the prompts' own images). ``box``: the zoom box in
    the family's coordinate frame (default ``BOX[family]``); ``budget``: ``--max_completion_length``."""
    data, plugin = dataset
    good = {"name": "zoom_in", "arguments": {"bbox_2d": box or BOX[family], "image_index": 0}}
    bad = {"name": "zoom_in", "arguments": {"bbox_2d": [50, 50, 10, 10]}}  # inverted: an error text, no image
    calls = [call_turn(family, sharp_models, call) for call in (good, bad)]
    seen: dict = {"later": [], "fast_rows": 0, "tool_images": 0}
    generate, fast = VLMGRPOTrainer._generate_single_turn, decode.fast_decode

    def scripted(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if num_generations > 1:  # the first turn: rollouts call the tool, every other one with a bad box
            texts = calls
            return [
                self._tokenizer.encode(texts[1 if all_bad else i % 2], add_special_tokens=False)
                for i in range(len(prompt_ids))
            ], None
        seen["tool_images"] += int(has_tool_images)
        if blank_tool_images:
            multimodal_fields = {**multimodal_fields, "pixel_values": multimodal_fields["pixel_values"] * 0}
        ids, logprobs = generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        seen["later"].extend(ids)
        return ids, logprobs

    def counted(model, cache, index, *args, **kwargs):
        seen["fast_rows"] += len(index)
        return fast(model, cache, index, *args, **kwargs)

    argv = base_args(sharp_models[family], data, plugin, out, steps=1)
    argv += ["--generation_kwargs", '{"max_new_tokens": 12, "do_sample": false}', "--share_prefill", str(share)]
    argv += ["--tools", "zoom_in", "--max_tool_calling_iterations", "1", "--max_completion_length", str(budget)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(VLMGRPOTrainer, "_generate_single_turn", scripted)
        mp.setattr(decode, "fast_decode", counted)
        main(*parse_args(argv))
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_turns_after_a_tool_image_decode_fast_with_trls_tokens(family, sharp_models, dataset, tmp_path):
    trl = run(family, sharp_models, dataset, tmp_path / "trl", share=False)
    ours = run(family, sharp_models, dataset, tmp_path / "ours", share=True)
    assert trl["tool_images"] == ours["tool_images"] == 1  # one tool round, the zoomed view in the conversation
    assert trl["fast_rows"] == 0 and ours["fast_rows"] == 4  # 4 rollouts of one prompt, each its own history
    assert len(ours["later"]) == 4 and all(ours["later"])
    assert ours["later"] == trl["later"]
    assert len({tuple(ids) for ids in ours["later"]}) > 1  # the rows' own histories: not one repeated answer
    if family == "qwen2_5_vl":  # the control: what the tool images contribute is visible in the tokens
        blank = run(family, sharp_models, dataset, tmp_path / "blank", share=True, blank_tool_images=True)
        assert blank["fast_rows"] == 4 and blank["later"] != trl["later"]


@pytest.mark.parametrize("family", ["internvl", "qwen2_5_vl"])
def test_a_round_without_tool_images_keeps_trls_tokens(family, sharp_models, dataset, tmp_path):
    """Every call fails: TRL's loop cuts the prompts' own image fields per rollout (InternVL's tiles arrive as a
    list, which TRL's loop cannot cut: ``tools.rollouts.tile_fields``)."""
    trl = run(family, sharp_models, dataset, tmp_path / "trl", share=False, all_bad=True)
    ours = run(family, sharp_models, dataset, tmp_path / "ours", share=True, all_bad=True)
    assert trl["tool_images"] == ours["tool_images"] == 0
    assert trl["fast_rows"] == 0 and ours["fast_rows"] == 4
    assert ours["later"] == trl["later"] and len(ours["later"]) == 4
    if family == "internvl":  # the control: TRL's loop alone cannot cut InternVL's list of tiles
        with pytest.MonkeyPatch.context() as mp, pytest.raises(AttributeError):
            mp.setattr("vlm_grpo.trainer.tile_fields", lambda processor, images, fields: fields)
            run(family, sharp_models, dataset, tmp_path / "control", share=False, all_bad=True)


def test_multi_tile_internvl_rounds_are_cut_per_rollout(sharp_models, dataset, tmp_path):
    """InternVL with up to 4 tiles an image (the widest test image takes 3): each rollout keeps its own tiles through
    a round without tool images (a wrong cut would not match the image tokens). The shared path cannot count tiles per
    row, so these turns go through TRL's generate (no fast decode), with the same tokens."""
    from PIL import Image
    from transformers import AutoProcessor

    model = tmp_path / "internvl_tiles"
    shutil.copytree(sharp_models["internvl"], model)
    processor = AutoProcessor.from_pretrained(model)
    processor.image_processor.max_patches, processor.image_processor.crop_to_patches = 4, True
    processor.save_pretrained(model)
    images = [Image.open(p) for p in sorted((dataset[0].parent / "images").glob("*.png"))]
    tiles = processor.image_processor(images=images, crop_to_patches=True, return_tensors="pt")["num_patches"]
    assert tiles.max() > 1
    models = {"internvl": model}
    trl = run("internvl", models, dataset, tmp_path / "trl", share=False, all_bad=True)
    ours = run("internvl", models, dataset, tmp_path / "ours", share=True, all_bad=True)
    assert ours["later"] == trl["later"] and len(ours["later"]) == 4
    assert ours["fast_rows"] == 0  # the step's prompt image has several tiles: TRL's generate decoded it
