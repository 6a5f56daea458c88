"""The tool loop's per-round host work: each reply shape rendered once and each image preprocessed once per step.

TRL's tool loop renders two chat templates per rollout and round for the reply tokens (``_get_tool_suffix_ids``)
and runs the image processor on every image of every live rollout in every round. On the speed path
(:mod:`vlm_grpo.tools.round_cache`) the same tokens and pixels come from one render per reply shape and one
preprocessing per image. Counted here independently of the code under test: hooks on the processor classes count
the templates rendered and the images preprocessed inside the tool loop, and hash what they see. The parity of the
rollouts (tokens, masks, metrics) with TRL's loop is ``test_turn_cache.py``'s; here the same scripted step runs both
ways and the counts must be: ours, two templates per distinct reply and one preprocessing per distinct image; TRL's
(the negative control: the counts can fail), two templates per reply and every image again in every round.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from PIL import Image

import test_turn_cache
from test_turn_cache import ROUNDS, run
from vlm_grpo.tools.round_cache import CachedImageProcessor, RoundCaches, RoundWork, SuffixIds
from vlm_grpo.trainer import VLMGRPOTrainer
from vlm_grpo.utils import peft_base

pytestmark = pytest.mark.usefixtures("one_torch_thread")
dataset, sharp_models = test_turn_cache.dataset, test_turn_cache.sharp_models  # the fixtures


def _digest(image: Image.Image) -> bytes:
    return hashlib.sha1(image.tobytes() + repr((image.mode, image.size)).encode()).digest()


def _images(value) -> list:
    if isinstance(value, Image.Image):
        return [value]
    if isinstance(value, (list, tuple)):
        return [image for item in value for image in _images(item)]
    return []


def _reply_shape(conversation) -> tuple:
    """The messages after the dummy call TRL renders (what the reply tokens depend on), images as their sizes."""
    reply = []
    for message in conversation[2:]:
        content = message["content"]
        if isinstance(content, list):
            content = tuple(
                ("image", block["image"].size)
                if block.get("type") == "image"
                else (block.get("type"), block.get("text"))
                for block in content
            )
        reply.append((message["role"], message.get("name"), content))
    return tuple(reply)


def counted_run(monkeypatch, family, model, data, out, share: bool) -> dict:
    """``test_turn_cache.run`` with the templates rendered inside the tool loop and the images preprocessed in the step
    (prompts, tool loop, log-prob passes) counted."""
    from transformers.image_processing_utils import BaseImageProcessor
    from transformers.processing_utils import ProcessorMixin

    counts = {"templates": 0, "replies": [], "images": 0, "seen": set(), "inside": False, "step": False}
    render, preprocess = ProcessorMixin.apply_chat_template, BaseImageProcessor.__call__
    loop, step = VLMGRPOTrainer._tool_call_loop, VLMGRPOTrainer._generate_and_score_completions

    def counted_render(self, conversation, *args, **kwargs):
        if counts["inside"]:
            counts["templates"] += 1
            if len(conversation) > 2:  # the full render: dummy user turn, dummy call, then the reply
                counts["replies"].append(_reply_shape(conversation))
        return render(self, conversation, *args, **kwargs)

    def counted_preprocess(self, images=None, *args, **kwargs):
        if counts["step"]:
            flat = _images(images)
            counts["images"] += len(flat)
            counts["seen"].update(_digest(image) for image in flat)
        return preprocess(self, images, *args, **kwargs)

    def counted_loop(self, *args, **kwargs):
        counts["inside"] = True
        try:
            return loop(self, *args, **kwargs)
        finally:
            counts["inside"] = False

    def counted_step(self, *args, **kwargs):
        counts["step"] = True
        try:
            return step(self, *args, **kwargs)
        finally:
            counts["step"] = False

    with monkeypatch.context() as mp:
        mp.setattr(ProcessorMixin, "apply_chat_template", counted_render)
        mp.setattr(BaseImageProcessor, "__call__", counted_preprocess)
        mp.setattr(VLMGRPOTrainer, "_tool_call_loop", counted_loop)
        mp.setattr(VLMGRPOTrainer, "_generate_and_score_completions", counted_step)
        seen = run(family, model, data, out, share=share)
    return {**seen, **counts}


def test_each_reply_shape_is_rendered_and_each_image_preprocessed_once(monkeypatch, sharp_models, dataset, tmp_path):
    family = "qwen2_5_vl"
    model = sharp_models(family)
    trl = counted_run(monkeypatch, family, model, dataset, tmp_path / "trl", share=False)
    ours = counted_run(monkeypatch, family, model, dataset, tmp_path / "ours", share=True)
    assert ours["rollouts"] == trl["rollouts"]  # the same tokens and tool masks
    rows = len(trl["turns"][0]["inputs"])
    replies = rows * ROUNDS  # every rollout calls a tool in every scripted round
    assert len(trl["replies"]) == replies and trl["templates"] == 2 * replies
    shapes = set(trl["replies"])
    assert 1 < len(shapes) < replies  # an image reply and an error text: fewer shapes than replies
    assert ours["templates"] == 2 * len(shapes)  # does not grow with rollouts x rounds
    # Every distinct image (the prompts', the tools') once in the step; TRL preprocesses the prompts' per row, and
    # every image of every live rollout again in each round and in the log-prob passes.
    tool_images = sum(trl["turns"][-1]["images"]) - sum(trl["turns"][0]["images"] or [0])
    assert tool_images > 0
    assert ours["seen"] == trl["seen"] and ours["images"] == len(ours["seen"])
    assert trl["images"] > ROUNDS * len(trl["seen"])


def _random_images(sizes: list[tuple[int, int]]) -> list[Image.Image]:
    rng = np.random.default_rng(0)
    return [Image.fromarray((rng.random((h, w, 3)) * 255).astype("uint8")) for w, h in sizes]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "internvl", "mistral3"])
def test_cached_image_processor_returns_the_processors_own_outputs(family, tiny_models):
    """Per image rows (Qwen's patches by grid, InternVL's tiles), or a processor whose batch is padded to its largest
    image (Pixtral): the outputs are the image processor's own for every call, whatever was preprocessed before."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_models[family])
    inner = processor.image_processor
    images = _random_images([(300, 200), (448, 448), (100, 60), (500, 90)])
    work = RoundWork()
    cached = CachedImageProcessor(inner, work)
    # The processor's own calls (inside apply_chat_template: no return_tensors) and TRL's, in any order.
    calls = [(images[:2], None), ([images[1], images[3], images[0]], "pt"), (images, "pt"), ([images[2]], None)]
    for call, tensors in calls:
        want = inner(images=call, return_tensors=tensors)
        got = cached(images=call, return_tensors=tensors)
        assert set(got.keys()) == set(want.keys())
        for key in want:
            assert type(got[key]) is type(want[key]), (family, key)
            if isinstance(want[key], list):
                assert len(got[key]) == len(want[key])
                assert all(
                    torch.equal(torch.as_tensor(a), torch.as_tensor(b))
                    for a, b in zip(got[key], want[key], strict=True)
                )
            else:
                assert torch.equal(torch.as_tensor(got[key]), torch.as_tensor(want[key])), (family, key)
    if family == "mistral3":  # padded to the batch: runs as it is, every call
        assert work.images_processed == 2 + 3 + 4 + 1
    elif family == "internvl":  # lists without return_tensors: those are kept apart from the tensors
        assert work.images_processed == 3 + len(images)
    else:
        assert work.images_processed == len(images)
        assert work.image_requests == 2 + 3 + 4 + 1
    # A copy with the same pixels is the same image: nothing preprocessed again (but for Pixtral's batches).
    processed = work.images_processed
    again = cached(images=[images[0].copy()], return_tensors="pt")
    assert torch.equal(again["pixel_values"], inner(images=[images[0]], return_tensors="pt")["pixel_values"])
    assert work.images_processed == processed + (family == "mistral3")


def test_suffix_ids_render_once_per_text_and_image_size():
    """Equal text and image size: one render; another text, image size or role: a render of its own. Contents
    without a stable key (an object in a block) are rendered every time, never mixed up."""
    rendered: list = []

    def render(messages):
        rendered.append(messages)
        return [len(rendered)]

    work = RoundWork()
    suffix = SuffixIds(render, work)
    small, other_small, big = _random_images([(40, 40), (40, 40), (80, 40)])

    def reply(text, image=None, role="tool"):
        content = [{"type": "text", "text": text}] + ([{"type": "image", "image": image}] if image else [])
        return [{"role": role, "name": "zoom_in", "content": content}]

    assert suffix(reply("zoomed", small)) == [1]
    assert suffix(reply("zoomed", other_small)) == [1]  # other pixels, same size: same tokens
    assert suffix(reply("zoomed", big)) == [2]
    assert suffix(reply("cropped", small)) == [3]
    assert suffix(reply("zoomed", small, role="user")) == [4]
    assert suffix([{"role": "tool", "name": "zoom_in", "content": "error: no box"}]) == [5]
    assert suffix([{"role": "tool", "name": "zoom_in", "content": "error: no box"}]) == [5]
    odd = [{"role": "tool", "name": "zoom_in", "content": [{"type": "text", "text": "x", "extra": object()}]}]
    assert suffix(odd) == [6] and suffix(odd) == [7]
    assert (work.suffix_requests, work.suffix_renders) == (9, 7)


def test_round_caches_put_the_image_processor_back():
    class Processor:
        image_processor = None

    processor = Processor()
    processor.image_processor = inner = object()
    caches = RoundCaches(lambda messages: [])
    with pytest.raises(RuntimeError), caches.images(processor):
        assert isinstance(processor.image_processor, CachedImageProcessor)
        raise RuntimeError
    assert processor.image_processor is inner


@pytest.mark.parametrize("spares", [2, 0], ids=["spares", "control_no_spares"])
def test_rounds_of_other_widths_replay_their_kept_steps(spares, tiny_models, monkeypatch):
    """A tool step decodes its first turn over every rollout and later rounds over the rollouts still calling
    tools: widths alternate from step to step. Each width's kept workspace (its steps, on a GPU its graphs) serves it
    again; the control keeps only the last one and makes a workspace at every change of width. Tokens stay
    generate's."""
    import test_decode_speed
    from test_decode_keep import _decode, _tiny_qwen
    from test_decode_windows import _windows_on
    from vlm_grpo.fastpath import decode, decode_keep

    _windows_on(monkeypatch, window=4, bucket=8)
    monkeypatch.setattr(decode_keep, "SPARES", spares)
    made = []
    workspace = decode._workspace
    monkeypatch.setattr(decode, "_workspace", lambda *a, **k: made.append(a[2]) or workspace(*a, **k))
    model = _tiny_qwen(tiny_models)
    kept = []
    for g in (2, 1, 2, 1, 2):  # 4 rows, then 2 (half the rollouts answered), from step to step
        monkeypatch.setattr(test_decode_speed, "G", g)
        ours, plain = _decode(model, 20, compile=False, keep=True)
        assert ours == plain and len(ours) == 2 * g
        kept.append(decode._KEPT[peft_base(model).get_decoder()])
    if spares:
        assert made == [4, 2] and kept[2] is kept[0] is kept[4] and kept[3] is kept[1] is not kept[0]
    else:
        assert made == [4, 2, 4, 2, 4]
    decode._KEPT.clear()
    decode_keep.drop_spares(peft_base(model).get_decoder())


def test_trls_calls_get_their_rows_on_the_device_once(tiny_models):
    """TRL's own calls (``images=...``, ``return_tensors="pt"``; TRL moves their outputs to the device next) get tensors
    on the device, each image's rows copied there once; the processor's own calls (images passed positionally) get
    them where the image processor puts them. The meta device stands in for a GPU."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_models["qwen2_5_vl"])
    images = _random_images([(300, 200), (448, 448), (100, 60)])
    cached = CachedImageProcessor(processor.image_processor, RoundWork(), torch.device("meta"))
    moved = []
    for call in (images[:2], images, images[1:]):
        out = cached(images=call, return_tensors="pt")
        assert {v.device.type for v in out.values()} == {"meta"}
        assert (
            out["pixel_values"].shape
            == processor.image_processor(images=call, return_tensors="pt")["pixel_values"].shape
        )
        moved.append(len(cached._on_device))
    assert moved == [2, 3, 3]  # each image once
    own = cached(images[:1])  # the processor's own call, positional
    want = processor.image_processor(images[:1])
    assert own["pixel_values"].device.type == "cpu" and torch.equal(own["pixel_values"], want["pixel_values"])
