"""Row images opened and decoded in one place: ``data:`` URIs, size limits, odd modes, damaged files.

Training, ``vlm-grpo-data check`` and the scoring service all open images through here, so an image is
judged the same way everywhere and every failure is an :class:`ImageError` (a ``ValueError``) whose
message says what is wrong; the caller adds the row's ``file:line``.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import warnings

import numpy as np
from PIL import Image, UnidentifiedImageError

#: The fewest pixels an image may have before it is refused unread, whatever ``--max_pixels`` says.
#: 64 MP (8192 x 8192): a 48 MP photo passes; decoding one costs ~200 MB as RGB.
MIN_PIXEL_LIMIT = 64 * 2**20
#: The limit is ``PIXEL_LIMIT_FACTOR x --max_pixels`` when that is larger than the floor: the model never
#: sees more than ``--max_pixels``, so a larger file only costs memory and time to shrink.
PIXEL_LIMIT_FACTOR = 4

_SIXTEEN_BIT = ("I;16", "I;16L", "I;16B", "I;16N")
_WITH_ALPHA = ("RGBA", "LA", "PA", "RGBa", "La")


class ImageError(ValueError):
    """An image that cannot be used, and why."""


class ImageTooLarge(ImageError):
    """An image with more pixels than the limit (found from its header, before any decoding)."""


def pixel_limit(max_pixels: int | None = None) -> int:
    """Largest pixel count (width x height) accepted for ``--max_pixels`` (None: the processor's default)."""
    return max(MIN_PIXEL_LIMIT, PIXEL_LIMIT_FACTOR * int(max_pixels or 0))


def describe(path: str) -> str:
    """A path for messages: ``data:`` URIs are shortened."""
    return f"{path[:40]}... ({len(path)} chars)" if path.startswith("data:") and len(path) > 60 else path


def data_uri_bytes(uri: str) -> bytes:
    """The payload of ``data:image/<type>;base64,<payload>``; :class:`ImageError` when it is malformed."""
    header, comma, payload = uri.partition(",")
    if not comma:
        raise ImageError("malformed data: URI (expected 'data:image/<type>;base64,<payload>')")
    if not header.endswith(";base64"):
        raise ImageError(f"data: URI is not base64 encoded ('{header[:40]}'); only ';base64,' URIs are read")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"bad base64 in data: URI: {exc}") from None


def open_image(path: str) -> Image.Image:
    """A lazily decoded image from a file path or a ``data:image/...;base64,`` URI; only the header is read."""
    if path.startswith("data:"):
        source: str | io.BytesIO = io.BytesIO(data_uri_bytes(path))
    else:
        if os.path.isdir(path):
            raise ImageError(f"{path} is a directory, not an image file")
        if not os.path.exists(path):
            raise ImageError(f"image file not found: {path}")
        if os.path.getsize(path) == 0:
            raise ImageError(f"image file is empty (0 bytes): {path}")
        source = path
    try:
        with warnings.catch_warnings():
            # our own limit (ImageTooLarge) decides; PIL's warning would only repeat it without the file
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(source)
    except Image.DecompressionBombError as exc:
        raise ImageTooLarge(f"image too large: {exc}") from None
    except UnidentifiedImageError:
        raise ImageError(f"not an image file (or a format PIL cannot read): {describe(path)}") from None
    except OSError as exc:
        raise ImageError(f"unreadable image {describe(path)}: {exc}") from None


#: how training and the data check name their limit in messages
TRAINING_LIMIT = f"max({MIN_PIXEL_LIMIT / 1e6:.1f} MP, {PIXEL_LIMIT_FACTOR} x --max_pixels)"


def check_pixels(width: int, height: int, limit: int | None, limit_name: str = TRAINING_LIMIT) -> None:
    """:class:`ImageTooLarge` when ``width x height`` exceeds ``limit`` (None: no limit)."""
    if limit is not None and width * height > limit:
        raise ImageTooLarge(
            f"image is {width}x{height} = {width * height / 1e6:.1f} MP, more than the limit of {limit / 1e6:.1f} MP "
            f"({limit_name}); downscale the file"
        )


def image_size(path: str, limit: int | None = None, limit_name: str = TRAINING_LIMIT) -> tuple[int, int]:
    """(width, height) from the header only; :class:`ImageTooLarge` over ``limit``."""
    with open_image(path) as image:
        check_pixels(*image.size, limit, limit_name)
        return image.size


def to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB, the way the processors expect it, without clipping or blackening anything.

    16-bit and 32-bit grey are scaled to 0-255 (``convert("RGB")`` clips them, turning most pixels white);
    float images in [0, 1] are scaled by 255, other float ranges stretched to 0-255; transparent pixels
    are composited onto white (as ``transformers``' ``convert_to_rgb`` does) instead of showing the colour
    hidden under alpha 0; palette, CMYK, YCbCr, LAB and 1-bit images go through PIL's conversions.
    """
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in _SIXTEEN_BIT or mode == "I":
        values = np.asarray(image).astype(np.float64)
        top = 65535.0 if mode in _SIXTEEN_BIT or (values.min() >= 0 and values.max() <= 65535) else values.max()
        low = 0.0 if top == 65535.0 else values.min()
        scaled = (values - low) * (255.0 / max(top - low, 1.0))
        return Image.fromarray(np.clip(np.rint(scaled), 0, 255).astype(np.uint8), "L").convert("RGB")
    if mode == "F":
        values = np.asarray(image).astype(np.float64)
        low, high = float(np.nanmin(values)), float(np.nanmax(values))
        if low >= 0.0 and high <= 1.0:
            scaled = values * 255.0
        else:
            scaled = (values - low) * (255.0 / max(high - low, 1e-12))
        return Image.fromarray(np.clip(np.rint(np.nan_to_num(scaled)), 0, 255).astype(np.uint8), "L").convert("RGB")
    if mode in _WITH_ALPHA or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def decode_rgb(path: str, limit: int | None = None, limit_name: str = TRAINING_LIMIT) -> Image.Image:
    """The whole image decoded to RGB (first frame of an animation); :class:`ImageError` when it cannot be.

    The pixel limit is checked from the header, before anything is decoded.
    """
    with open_image(path) as image:
        check_pixels(*image.size, limit, limit_name)
        try:
            image.load()
        except (OSError, SyntaxError, ValueError, EOFError) as exc:
            raise ImageError(f"image data is damaged or truncated ({describe(path)}): {exc}") from None
        rgb = to_rgb(image)
        return rgb.copy() if rgb is image else rgb  # closing the file must not close what we return
