"""``process_prompts_once``: the processor runs on a batch's distinct rows and its outputs are repeated.

What a user would notice: the same tensors as the processor's own call over every row (every family, both of
TRL's calls), the images of each distinct row preprocessed once, rows that differ in a single pixel or only
in their palette kept apart, and a batch the stand-in cannot lay out processed row by row with an info line.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch
from PIL import Image
from trl import GRPOTrainer

import test_group_sharing
from test_group_sharing import G, make_trainer
from vlm_grpo.fastpath.process_once import ProcessOnce, RowMatcher
from vlm_grpo.modules import get_vlm_module
from vlm_grpo.testing.tiny import FAMILIES

pytestmark = pytest.mark.usefixtures("one_torch_thread")
rows_file = test_group_sharing.rows_file  # the fixture: two rows, one and two images


def _image(seed: int, size=(64, 48)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _conversation(text: str, *images: Image.Image) -> list[dict]:
    content = [{"type": "image", "image": image} for image in images] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": content}]


def _batch() -> list[list[dict]]:
    """Repeated prompts as TRL's batches hold them: equal content in distinct objects, in any order, mixed."""
    a, b, c = (lambda: _image(1)), (lambda: _image(2, (56, 90))), (lambda: _image(3))
    return [
        _conversation("Red?", a()),
        _conversation("Compare these two, which is larger?", a(), b()),
        _conversation("Red?", a()),
        _conversation("No image here."),
        _conversation("Compare these two, which is larger?", a(), b()),
        _conversation("Red?", c()),  # same text and size, other pixels
        _conversation("No image here."),
    ]


def _equal(actual, expected) -> bool:
    if isinstance(expected, torch.Tensor):
        same_kind = isinstance(actual, torch.Tensor) and actual.dtype == expected.dtype
        return same_kind and torch.equal(actual.cpu(), expected)
    if isinstance(expected, (list, tuple)):
        return type(actual) is type(expected) and len(actual) == len(expected) and all(map(_equal, actual, expected))
    if dataclasses.is_dataclass(expected):  # e.g. the image features kept from generation (vision_reuse)
        fields = [f.name for f in dataclasses.fields(expected)]
        return type(actual) is type(expected) and all(_equal(getattr(actual, f), getattr(expected, f)) for f in fields)
    return actual == expected


def _same(actual, expected) -> None:
    assert set(actual) == set(expected)
    for key, value in expected.items():
        assert _equal(actual[key], value), key


class ImageCounter:
    """Counts the images the processor's image processor receives."""

    def __init__(self, monkeypatch, processor) -> None:
        self.images = 0
        kind = type(processor.image_processor)
        original = kind.__call__

        def counting(this, images=None, *args, **kwargs):
            flat = images
            while flat and isinstance(flat, list) and isinstance(flat[0], list):
                flat = [x for row in flat for x in row]
            self.images += len(flat) if isinstance(flat, list) else 1
            return original(this, images, *args, **kwargs)

        monkeypatch.setattr(kind, "__call__", counting)


@pytest.fixture(params=FAMILIES)
def processor(request, tiny_models):
    path = str(tiny_models[request.param])
    return get_vlm_module(path).load_processor(path)


def test_chat_template_call_equals_the_processors_over_every_row(processor, monkeypatch):
    batch = _batch()
    kwargs = {"add_generation_prompt": True, "tokenize": True, "return_dict": True}
    expected = processor.apply_chat_template(conversation=batch, **kwargs)
    counter = ImageCounter(monkeypatch, processor)
    actual = ProcessOnce(processor).apply_chat_template(conversation=batch, **kwargs)
    _same(actual, expected)
    assert counter.images == 4  # distinct rows: a | a, b | a' (other pixels); the repeats are not preprocessed


def test_padded_call_equals_the_processors_over_every_row(processor, monkeypatch):
    batch = _batch()
    text = [processor.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in batch]
    images = [[p["image"] for p in c[0]["content"] if p["type"] == "image"] for c in batch]
    expected = processor(images=images, text=text, padding=True, return_tensors="pt")
    counter = ImageCounter(monkeypatch, processor)
    actual = ProcessOnce(processor, device="cpu")(images=images, text=text, padding=True, return_tensors="pt")
    _same(actual, expected)
    assert counter.images == 4


def test_rows_differing_in_one_pixel_or_only_in_palette_stay_apart():
    base = _image(5)
    changed = base.copy()
    changed.putpixel((10, 10), tuple(255 - v for v in base.getpixel((10, 10))))
    paletted = Image.fromarray(np.arange(64 * 48, dtype=np.uint8).reshape(48, 64) % 4, mode="L").convert("P")
    paletted.putpalette([0, 0, 0, 255, 0, 0, 0, 255, 0, 0, 0, 255])
    repainted = paletted.copy()
    repainted.putpalette([0, 0, 0, 0, 255, 0, 255, 0, 0, 0, 0, 255])
    rows = [("q", [base]), ("q", [changed]), ("q", [base.copy()]), ("q", [paletted]), ("q", [repainted])]
    assert RowMatcher().distinct(rows) == ([0, 1, 3, 4], [0, 1, 0, 2, 3])
    # Negative control: the same rows with the pixel and the palette restored collapse into two.
    rows = [("q", [base]), ("q", [base.copy()]), ("q", [paletted]), ("q", [paletted.copy()])]
    assert RowMatcher().distinct(rows) == ([0, 2], [0, 0, 1, 1])


class KeyedProcessor:
    """A processor whose output has a key the stand-in does not know how to lay out per row."""

    def __init__(self) -> None:
        self.rows_seen: list[int] = []

    def __call__(self, images=None, text=None, **kwargs):
        self.rows_seen.append(len(text))
        return {"input_ids": torch.arange(len(text))[:, None], "crop_boxes": torch.zeros(len(text), 4)}


def test_outputs_it_cannot_lay_out_are_processed_row_by_row_with_one_info_line(caplog, monkeypatch):
    monkeypatch.setattr("vlm_grpo.utils._warned", set())
    inner = KeyedProcessor()
    image = _image(0)
    with caplog.at_level(logging.INFO, logger="vlm_grpo.fastpath.process_once"):
        out = ProcessOnce(inner)(images=[[image], [image], [image]], text=["q", "q", "q"])
    assert inner.rows_seen == [1, 3]  # the distinct row, then every row
    assert out["input_ids"].tolist() == [[0], [1], [2]]
    assert "crop_boxes" in caplog.text and "row by row" in caplog.text


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_scores_the_same_with_the_processor_once_per_prompt(family, tiny_models, rows_file, tmp_path,
                                                                    monkeypatch):  # fmt: skip
    outputs = {}
    for once in (False, True):
        trainer = make_trainer(tiny_models[family], rows_file, tmp_path / str(once), process_prompts_once=once)
        trainer.model.eval()
        batch = next(iter(trainer.get_train_dataloader()))
        counter = ImageCounter(monkeypatch, trainer.processing_class)
        processor = trainer.processing_class
        torch.manual_seed(0)
        outputs[once] = trainer._generate_and_score_completions(batch)
        assert trainer.processing_class is processor  # the stand-in lived for the call only
        monkeypatch.undo()
        outputs[f"images{once}"] = counter.images
    _same(outputs[True], outputs[False])
    # Two prompts of 1 and 2 images, G copies each, in TRL's two processor calls.
    assert outputs["imagesFalse"] == 2 * G * 3 and outputs["imagesTrue"] == 2 * 3


def test_the_processor_is_restored_when_the_batch_fails(tiny_models, rows_file, tmp_path, monkeypatch):
    trainer = make_trainer(tiny_models["qwen2_vl"], rows_file, tmp_path)
    processor = trainer.processing_class

    def fail(self, inputs):
        assert isinstance(self.processing_class, ProcessOnce)
        raise RuntimeError("reward server down")

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", fail)
    with pytest.raises(RuntimeError, match="reward server down"):
        trainer._generate_and_score_completions([])
    assert trainer.processing_class is processor


class NoEquality:
    def __eq__(self, other):
        raise TypeError("no ==")

    __hash__ = object.__hash__


def test_rows_are_compared_by_value_for_every_kind_of_column():
    """Arrays and tensors by dtype, shape and values; an image never equals a non-image; a value whose == fails
    is its own row (never shared, never wrong)."""
    a = np.arange(6).reshape(2, 3)
    t = torch.arange(6).reshape(2, 3)
    image = _image(1)
    rows = [
        a, a.copy(), a.astype(np.float32), a + 1,  # 0 0 2 3
        t, t.clone(), t.float(), t.reshape(3, 2), t + 1,  # 4 4 6 7 8
        image, image.copy(), np.asarray(image),  # 9 9 11
        {"k": [1, "x"]}, {"k": [1, "x"]}, {"k": [1, "y"]},  # 12 12 14
    ]  # fmt: skip
    leaders, index = RowMatcher().distinct(rows)
    assert [leaders[i] for i in index] == [0, 0, 2, 3, 4, 4, 6, 7, 8, 9, 9, 11, 12, 12, 14]
    odd = NoEquality()
    matcher = RowMatcher()
    assert not matcher.equal(odd, NoEquality()) and matcher.equal(odd, odd)  # the same object is itself
    assert not matcher.equal(image, np.asarray(image)) and not matcher.equal(np.asarray(image), image)
    assert matcher.equal(t, t.clone()) and not matcher.equal(t, t.reshape(3, 2))
    assert matcher.equal(a, a.copy()) and not matcher.equal(a, a.astype(np.int8))
    # an image's bytes are kept per object: a new image at a reused id is read afresh
    first = Image.new("RGB", (4, 4), (1, 2, 3))
    assert matcher.equal(first, first.copy())
    other = Image.new("RGB", (4, 4), (9, 9, 9))
    assert not matcher.equal(other, first) and not matcher.equal(other.copy(), first.copy())


class RowsSpy:
    """A processor that returns one id per row (its text's length) and records how many rows each call had."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, *args, images=None, text=None, **kwargs):
        rows = text if isinstance(text, list) else [text]
        self.calls.append(len(rows))
        return {"input_ids": torch.tensor([[len(t)] for t in rows]), "attention_mask": torch.ones(len(rows), 1)}

    def apply_chat_template(self, conversation, *args, **kwargs):
        rows = conversation if isinstance(conversation, list) and isinstance(conversation[0], list) else [conversation]
        self.calls.append(len(rows))
        return {"input_ids": torch.tensor([[len(str(c))] for c in rows])}


def test_which_calls_run_once_per_distinct_row_and_which_run_as_they_are():
    image = _image(2)
    twice = {"text": ["ab", "ab"], "images": [[image], [image]]}
    cases = [
        (twice, [1]),  # two copies: the processor sees one row
        ({"text": ["ab", "ab"], "images": [None, None]}, [1]),  # text-only rows share too
        ({"text": ["ab"], "images": [[image]]}, [1]),  # one row: nothing to share, passed through
        ({**twice, "videos": [None]}, [2]),  # videos: not laid out per row
        ({**twice, "audio": [None]}, [2]),
        ({"text": "ab", "images": [[image]]}, [1]),  # not a batch
        ({"text": ["ab", "ab"], "images": [image, image]}, [2]),  # images not given per row
        ({"text": ["ab", "ab", "ab"], "images": [[image], [image]]}, [3]),  # counts differ
    ]
    for kwargs, calls in cases:
        spy = RowsSpy()
        out = ProcessOnce(spy)(**kwargs)
        assert spy.calls == calls, kwargs.keys()
        rows = len(kwargs["text"]) if isinstance(kwargs["text"], list) else 1
        assert out["input_ids"].shape[0] == rows
    spy = RowsSpy()
    ProcessOnce(spy)("positional", **twice)
    assert spy.calls == [2]


def test_chat_template_calls_run_once_only_when_tokenized_to_a_dict():
    conversation = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    both = [conversation, conversation]
    for kwargs, calls in [
        ({"tokenize": True, "return_dict": True}, [1]),
        ({"tokenize": True}, [2]),
        ({"return_dict": True}, [2]),
        ({"tokenize": False, "return_dict": True}, [2]),
    ]:
        spy = RowsSpy()
        out = ProcessOnce(spy).apply_chat_template(both, **kwargs)
        assert spy.calls == calls and out["input_ids"].shape[0] == 2, kwargs
    spy = RowsSpy()
    ProcessOnce(spy).apply_chat_template(both, "extra", tokenize=True, return_dict=True)
    assert spy.calls == [2]
    spy = RowsSpy()  # content the stand-in does not lay out (a video part): every row
    video = [{"role": "user", "content": [{"type": "video"}]}]
    ProcessOnce(spy).apply_chat_template([video, video], tokenize=True, return_dict=True)
    assert spy.calls == [2]
    spy = RowsSpy()  # a single conversation, not a batch
    ProcessOnce(spy).apply_chat_template(conversation, tokenize=True, return_dict=True)
    assert spy.calls == [1]


def test_repeated_outputs_go_to_the_device_asked_for():
    image = _image(3)
    spy = RowsSpy()
    out = ProcessOnce(spy, device="meta")(text=["ab", "ab"], images=[[image], [image]])
    assert spy.calls == [1] and out["input_ids"].device.type == "meta" and out["input_ids"].shape == (2, 1)
    out = ProcessOnce(RowsSpy())(text=["ab", "ab"], images=[[image], [image]])
    assert out["input_ids"].device.type == "cpu" and out["input_ids"].dtype == torch.long
