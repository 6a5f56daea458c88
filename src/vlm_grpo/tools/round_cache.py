"""Per-round host work of TRL's tool loop, done once per step instead of once per rollout and round.

Every round of TRL's tool loop does, on the host, work that grows with the rollouts and their history:

* ``_get_tool_suffix_ids`` renders two chat templates per rollout (the reply tokens after a dummy call), and the
  processor behind them preprocesses the reply's images again;
* the loop runs the image processor on *every* image of every live rollout (prompt images and all tool images so
  far), round after round, and copies all their pixels to the device.

:class:`RoundCaches` serves both from what the step has seen already: a reply's tokens depend only on its
messages' text and its images' sizes (the processor expands an image placeholder by the image's grid or tile count,
read from its size), so they are computed once per reply shape (:class:`SuffixIds`); an image's preprocessed rows
depend only on its pixels and the call's options, so each image is preprocessed (and copied to the device) once and
its rows are reused (:class:`CachedImageProcessor`). Outputs are the ones the uncached calls return (tests compare
them). A processor whose outputs it cannot cut per image (padded to the batch's largest image, tiles counted per
batch) runs as it is.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from vlm_grpo.utils import warn_once

logger = logging.getLogger(__name__)


@dataclass
class RoundWork:
    """What one step's tool generation asked of the host, and what it actually ran: reply suffixes asked for and
    rendered (each render is two chat templates), images asked of the image processor and preprocessed."""

    suffix_requests: int = 0
    suffix_renders: int = 0
    image_requests: int = 0
    images_processed: int = 0
    processor_calls: int = 0


def _image_key(image: Image.Image, memo: dict[int, tuple[Any, bytes]]) -> bytes:
    """A key of an image's contents (kept per object: the same object is hashed once)."""
    known = memo.get(id(image))
    if known is not None and known[0] is image:
        return known[1]
    digest = hashlib.blake2b(image.tobytes(), digest_size=16)
    digest.update(repr((image.mode, image.size, image.getpalette())).encode())
    memo[id(image)] = (image, digest.digest())
    return memo[id(image)][1]


def _frozen(value: Any) -> Hashable:
    """``value`` as a hashable key; TypeError for what has no stable one (tensors, arrays, objects)."""
    if value is None or isinstance(value, (str, bytes, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    raise TypeError(type(value).__name__)


def _flat_images(images: Any) -> list | None:
    """The images of a call, in the order the processor lays out their rows; None for anything but PIL images."""
    if isinstance(images, Image.Image):
        return [images]
    if not isinstance(images, (list, tuple)):
        return None
    flat: list = []
    for item in images:
        if isinstance(item, Image.Image):
            flat.append(item)
        elif isinstance(item, (list, tuple)) and all(isinstance(x, Image.Image) for x in item):
            flat.extend(item)
        else:
            return None
    return flat


def _per_image(out: Any, count: int) -> list[dict[str, Any]] | None:
    """Each image's share of an image processor's output for ``count`` images, or None when the layout is not one
    where an image's rows are its own: rows per image read from ``image_grid_thw`` (Qwen, GLM) or ``num_patches``
    (InternVL's tiles), or one row an image."""
    keys = set(out.keys())
    pixels = out.get("pixel_values")
    if not isinstance(pixels, (torch.Tensor, list)) or not keys <= {"pixel_values", "image_grid_thw", "num_patches"}:
        return None
    grid = out.get("image_grid_thw")
    if grid is not None:
        units = torch.as_tensor(grid).prod(-1).tolist()
    elif out.get("num_patches") is not None:
        units = torch.as_tensor(out["num_patches"]).tolist()
    else:
        units = [1] * count
    if len(units) != count or sum(units) != len(pixels):
        return None
    shares: list[dict[str, Any]] = [{} for _ in range(count)]
    for key, value in out.items():
        sizes = units if key == "pixel_values" else [1] * count
        if isinstance(value, torch.Tensor):
            pieces = list(value.split(sizes))
        elif isinstance(value, list) and len(value) == sum(sizes):  # kept a list, as the processor returned it
            starts = [sum(sizes[:i]) for i in range(count + 1)]
            pieces = [value[starts[i] : starts[i + 1]] for i in range(count)]
        else:
            return None
        if len(pieces) != count:
            return None
        for share, piece in zip(shares, pieces, strict=True):
            share[key] = piece
    return shares


def _joined(pieces: list) -> Any:
    return torch.cat(pieces) if isinstance(pieces[0], torch.Tensor) else [x for piece in pieces for x in piece]


class CachedImageProcessor:
    """The image processor of one step (generation, tool loop, log-prob passes): each image (by its pixels) is
    preprocessed once per call options, and a call returns the rows of its images from what was preprocessed, in its
    order. Everything else is the image processor's own.

    A call without ``return_tensors`` (the processor's own, inside ``apply_chat_template``) shares the rows of calls
    with ``return_tensors="pt"`` (TRL's) once such a call was seen to return tensors too; InternVL's returns lists
    there, kept apart.

    ``device``: where TRL's own calls (``image_processor(images=..., return_tensors="pt")``, whose outputs TRL moves
    there next) get their tensors: each image's rows are copied there once, not every image of the history in every
    round. The processor's calls get them where the image processor puts them."""

    _OWN = ("_inner", "_work", "_rows", "_memo", "_off", "_plain_tensors", "_device", "_on_device")

    def __init__(self, image_processor: Any, work: RoundWork, device: torch.device | None = None) -> None:
        self._inner = image_processor
        self._work = work
        self._rows: dict[tuple[bytes, Hashable, bool], dict[str, Any]] = {}
        self._memo: dict[int, tuple[Any, bytes]] = {}
        self._off: set[Hashable] = set()  # call options whose outputs cannot be cut per image
        self._plain_tensors: dict[Hashable, bool] = {}  # options -> whether a call without return_tensors gives tensors
        self._device = device
        self._on_device: dict[tuple[bytes, Hashable, bool], dict[str, Any]] = {}

    def __getattr__(self, name: str) -> Any:
        if name in CachedImageProcessor._OWN:
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in CachedImageProcessor._OWN:
            object.__setattr__(self, name, value)
        else:  # a setting of the image processor's own
            setattr(self._inner, name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        call = (args, dict(kwargs))  # as given, for calls passed on as they are
        trls = "images" in kwargs and not args and set(kwargs) == {"images", "return_tensors"}
        images = kwargs.pop("images") if "images" in kwargs else (args[0] if args else None)
        args = args[1:] if args and images is args[0] else args
        flat = None if args else _flat_images(images)
        pt = kwargs.get("return_tensors") == "pt"
        try:
            options = _frozen({k: v for k, v in kwargs.items() if k != "return_tensors"})
        except TypeError:
            flat = None
        if not flat or options in self._off or kwargs.get("return_tensors") not in (None, "pt"):
            return self._through(images, *call[0], **call[1])
        from transformers import BatchFeature

        tensors = pt or self._plain_tensors.get(options, False)
        keys = [(_image_key(image, self._memo), options, tensors) for image in flat]
        self._work.image_requests += len(flat)
        new: dict[tuple[bytes, Hashable, bool], Image.Image] = {}
        for key, image in zip(keys, flat, strict=True):
            if key not in self._rows:
                new.setdefault(key, image)
        if new:
            out = self._through(list(new.values()), list(new.values()), **kwargs)
            shares = _per_image(out, len(new))
            if shares is None:
                self._off.add(options)
                warn_once(
                    logger,
                    f"tool loop: the image processor's outputs ({', '.join(sorted(out.keys()))}) cannot be cut per "
                    "image: every round preprocesses every image of the conversations",
                    logging.INFO,
                )
                return self._through(images, *call[0], **call[1]) if len(new) != len(flat) else out
            if not pt and options not in self._plain_tensors:
                self._plain_tensors[options] = all(isinstance(v, torch.Tensor) for v in out.values())
                if self._plain_tensors[options]:  # the same rows as a call with return_tensors="pt"
                    keys = [(k[0], options, True) for k in keys]
                    new = {(k[0], options, True): image for k, image in new.items()}
            self._rows.update(zip(new, shares, strict=True))
        rows = self._rows
        if trls and pt and self._device is not None:
            rows = self._on_device
            for key in keys:
                if key not in rows:
                    rows[key] = {
                        k: v.to(self._device) if isinstance(v, torch.Tensor) else v for k, v in self._rows[key].items()
                    }
        first = rows[keys[0]]
        return BatchFeature(data={name: _joined([rows[key][name] for key in keys]) for name in first})

    def _through(self, counted: Any, /, *args: Any, **kwargs: Any) -> Any:
        """The image processor's own call (``args``, ``kwargs`` as it gets them), counted; ``counted``: its images."""
        self._work.processor_calls += 1
        self._work.images_processed += len(_flat_images(counted) or []) if counted is not None else 0
        return self._inner(*args, **kwargs)


def _reply_key(messages: Sequence[dict[str, Any]]) -> Hashable:
    """What a reply's tokens depend on: its messages with each image as its mode and size (the processor expands a
    placeholder by the image's size, never by its pixels); TypeError for content without a stable key."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            blocks = []
            for block in content:
                if not isinstance(block, dict):
                    raise TypeError(type(block).__name__)
                image = block.get("image")
                if isinstance(image, Image.Image):
                    rest = {k: v for k, v in block.items() if k != "image"}
                    blocks.append(("image", image.mode, image.size, _frozen(rest)))
                else:
                    blocks.append(_frozen(block))
            content = tuple(blocks)
        else:
            content = _frozen(content)
        out.append((_frozen({k: v for k, v in message.items() if k != "content"}), content))
    return tuple(out)


class SuffixIds:
    """The reply tokens of TRL's ``_get_tool_suffix_ids``, rendered once per reply shape (:func:`_reply_key`) in a
    step and reused for every rollout and round with the same shape."""

    def __init__(self, render: Callable[[list[dict[str, Any]]], list[int]], work: RoundWork) -> None:
        self._render = render
        self._work = work
        self._ids: dict[Hashable, list[int]] = {}

    def __call__(self, messages: list[dict[str, Any]]) -> list[int]:
        self._work.suffix_requests += 1
        try:
            key = _reply_key(messages)
        except TypeError:
            key = None
        if key is not None and key in self._ids:
            return list(self._ids[key])
        self._work.suffix_renders += 1
        ids = list(self._render(messages))
        if key is not None:
            self._ids[key] = ids
        return list(ids)


class RoundCaches:
    """The caches of one step (see the module's docstring) and what they saved (``work``)."""

    def __init__(self, render: Callable[[list[dict[str, Any]]], list[int]]) -> None:
        self.work = RoundWork()
        self.suffix = SuffixIds(render, self.work)

    @contextmanager
    def images(self, processor: Any, device: torch.device | None = None) -> Iterator[None]:
        """``processor.image_processor`` is a :class:`CachedImageProcessor` inside the block, its own after it."""
        inner = getattr(processor, "image_processor", None)
        if inner is None:
            yield
            return
        processor.image_processor = CachedImageProcessor(inner, self.work, device)
        try:
            yield
        finally:
            processor.image_processor = inner
