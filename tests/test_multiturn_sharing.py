"""The packed log-prob pass (``share_prompt``) on multi-turn tool rollouts: parity with TRL's per-row pass.

Batches come from TRL's own tool loop (``_generate_and_score_completions``) with scripted turns, then shuffled as
TRL shuffles them before the loss. Per group (G=3): a rollout that zooms twice (two tool images in its completion,
3 turns), one that answers at once (1 turn), one whose first call fails (an error text) and whose second zooms
(one tool image, 3 turns); the two prompts hold one and two images. Every zoom looks at another region of a
textured image, so every tool image differs from the others.
"""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from PIL import Image

import vlm_grpo.fastpath.sharing as sharing
from test_group_sharing import G, assert_parity, interleaved, logps_and_grads, make_trainer
from vlm_grpo.testing.tiny import FAMILIES
from vlm_grpo.trainer import VLMGRPOTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Equal-sized regions (so two tool images can trade places), in each family's box frame: Qwen2.5-VL writes pixels
# of the resized image (56 x 56 here), the others 0-1000.
BOXES = {
    "qwen2_5_vl": [[4, 4, 28, 28], [20, 16, 44, 40], [12, 24, 36, 48]],
    "qwen2_vl": [[100, 100, 500, 500], [450, 350, 850, 750], [250, 500, 650, 900]],
}
BOXES["qwen3_vl"] = BOXES["internvl"] = BOXES["qwen2_vl"]
ANSWER = "<answer>1</answer><|im_end|>"
PLACEHOLDER = {"internvl": "<IMG_CONTEXT>"}  # the others: <|image_pad|>
IMAGE_START = {"internvl": "<img>"}  # the others: <|vision_start|>
PARITY_FAILED = r"not close|relative L2"  # what assert_parity says when the numbers differ


@pytest.fixture(scope="module")
def textured_rows(tmp_path_factory):
    root = tmp_path_factory.mktemp("multiturn")
    gen = torch.Generator().manual_seed(0)
    for name, (w, h) in (("a.png", (64, 48)), ("b.png", (56, 90))):
        pixels = torch.randint(0, 256, (h, w, 3), generator=gen, dtype=torch.uint8).numpy()
        Image.fromarray(pixels).save(root / name)
    rows = [
        {"image": "a.png", "conversations": [{"from": "human", "value": "<image>Red?"}, {"from": "gpt", "value": "1"}]},
        {
            "image": ["a.png", "b.png"],
            "conversations": [
                {"from": "human", "value": "Compare <image> with <image> and tell which one is larger, please."},
                {"from": "gpt", "value": "2"},
            ],
        },
    ]
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def scripted_turns(family):
    """``_generate_single_turn`` of a scripted policy. First turn by row: zoom, answer, bad call (an inverted box:
    an error text). Next round every rollout still going zooms (again, or after its failed call), each at another
    region than its group's other zooms. Then every rollout answers."""

    def call(box):
        arguments = {"bbox_2d": box, "image_index": 0}
        return f"<tool_call>\n{json.dumps({'name': 'zoom_in', 'arguments': arguments})}\n</tool_call><|im_end|>"

    bad = call([50, 50, 10, 10])
    boxes = BOXES[family]
    state = {"round": 0}

    def scripted(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        def ids(text):
            return self._tokenizer.encode(text, add_special_tokens=False)

        if num_generations > 1:
            state["round"] = 0
            return [ids([call(boxes[(i // G) % 3]), ANSWER, bad][i % 3]) for i in range(len(prompt_ids))], None
        state["round"] += 1
        if state["round"] == 1:  # rows 0, 2, 3, 5 (zoomed, failed, zoomed, failed)
            return [ids(call(boxes[[1, 2, 2, 0][i % 4]])) for i in range(len(prompt_ids))], None
        return [ids(ANSWER) for _ in prompt_ids], None

    return scripted


def tool_trainer(family, model_dir, rows, tmp_path, **overrides):
    return make_trainer(
        model_dir, rows, tmp_path, max_completion_length=600, max_tool_calling_iterations=3,
        trainer_kwargs={"tools": ["zoom_in"], "tool_kwargs": {"zoom_in": {"size": 56}}}, **overrides,
    )  # fmt: skip


def tool_batch(trainer, family):
    """A multi-turn batch from TRL's tool loop, shuffled as TRL hands it to the loss (groups interleaved)."""
    trainer.model.eval()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(VLMGRPOTrainer, "_generate_single_turn", scripted_turns(family))
        batch = next(iter(trainer.get_train_dataloader()))
        inputs = trainer._generate_and_score_completions(batch)
    return interleaved(inputs)


def images_per_row(trainer, family, batch):
    """(prompt images, completion images) per row, counted from the tokens (not by the code under test)."""
    tokenizer = trainer._tokenizer
    start = tokenizer.convert_tokens_to_ids(IMAGE_START.get(family, "<|vision_start|>"))
    prompt = (batch["prompt_ids"] == start).sum(1).tolist()
    completion = (batch["completion_ids"] == start).sum(1).tolist()
    return prompt, completion


@pytest.fixture(scope="module")
def batches(tiny_models, textured_rows, tmp_path_factory):
    """One trainer and one shuffled tool batch per family (built once: TRL's tool loop is the slow part)."""
    cache = {}

    def get(family):
        if family not in cache:
            trainer = tool_trainer(family, tiny_models[family], textured_rows, tmp_path_factory.mktemp(family))
            cache[family] = trainer, tool_batch(trainer, family)
        return cache[family]

    return get


@pytest.mark.parametrize(
    ("family", "options"),
    [
        ("qwen2_vl", {"attn": "eager"}),
        ("qwen3_vl", {"packed_attention": "dense"}),
        ("internvl", {"lora": True}),
        ("qwen2_5_vl", {"checkpointing": True}),
    ],
)
def test_packed_multi_turn_pass_matches_trl_with_other_kernels_and_lora(
    family, options, batches, tiny_models, textured_rows, tmp_path, monkeypatch
):
    """The dense block mask (eager, or sdpa with packed_attention=dense), LoRA layers and the recomputation of
    gradient checkpointing see the same layout."""
    _, batch = batches(family)
    options = dict(options)
    checkpointing = options.pop("checkpointing", False)
    trainer = tool_trainer(family, tiny_models[family], textured_rows, tmp_path, **options)
    if checkpointing:
        trainer.model.gradient_checkpointing_enable({"use_reentrant": False})
        trainer.model.train()
        assert trainer.model.is_activation_checkpointing
    calls = _count_packed(monkeypatch)
    assert_parity(trainer, batch)
    assert calls == [2]


def _count_packed(monkeypatch):
    calls = []
    real = sharing._packed_forward
    monkeypatch.setattr(sharing, "_packed_forward", lambda *a: calls.append(len(a[5])) or real(*a))
    return calls


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_pass_matches_trl_on_multi_turn_rows(family, batches, monkeypatch):
    """Log-probs and gradients within 1e-5 of TRL's per-row pass; tool tokens are masked from the loss as TRL
    masks them; the rows' order is TRL's shuffle."""
    trainer, batch = batches(family)
    assert trainer.args.share_prompt, "tool runs keep the packed pass"
    prompt_images, tool_images = images_per_row(trainer, family, batch)
    mix = sorted(zip(prompt_images, tool_images, strict=True))
    assert mix == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)], "per prompt: 0, 1 and 2 tool images"
    assert batch["num_images"] == [p + t for p, t in zip(prompt_images, tool_images, strict=True)]
    assert prompt_images != sorted(prompt_images) and prompt_images != sorted(prompt_images, reverse=True)
    mask = batch["tool_mask"] * batch["completion_mask"]
    assert (mask.sum(1) < batch["completion_mask"].sum(1)).sum() == 4, "four rows hold tool replies"
    calls = _count_packed(monkeypatch)
    assert_parity(trainer, batch)
    assert calls == [2], "one packed forward over both groups"


@pytest.mark.parametrize("family", ["qwen2_5_vl", "internvl"])
def test_the_parity_test_catches_a_tool_image_swapped_between_rows(family, batches, monkeypatch):
    """Two rollouts of a group trade a tool image (same size, other region) in the packed pass: parity must fail."""
    trainer, batch = batches(family)
    module = type(trainer.vlm_module)
    real = module.group_vision_inputs
    grid = batch.get("image_grid_thw")
    swaps = []

    def swapped(self, groups, mm):
        inputs = real(self, groups, mm)
        images = [i for a, b in self.vision_spans(groups, pixels=False) for i in range(a, b)]  # in pack order
        sizes = [tuple(grid[i].tolist()) if grid is not None else (1,) for i in images]
        starts = [sum(math.prod(x) for x in sizes[:k]) for k in range(len(sizes))]
        g = groups[0]
        mine = [(row, i) for row, r in zip(g.rows, g.tool_ranges, strict=True) if r for i in range(*r)]
        a, b = next((x, y) for x in mine for y in mine if x[0] != y[0] and sizes[images.index(x[1])] ==
                    sizes[images.index(y[1])])  # fmt: skip
        ka, kb = images.index(a[1]), images.index(b[1])
        n = math.prod(sizes[ka])
        pixels = inputs["pixel_values"].clone()
        pixels[starts[ka] : starts[ka] + n] = inputs["pixel_values"][starts[kb] : starts[kb] + n]
        pixels[starts[kb] : starts[kb] + n] = inputs["pixel_values"][starts[ka] : starts[ka] + n]
        assert not torch.equal(pixels, inputs["pixel_values"]), "the two tool images are the same"
        swaps.append((a, b))
        return {**inputs, "pixel_values": pixels}

    monkeypatch.setattr(module, "group_vision_inputs", swapped)
    with pytest.raises(AssertionError, match=PARITY_FAILED):
        assert_parity(trainer, batch)
    assert len(swaps) == 1, "the control ran the packed pass"


@pytest.mark.parametrize("shift", [1, "flat"], ids=["off_by_one", "text_positions"])
def test_the_parity_test_catches_wrong_tool_image_positions(shift, batches, monkeypatch):
    """mrope positions of a completion with tool images: one off, or tool images placed as text, must fail."""
    trainer, batch = batches("qwen2_5_vl")
    model = trainer.model.model
    real = model.get_rope_index

    def wrong(input_ids, **kwargs):
        positions, deltas = real(input_ids, **kwargs)
        if "attention_mask" in kwargs:  # the prompt's: left as it is
            return positions, deltas
        if shift == "flat":
            return torch.arange(positions.size(-1)).expand_as(positions), deltas
        return positions + shift, deltas

    monkeypatch.setattr(model, "get_rope_index", wrong)
    with pytest.raises(AssertionError, match=PARITY_FAILED):
        assert_parity(trainer, batch)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "internvl"])
def test_each_image_and_prompt_goes_through_the_model_once_per_pass(family, batches):
    """One tower call per pass, over each prompt's images once per group and each rollout's tool images once (TRL's
    pass encodes the prompt images once per row); the decoder reads each prompt once, then every row's block of its
    own length + 1."""
    trainer, batch = batches(family)
    grid = batch.get("image_grid_thw")
    units = grid.prod(-1).tolist() if grid is not None else [1] * sum(batch["num_images"])  # InternVL: 1 tile each
    prompt_images, _ = images_per_row(trainer, family, batch)
    expected, seen_prompts, start = 0, set(), 0
    for row, n in enumerate(batch["num_images"]):
        own = units[start : start + n]
        key = tuple(batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist())
        if key not in seen_prompts:
            seen_prompts.add(key)
            expected += sum(own[: prompt_images[row]])
        expected += sum(own[prompt_images[row] :])
        start += n
    assert len(seen_prompts) == 2 and expected < sum(units)

    # One packed sequence per group: its prompt once, then each row's block (its own completion + 1).
    lengths = dict.fromkeys(seen_prompts, -1)
    for row, real in enumerate(batch["completion_mask"].sum(1).tolist()):
        lengths[tuple(batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist())] += real + 1
    lengths = {len(key) + n for key, n in lengths.items()}
    assert max(lengths) < min(len(key) for key in seen_prompts) + G * (batch["completion_ids"].size(1) + 1)

    tower = dict(trainer.model.named_modules())[trainer.vlm_module.vision_prefixes[0]]
    calls, decoded = [], []
    handles = [
        tower.register_forward_hook(
            lambda m, args, kwargs, out: calls.append((args[0] if args else kwargs["pixel_values"]).shape[0]),
            with_kwargs=True,
        ),
        trainer.model.get_decoder().register_forward_hook(
            lambda m, args, kwargs, out: decoded.append(tuple(kwargs["inputs_embeds"].shape[:2])), with_kwargs=True
        ),
    ]
    try:
        for _ in range(2):  # e.g. the old and the reference pass: each its own single call
            with torch.no_grad():
                our_logps(trainer, batch)
    finally:
        for handle in handles:
            handle.remove()
    assert calls == [expected, expected], (calls, expected, sum(units))
    assert decoded == [(2, max(lengths))] * 2, (decoded, lengths)


def our_logps(trainer, batch):
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    keys = ("pixel_values", "image_grid_thw", "num_images", "mm_token_type_ids", "token_type_ids")
    mm = {k: batch[k] for k in keys if batch.get(k) is not None}
    width = batch["completion_ids"].size(1)
    return trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, mask, width, **mm)


def test_a_family_that_cannot_place_tool_images_goes_through_trl_with_one_info_line(batches, monkeypatch, caplog):
    """An adapter that cannot count an image's pixel rows: the batch takes TRL's pass (TRL's numbers), said once."""
    trainer, batch = batches("qwen2_vl")
    monkeypatch.setattr(type(trainer.vlm_module), "image_units", lambda self, model, placeholders: None)
    calls = _count_packed(monkeypatch)
    with caplog.at_level(logging.INFO, logger="vlm_grpo.fastpath.sharing"):
        assert_parity(trainer, batch)
        logps_and_grads(trainer, batch, VLMGRPOTrainer._get_per_token_logps_and_entropies, 1.0)
    assert calls == []
    lines = [r.message for r in caplog.records if "per-row pass" in r.message]
    assert len(lines) == 1 and "image placeholders do not match its images (Qwen2VLModule)" in lines[0], lines


DRAW_TOOL = '''
from PIL import Image


def draw(env, shade: int) -> list:
    """Draw a picture.

    Args:
        shade: how light the picture is
    """
    image = Image.new("RGB", (40, 40), (shade, 255 - shade, (7 * shade) % 256))
    image.paste((255 - shade, shade, 0), (shade % 20, 5, shade % 20 + 12, 30))
    return [{"type": "text", "text": "Here:"}, {"type": "image", "image": image}]
'''


@pytest.mark.parametrize("family", ["qwen2_5_vl", "internvl"])
def test_text_prompts_whose_tools_return_images_match_trl(family, tiny_models, tmp_path):
    """Prompts without images, tool replies with images: every image of the batch is a rollout's own."""
    (tmp_path / "draw_tool.py").write_text(DRAW_TOOL)
    rows = [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "1"}]}
            for q in ("Draw?", "Draw something with many colours for me, please.")]  # fmt: skip
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def scripted(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        def ids(text):
            return self._tokenizer.encode(text, add_special_tokens=False)

        def call(shade):
            action = json.dumps({"name": "draw", "arguments": {"shade": shade}})
            return ids(f"<tool_call>\n{action}\n</tool_call><|im_end|>")

        if num_generations > 1:  # every third rollout answers at once, the others draw (each its own picture)
            return [call(40 * i + 10) if i % 3 else ids(ANSWER) for i in range(len(prompt_ids))], None
        return [ids(ANSWER) for _ in prompt_ids], None

    trainer = make_trainer(
        tiny_models[family], tmp_path / "rows.jsonl", tmp_path, max_completion_length=400,
        max_tool_calling_iterations=2, trainer_kwargs={"tools": [f"{tmp_path / 'draw_tool.py'}:draw"]},
    )  # fmt: skip
    trainer.model.eval()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(VLMGRPOTrainer, "_generate_single_turn", scripted)
        batch = interleaved(trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader()))))
    assert sorted(batch["num_images"]) == [0, 0, 1, 1, 1, 1]
    with pytest.MonkeyPatch.context() as mp:
        calls = _count_packed(mp)
        assert_parity(trainer, batch)
    assert calls == [2]


def test_internvl_images_of_several_tiles_in_prompts_and_tool_replies(tiny_models, textured_rows, tmp_path):
    """``--max_anyres_num``: prompt and tool images cut into tiles, counted per row (``num_tiles``) only."""
    trainer = tool_trainer("internvl", tiny_models["internvl"], textured_rows, tmp_path, max_anyres_num=4)
    batch = tool_batch(trainer, "internvl")
    assert batch.get("num_tiles") and sum(batch["num_tiles"]) > sum(batch["num_images"])
    _, tool_images = images_per_row(trainer, "internvl", batch)
    assert sorted(tool_images) == [0, 0, 1, 1, 2, 2]
    with pytest.MonkeyPatch.context() as mp:
        calls = _count_packed(mp)
        assert_parity(trainer, batch)
    assert calls == [2]


def test_the_loss_of_a_multi_turn_batch_is_trls(batches, monkeypatch):
    """TRL's loss (tool tokens masked by ``tool_mask``) and its gradients, with the packed pass and without."""
    trainer, batch = batches("qwen2_5_vl")
    calls = _count_packed(monkeypatch)
    batch = {**batch, "advantages": torch.linspace(-1, 1, batch["advantages"].numel())}
    results = []
    for share in (False, True):
        trainer.args.share_prompt = share
        trainer.model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads))
    trainer.args.share_prompt = True
    (trl_loss, trl_grads), (our_loss, our_grads) = results
    assert calls == [2], "the second loss came from the packed pass"
    assert trl_loss.abs() > 1e-4
    torch.testing.assert_close(our_loss, trl_loss, rtol=0, atol=1e-5)
    assert trl_grads.keys() == our_grads.keys()
    for name, g in trl_grads.items():
        assert (our_grads[name] - g).norm() <= 1e-5 * g.norm().clamp_min(1e-12), name
