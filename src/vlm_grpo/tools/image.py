"""DeepEyes-style image tools: ``zoom_in``, ``crop``, ``rotate``.

Boxes are written in the frame the model family writes boxes in (the row's ``coord_sizes``): the resized
image's pixels for Qwen2.5-VL, 0-1000 for Qwen2-VL, Qwen3-VL and InternVL; images a tool returned use the
same rule on their own size. Bad arguments raise :class:`ToolError`, which the model reads as the result.
"""

from __future__ import annotations

import math
from typing import Any

from vlm_grpo.tools.base import ToolEnvironment, ToolError

#: Smallest side (pixels) of a region that can be cut out: below it the vision encoder sees almost nothing.
MIN_REGION = 4
#: ``--tool_kwargs`` options of each image tool: ``zoom_in``'s longer side of the returned view, and whether a
#: larger region is left at its size (True) or scaled down to it.
OPTIONS: dict[str, dict[str, type]] = {"zoom_in": {"size": int, "upscale_only": bool}, "crop": {}, "rotate": {}}


def _check_options(tool: str, options: dict[str, Any]) -> None:
    """A misspelt or mistyped option is an error when the run starts, not a setting silently not applied."""
    known = OPTIONS[tool]
    unknown = sorted(set(options) - set(known))
    if unknown:
        takes = f"known: {', '.join(sorted(known))}" if known else "it takes none"
        raise ValueError(f"--tool_kwargs: unknown {tool} tool option(s) {unknown}; {takes}")
    for name, value in options.items():
        kind = known[name]
        if type(value) is not kind or (kind is int and value <= 0):
            what = "a positive integer" if kind is int else "true or false"
            raise ValueError(f"--tool_kwargs: {tool} tool option {name} must be {what}, got {value!r}")


def _box(env: ToolEnvironment, bbox_2d: Any, image_index: Any) -> tuple[Any, int, tuple[int, int, int, int]]:
    """The image and the box in its pixels, or a ToolError saying what is wrong with the box."""
    image = env._image(image_index)
    index = int(image_index)
    if not isinstance(bbox_2d, (list, tuple)) or len(bbox_2d) != 4:
        raise ToolError(f"bbox_2d must be a list of 4 numbers [x1, y1, x2, y2], got {bbox_2d!r}")
    try:
        x1, y1, x2, y2 = (float(v) for v in bbox_2d)
    except (TypeError, ValueError):
        raise ToolError(f"bbox_2d must hold 4 numbers, got {bbox_2d!r}") from None
    if isinstance(bbox_2d[0], bool) or not all(math.isfinite(v) for v in (x1, y1, x2, y2)):
        raise ToolError(f"bbox_2d must hold 4 finite numbers, got {bbox_2d!r}")
    frame_w, frame_h = env.coord_sizes[index]
    if x2 <= x1 or y2 <= y1:
        raise ToolError(f"bbox_2d {bbox_2d!r} is empty or inverted: it needs x1 < x2 and y1 < y2")
    if x1 < 0 or y1 < 0 or x2 > frame_w or y2 > frame_h:
        raise ToolError(
            f"bbox_2d {bbox_2d!r} lies outside image {index}: coordinates go from (0, 0) to ({frame_w}, {frame_h})"
        )
    width, height = image.size
    sx, sy = width / frame_w, height / frame_h
    left, top = math.floor(x1 * sx), math.floor(y1 * sy)
    right, bottom = min(width, math.ceil(x2 * sx)), min(height, math.ceil(y2 * sy))
    if right - left < MIN_REGION or bottom - top < MIN_REGION:
        raise ToolError(
            f"bbox_2d {bbox_2d!r} is {right - left}x{bottom - top} pixels of image {index}; "
            f"a region needs at least {MIN_REGION}x{MIN_REGION}"
        )
    return image, index, (left, top, right, bottom)


def _result(env: ToolEnvironment, image: Any, text: str) -> list[dict[str, Any]]:
    new_index = env._add_image(image)
    return [{"type": "text", "text": f"{text} (image {new_index}):"}, {"type": "image", "image": image}]


def zoom_in(env: ToolEnvironment, bbox_2d: list[float], image_index: int = 0, label: str | None = None) -> list:
    """Zoom in on a region of an image and look at it in more detail.

    Args:
        bbox_2d: The region as [x1, y1, x2, y2], in the same coordinates you use for boxes in the image.
        image_index: Which image to zoom into: 0 is the first image of the conversation.
        label: Optional name of the object in the region.
    """
    image, index, box = _box(env, bbox_2d, image_index)
    region = image.crop(box)
    options = env._tool_options("zoom_in")
    target = int(options.get("size", 448))  # the longer side of the returned view
    scale = target / max(region.size)
    if scale > 1 or not options.get("upscale_only", True):
        region = region.resize((max(1, round(region.width * scale)), max(1, round(region.height * scale))))
    what = f"'{label}'" if label else "the region"
    return _result(env, region, f"Zoomed in on {what} {list(bbox_2d)} of image {index}")


def crop(env: ToolEnvironment, bbox_2d: list[float], image_index: int = 0) -> list:
    """Cut a region out of an image, at its original resolution.

    Args:
        bbox_2d: The region as [x1, y1, x2, y2], in the same coordinates you use for boxes in the image.
        image_index: Which image to crop: 0 is the first image of the conversation.
    """
    image, index, box = _box(env, bbox_2d, image_index)
    return _result(env, image.crop(box), f"Cropped {list(bbox_2d)} from image {index}")


def rotate(env: ToolEnvironment, angle: float, image_index: int = 0) -> list:
    """Rotate an image counter-clockwise (the canvas grows to keep the corners).

    Args:
        angle: Rotation in degrees, counter-clockwise, between -360 and 360.
        image_index: Which image to rotate: 0 is the first image of the conversation.
    """
    image = env._image(image_index)
    try:
        degrees = float(angle)
    except (TypeError, ValueError):
        raise ToolError(f"angle must be a number of degrees, got {angle!r}") from None
    if isinstance(angle, bool) or not math.isfinite(degrees) or abs(degrees) > 360:
        raise ToolError(f"angle must be a number of degrees between -360 and 360, got {angle!r}")
    rotated = image.rotate(degrees, expand=True, fillcolor=(0, 0, 0) if image.mode == "RGB" else None)
    return _result(env, rotated, f"Image {int(image_index)} rotated by {degrees:g} degrees")


zoom_in.setup = lambda options: _check_options("zoom_in", options)  # type: ignore[attr-defined]
crop.setup = lambda options: _check_options("crop", options)  # type: ignore[attr-defined]
rotate.setup = lambda options: _check_options("rotate", options)  # type: ignore[attr-defined]
