"""RynnBrain's formatted rows (its ``format_data.py`` output): a ChatML ``conversation`` whose every content item
carries the media metadata ``type / text / image / video / width / height / duration``, plus ``data_source``,
``id`` and ``text_sequence_length``::

    {"data_source": "trajectory_cot", "id": "0", "text_sequence_length": 256,
     "conversation": [{"role": "user", "content": [
         {"type": "image", "text": "", "image": "/abs/img.jpg", "video": "", "width": 1920, "height": 1080,
          "duration": 0.0},
         {"type": "text", "text": "Describe the trajectory.", "image": "", "video": "", "width": 0, "height": 0,
          "duration": 0.0}]},
       {"role": "assistant", "content": [...]}]}

RynnBrain rows keep every turn (``Thinking`` included) and their answer items (``{"frame1": [[x, y], ...]}``) as
they are; other formats become system / user / assistant turns. A frame taken from a video names it in its item's
``video`` field: its ``duration`` is then the video's length in seconds (read from the container with PyAV).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

from vlm_grpo.data.formats import IMAGE_TOKEN
from vlm_grpo.data.images import image_size

MEDIA_FIELDS = ("type", "text", "image", "video", "width", "height", "duration")


def media_item(kind: str, **fields: Any) -> dict[str, Any]:
    """A content item with every metadata field (empty strings / zeros where it has none)."""
    item = {"type": kind, "text": "", "image": "", "video": "", "width": 0, "height": 0, "duration": 0.0, **fields}
    item["duration"] = float(item["duration"])
    return item


@functools.lru_cache(maxsize=4096)
def video_duration(path: str) -> float:
    """Length of a video file in seconds, from its container (or its video stream) header."""
    try:
        import av
    except ImportError as exc:  # pragma: no cover - a dependency of qwen-vl-utils
        raise ValueError("reading a video's duration needs PyAV (pip install av)") from exc
    try:
        with av.open(path) as container:
            if container.duration:
                return container.duration / 1_000_000  # av.time_base
            stream = container.streams.video[0]
            if stream.duration and stream.time_base:
                return float(stream.duration * stream.time_base)
    except (OSError, av.error.FFmpegError, IndexError) as exc:
        raise ValueError(f"cannot read the duration of video {path}: {exc}") from None
    raise ValueError(f"video {path} states no duration")


def _resolve(path: str, roots: Sequence[str]) -> str:
    if not path or path.startswith("data:") or os.path.isabs(path):
        return path
    for root in roots:
        candidate = os.path.join(root, path)
        if os.path.exists(candidate):
            return os.path.abspath(candidate)
    return os.path.abspath(path)


def _items(content: Any, images: list[tuple[str, tuple[int, int]]], roots: Sequence[str]) -> list[Any]:
    """Content items with media metadata; image items take the next (path, size) of the checked row."""
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    out: list[Any] = []
    for item in content:
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "image":
            if images:
                path, (width, height) = images.pop(0)
            else:  # an image in a later turn (a Thinking turn that kept its images): read its header
                path = _resolve(str(item.get("image") or item.get("path") or ""), roots)
                width, height = image_size(path)
            video = _resolve(str(item.get("video") or ""), roots)
            duration = item.get("duration") or (video_duration(video) if video else 0.0)
            out.append(media_item("image", image=path, video=video, width=width, height=height, duration=duration))
        elif kind == "text":
            out.append(media_item("text", text=str(item.get("text", ""))))
        else:  # RynnBrain answers ({"frame1": [[x, y], ...]}) stay as written
            out.append(item)
    return out


def chatml_row(
    raw: dict[str, Any], row: dict[str, Any], length: int, data_source: str, index: int, roots: Sequence[str]
) -> dict[str, Any]:
    """The formatted row of one checked row (``row``: absolute ``image_path`` and ``image_sizes``) and its input."""
    images = list(zip(row["image_path"], [tuple(s) for s in row["image_sizes"]], strict=True))
    if isinstance(raw.get("conversation"), list):
        conversation = [
            {"role": turn["role"], "content": _items(turn.get("content"), images, roots)}
            for turn in raw["conversation"]
        ]
    else:
        conversation = []
        if row.get("system"):
            conversation.append({"role": "system", "content": [media_item("text", text=row["system"])]})
        user: list[dict[str, Any]] = []
        for k, part in enumerate(row["question"].split(IMAGE_TOKEN)):
            if k:
                path, (width, height) = images.pop(0)
                user.append(media_item("image", image=path, width=width, height=height))
            if part:
                user.append(media_item("text", text=part))
        conversation.append({"role": "user", "content": user})
        conversation.append({"role": "assistant", "content": [media_item("text", text=str(row["solution"]))]})
    return {
        "data_source": raw.get("data_source") or data_source,
        "id": str(raw.get("id") if raw.get("id") is not None else index),
        "text_sequence_length": length,
        "conversation": conversation,
    }
