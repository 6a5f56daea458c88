"""Video rows: a video (a file, or a list of frame images) enters the prompt as its sampled frames.

A row's ``video`` / ``videos`` column (or ``--video_key``) holds a path, or a list of frame images. Files are
decoded with PyAV: frames are sampled at ``--video_fps`` (at most ``--video_max_frames``, spread over the
whole clip when there are more), shrunk to ``--video_max_pixels``, and cached as PNG files keyed by the file,
its size and mtime and the options (``$VLM_GRPO_CACHE`` or ``~/.cache/vlm_grpo/frames``). A ``<video>``
marker in the question becomes one ``<image>`` marker per frame, where it stands (no marker: the frames go
in front), so every family takes the frames the way it takes images: the prompt-length check counts their
tokens exactly, the dataset holds frame paths decoded lazily, and the speed path (each frame encoded once
per group, shared prompt) applies unchanged. Rewards receive the original ``video`` value.

Why frames as images rather than the Qwen processors' native video input: TRL 1.16's ``GRPOTrainer`` passes
only images to the processor and the model (no ``pixel_values_videos`` / ``video_grid_thw``), so native
video would mean rewriting its generation and scoring. The cost: Qwen's temporal patch (2 frames merged
per token group) is not used, so a clip takes about twice the visual tokens of the native path. PyAV rather
than qwen-vl-utils' ``fetch_video``: the frames are resized by the image processor anyway, and PyAV gives
exact control of which frames are taken and a clear error for a bad file.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from vlm_grpo.data.formats import IMAGE_TOKEN, RowError

VIDEO_TOKEN = "<video>"
VIDEO_COLUMNS = ("video", "videos")


@dataclass(frozen=True)
class VideoOptions:
    fps: float = 2.0
    max_frames: int = 16
    max_pixels: int | None = None
    cache_dir: str | None = None

    def cache_root(self) -> Path:
        root = self.cache_dir or os.environ.get("VLM_GRPO_CACHE") or os.path.join("~", ".cache", "vlm_grpo")
        return Path(root).expanduser() / "frames"


def sample_times(duration: float, fps: float, max_frames: int) -> list[float]:
    """Timestamps (s) to take: every 1/fps from the start, or max_frames spread evenly over a longer clip."""
    count = max(1, int(duration * fps + 1e-6))
    if count > max_frames:
        return [duration * (i + 0.5) / max_frames for i in range(max_frames)]
    return [i / fps for i in range(count)]


def _cache_folder(path: str, options: VideoOptions) -> Path:
    stat = os.stat(path)
    key = f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}|{options.fps}|{options.max_frames}|"
    key += str(options.max_pixels)
    return options.cache_root() / hashlib.sha256(key.encode()).hexdigest()[:24]


def decode_frames(path: str, options: VideoOptions) -> list[str]:
    """PNG paths of the sampled frames of a video file (decoded once, then cached)."""
    if not os.path.isfile(path):
        raise RowError("video", f"video file not found: {path}")
    folder = _cache_folder(path, options)
    done = folder / "frames.txt"
    if done.is_file():
        return [str(folder / name) for name in done.read_text().split()]
    import av

    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise RowError("video", f"no video stream in {path}")
            frames = [(float(f.time or 0.0), f) for f in container.decode(video=0)]
            images = _pick(frames, options)
    except RowError:
        raise
    except Exception as exc:  # av.error.InvalidDataError and friends
        raise RowError("video", f"unreadable video {path}: {exc}") from exc
    if not images:
        raise RowError("video", f"video has no frames: {path}")
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for index, image in enumerate(images):
        name = f"frame_{index:04d}.png"
        tmp = folder / f".{name}.{os.getpid()}"
        image.save(tmp, format="PNG")
        os.replace(tmp, folder / name)  # ranks reading the same data race safely
        names.append(name)
    tmp = folder / f".frames.{os.getpid()}"
    tmp.write_text("\n".join(names))
    os.replace(tmp, done)
    return [str(folder / name) for name in names]


def _pick(frames: list, options: VideoOptions) -> list:
    """The decoded frames nearest to the sample times, as RGB images within max_pixels."""
    if not frames:
        return []
    step = frames[1][0] - frames[0][0] if len(frames) > 1 else 1.0
    duration = frames[-1][0] - frames[0][0] + step
    picked, seen = [], set()
    for t in sample_times(duration, options.fps, options.max_frames):
        index = min(range(len(frames)), key=lambda i: abs(frames[i][0] - frames[0][0] - t))
        if index not in seen:
            seen.add(index)
            picked.append(index)
    images = []
    for index in picked:
        image = frames[index][1].to_image().convert("RGB")
        if options.max_pixels and image.width * image.height > options.max_pixels:
            scale = (options.max_pixels / (image.width * image.height)) ** 0.5
            image = image.resize((max(1, int(image.width * scale)), max(1, int(image.height * scale))))
        images.append(image)
    return images


def video_value(row: dict, key: str | None) -> tuple[str | None, object]:
    """(column, value) of the row's video, if it has one."""
    for column in (key,) if key else VIDEO_COLUMNS:
        if column and row.get(column) not in (None, [], ""):
            return column, row[column]
    return None, None


def add_video(row: dict, value: object, folder: Path, options: VideoOptions) -> None:
    """Put the video's frames into a canonical row: images where its ``<video>`` marker stands."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str) and not _is_image(value[0]):
        value = value[0]  # EasyR1's ``videos: [path]``
    if isinstance(value, str):
        path = value if os.path.isabs(value) else str(folder / value)
        frames = decode_frames(path, options)
    elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        frames = [v if os.path.isabs(v) or v.startswith("data:") else str(folder / v) for v in value]
    else:
        raise RowError("video", "expected a video path or a list of frame image paths")
    question = row["question"]
    if question.count(VIDEO_TOKEN) > 1:
        raise RowError("video", f"the prompt has {question.count(VIDEO_TOKEN)} '{VIDEO_TOKEN}' markers for one video")
    if VIDEO_TOKEN not in question:
        question = VIDEO_TOKEN + question
    before = question[: question.index(VIDEO_TOKEN)].count(IMAGE_TOKEN)
    row["question"] = question.replace(VIDEO_TOKEN, IMAGE_TOKEN * len(frames), 1)
    row["image_path"] = [*row["image_path"][:before], *frames, *row["image_path"][before:]]


def _is_image(path: str) -> bool:
    return Path(path).suffix.lower() in (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")
