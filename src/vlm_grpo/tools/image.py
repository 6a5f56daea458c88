"""Image tools: ``zoom_in``, ``crop``, ``rotate``, and DeepEyes' own ``image_zoom_in_tool``.

Boxes are written in the frame the model family writes boxes in (the row's ``coord_sizes``): the resized
image's pixels for Qwen2.5-VL, 0-1000 for Qwen2-VL, Qwen3-VL and InternVL; images a tool returned use the
same rule on their own size. Bad arguments raise :class:`ToolError`, which the model reads as the result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from vlm_grpo.tools.base import ToolEnvironment, ToolError
from vlm_grpo.tools.protocols import DEEPEYES_TURN_PROMPT_V5, DEEPEYES_USER_PROMPT, DEEPEYES_VERSIONS

#: Smallest side (pixels) of a region that can be cut out: below it the vision encoder sees almost nothing.
MIN_REGION = 4
#: ``--tool_kwargs`` options of each image tool: ``zoom_in``'s longer side of the returned view, and whether a
#: larger region is left at its size (True) or scaled down to it.
OPTIONS: dict[str, dict[str, type]] = {"zoom_in": {"size": int, "upscale_only": bool}, "crop": {}, "rotate": {}}
OPTIONS["image_zoom_in_tool"] = {"version": str}


def _check_options(tool: str, options: dict[str, Any]) -> None:
    """A misspelt or mistyped option is an error when the run starts, not a setting silently not applied."""
    known = OPTIONS[tool]
    unknown = sorted(set(options) - set(known))
    if unknown:
        takes = f"known: {', '.join(sorted(known))}" if known else "it takes none"
        raise ValueError(f"--tool_kwargs: unknown {tool} tool option(s) {unknown}; {takes}")
    for name, value in options.items():
        kind = known[name]
        if name == "version":
            if value not in DEEPEYES_VERSIONS:
                raise ValueError(
                    f"--tool_kwargs: {tool} tool option version must be one of {', '.join(DEEPEYES_VERSIONS)} "
                    f"(DeepEyes' visual_toolbox_v2 / _v5), got {value!r}"
                )
            continue
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


#: DeepEyes' smallest crop side (pixels), v5: a box with a shorter side is grown around its centre to this size.
DEEPEYES_MIN_SIDE = 28
#: DeepEyes' v2 refuses a box (after clamping) whose shorter side is not over this many pixels.
DEEPEYES_V2_MIN_SIDE = 30
#: DeepEyes' largest aspect ratio (longer side / shorter side) of a box it crops.
DEEPEYES_MAX_ASPECT = 100
#: What DeepEyes tells the model after a tool result, per tool box version.
DEEPEYES_PROMPTS = {"v2": DEEPEYES_USER_PROMPT, "v5": DEEPEYES_TURN_PROMPT_V5}
DEEPEYES_TURN_PROMPT = DEEPEYES_TURN_PROMPT_V5


def _deepeyes_valid(left: float, top: float, right: float, bottom: float, version: str) -> str | None:
    """Why DeepEyes (tool box ``version``) would refuse this box, or None."""
    if not (left < right and top < bottom):
        return f"the box [{left:g}, {top:g}, {right:g}, {bottom:g}] is empty or inverted (needs x1 < x2, y1 < y2)"
    width, height = right - left, bottom - top
    if max(width, height) / min(width, height) > DEEPEYES_MAX_ASPECT:
        return f"the box is {width:g}x{height:g} pixels: longer side over {DEEPEYES_MAX_ASPECT}x the shorter"
    if version == "v2" and min(width, height) <= DEEPEYES_V2_MIN_SIDE:
        return f"the box is {width:g}x{height:g} pixels: both sides must be over {DEEPEYES_V2_MIN_SIDE}"
    return None


def deepeyes_box(box: Sequence[float], width: int, height: int, version: str = "v2") -> list[float]:
    """DeepEyes' rule for a zoom box in image pixels: clamp it to the image, then check it. ``v2`` refuses a box
    whose shorter side is 30 px or less; ``v5`` grows a box with a side under 28 px around its centre so that its
    shorter side is >= 28 (the grown box may reach past the image: the crop pads it). Both refuse an empty,
    inverted or over-thin (aspect over 100) box with a ToolError."""
    left, top = max(0.0, float(box[0])), max(0.0, float(box[1]))
    right, bottom = min(float(width), float(box[2])), min(float(height), float(box[3]))
    problem = _deepeyes_valid(left, top, right, bottom, version)
    if problem:
        raise ToolError(f"ZOOM IN ARGUMENTS ARE INVALID: {problem} after clamping to the {width}x{height} image")
    box_w, box_h = right - left, bottom - top
    if box_w >= DEEPEYES_MIN_SIDE and box_h >= DEEPEYES_MIN_SIDE:
        return [left, top, right, bottom]
    centre_x, centre_y = (left + right) / 2.0, (top + bottom) / 2.0
    ratio = DEEPEYES_MIN_SIDE / min(box_w, box_h)
    half_w, half_h = math.ceil(box_w * ratio * 0.5), math.ceil(box_h * ratio * 0.5)
    grown = [
        math.floor(centre_x - half_w),
        math.floor(centre_y - half_h),
        math.ceil(centre_x + half_w),
        math.ceil(centre_y + half_h),
    ]
    problem = _deepeyes_valid(*grown, version)
    if problem:
        raise ToolError(f"ZOOM IN ARGUMENTS ARE INVALID: {problem} after growing it to {DEEPEYES_MIN_SIDE} px")
    return [float(v) for v in grown]


def image_zoom_in_tool(env: ToolEnvironment, bbox_2d: list[float], label: str | None = None) -> list:
    image = env._image(0)  # DeepEyes always crops the conversation's first image
    if not isinstance(bbox_2d, (list, tuple)) or len(bbox_2d) != 4 or any(isinstance(v, bool) for v in bbox_2d):
        raise ToolError(f"bbox_2d must be a list of 4 numbers [x1, y1, x2, y2], got {bbox_2d!r}")
    try:
        values = [float(v) for v in bbox_2d]
    except (TypeError, ValueError):
        raise ToolError(f"bbox_2d must hold 4 numbers, got {bbox_2d!r}") from None
    if not all(math.isfinite(v) for v in values):
        raise ToolError(f"bbox_2d must hold 4 finite numbers, got {bbox_2d!r}")
    version = env._tool_options("image_zoom_in_tool").get("version", "v2")
    frame_w, frame_h = env.coord_sizes[0]
    width, height = image.size
    sx, sy = width / frame_w, height / frame_h  # the model's frame -> the image's pixels (1:1 for Qwen2.5-VL)
    box = deepeyes_box([values[0] * sx, values[1] * sy, values[2] * sx, values[3] * sy], width, height, version)
    region = image.crop(tuple(box))
    env._add_image(region)
    return [{"type": "image", "image": region}, {"type": "text", "text": DEEPEYES_PROMPTS[version]}]


# DeepEyes' tool description, word for word: the schema the chat template shows the model (lines kept under 120).
image_zoom_in_tool.__doc__ = (
    "Zoom in on a specific region of an image by cropping it based on a bounding box (bbox) and an optional "
    "object label.\n\n"
    "Args:\n"
    "    bbox_2d: The bounding box of the region to zoom in, as [x1, y1, x2, y2], where (x1, y1) is the top-left "
    "corner and (x2, y2) is the bottom-right corner.\n"
    "    label: The name or label of the object in the specified bounding box (optional).\n"
)


zoom_in.setup = lambda options: _check_options("zoom_in", options)  # type: ignore[attr-defined]
crop.setup = lambda options: _check_options("crop", options)  # type: ignore[attr-defined]
rotate.setup = lambda options: _check_options("rotate", options)  # type: ignore[attr-defined]
image_zoom_in_tool.setup = lambda options: _check_options("image_zoom_in_tool", options)  # type: ignore[attr-defined]
