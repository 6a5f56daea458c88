"""Video rows: sampled frames enter the prompt as images (every family), counted exactly; bad videos are bad rows."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from e2e_utils import REWARD_PLUGIN, base_args
from vlm_grpo.data.jsonl import open_image, prompt_lengths
from vlm_grpo.data.sources import read_sources
from vlm_grpo.data.video import VideoOptions, decode_frames, sample_times


def write_video(path: Path, n: int = 8, fps: int = 4, size: tuple[int, int] = (64, 48)) -> Path:
    """A clip whose frame i is a flat colour with red = 30 * i."""
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for i in range(n):
            frame = np.zeros((size[1], size[0], 3), np.uint8)
            frame[:, :, 0] = 30 * i
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_audio_only(path: Path) -> Path:
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    return path


@pytest.fixture
def clip(tmp_path) -> Path:
    return write_video(tmp_path / "clip.mp4")


def test_frames_are_sampled_at_the_asked_rate_and_cached(clip, tmp_path):
    assert sample_times(2.0, 2.0, 16) == [0.0, 0.5, 1.0, 1.5]
    assert sample_times(10.0, 2.0, 4) == [1.25, 3.75, 6.25, 8.75]
    options = VideoOptions(fps=2.0, max_frames=16, cache_dir=str(tmp_path / "cache"))
    frames = decode_frames(str(clip), options)
    # 8 frames at 4 fps = 2 s; at 2 fps: frames 0, 2, 4, 6 (red 0, 60, 120, 180; mpeg4 is lossy)
    reds = [open_image(f).convert("RGB").getpixel((30, 20))[0] for f in frames]
    assert reds == pytest.approx([0, 60, 120, 180], abs=12)
    assert decode_frames(str(clip), options) == frames  # from the cache
    few = decode_frames(str(clip), VideoOptions(fps=2.0, max_frames=2, max_pixels=600, cache_dir=str(tmp_path / "c")))
    assert len(few) == 2
    width, height = open_image(few[0]).size
    assert width * height <= 600 and width / height == pytest.approx(64 / 48, rel=0.1)


def test_video_marker_becomes_frames_where_it_stands_and_bad_videos_are_bad_rows(clip, tmp_path):
    from PIL import Image

    Image.new("RGB", (56, 56), (0, 0, 200)).save(tmp_path / "still.png")
    (tmp_path / "corrupt.mp4").write_bytes(b"\x00\x01not a video" * 50)
    write_audio_only(tmp_path / "sound.mp4")  # a media file with zero video frames
    rows = [
        {"problem": "Compare <image> with <video> now.", "answer": "x", "images": ["still.png"], "video": "clip.mp4"},
        {"problem": "What happens?", "answer": "y", "videos": ["clip.mp4"]},
        {"problem": "<video>?", "answer": "z", "video": "missing.mp4"},
        {"problem": "<video>?", "answer": "z", "video": "corrupt.mp4"},
        {"problem": "<video> and <video>?", "answer": "z", "video": "clip.mp4"},
        {"problem": "<video>?", "answer": "z", "video": "sound.mp4"},
    ]
    data = tmp_path / "v.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    video = VideoOptions(fps=2.0, cache_dir=str(tmp_path / "cache"))
    good, bad = read_sources(str(data), video=video)
    assert [g["source"] for g in good] == [f"{data}:1", f"{data}:2"]
    first, second = good
    assert first["question"] == "Compare <image> with <image><image><image><image> now."
    assert first["image_path"][0] == str(tmp_path / "still.png") and len(first["image_path"]) == 5
    assert second["question"].startswith("<image>" * 4 + "What happens?")
    assert first["extra"]["video"] == "clip.mp4" and second["extra"]["videos"] == ["clip.mp4"]
    assert [(b.source, b.field) for b in bad] == [(f"{data}:{i}", "video") for i in (3, 4, 5, 6)]
    assert "video file not found" in bad[0].reason and "unreadable video" in bad[1].reason
    assert "2 '<video>' markers" in bad[2].reason and "no video stream" in bad[3].reason


def test_prompt_length_counts_the_frames_exactly(clip, tmp_path, tiny_models):
    from vlm_grpo.configs import VLMModelConfig
    from vlm_grpo.recipe import pick_module

    module, processor = pick_module(VLMModelConfig(model_name_or_path=str(tiny_models["qwen2_5_vl"])))
    video = VideoOptions(fps=2.0, cache_dir=str(tmp_path / "cache"))
    data = tmp_path / "v.jsonl"
    data.write_text(json.dumps({"problem": "<video>What happens?", "answer": "y", "video": "clip.mp4"}) + "\n")
    (row,), _ = read_sources(str(data), video=video)
    frames = decode_frames(str(clip), video)
    same = tmp_path / "frames.jsonl"
    same.write_text(json.dumps({"problem": "<image>" * 4 + "What happens?", "answer": "y", "images": frames}) + "\n")
    (as_images,), _ = read_sources(str(same))
    lengths = prompt_lengths([row, as_images], module, processor)
    text_only = prompt_lengths([{**row, "question": "What happens?", "image_sizes": []}], module, processor)[0]
    assert lengths[0] == lengths[1] > text_only + 4 * 3  # each 64x48 frame costs the family's image tokens


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl"])
def test_video_rows_train_two_steps(family, tiny_models, tmp_path, monkeypatch):
    from vlm_grpo.grpo_jsonl import main, parse_args

    monkeypatch.setenv("VLM_GRPO_CACHE", str(tmp_path / "cache"))
    (tmp_path / "images").mkdir()  # base_args' --image_folders: videos resolve against it like images
    write_video(tmp_path / "images" / "clip.mp4")
    write_video(tmp_path / "images" / "other.mp4", n=6)
    rows = [
        {"problem": "<video>What changes?", "answer": "red", "video": "clip.mp4"},
        {"problem": "How many frames in <video>?", "answer": "3", "video": "other.mp4"},
    ]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plugin = tmp_path / "my_rewards.py"
    plugin.write_text(REWARD_PLUGIN)
    argv = base_args(tiny_models[family], data, plugin, tmp_path / "out")
    trainer = main(*parse_args([*argv, "--video_fps", "1", "--max_prompt_length", "400"]))
    assert trainer.state.global_step == 2
    sample = trainer.train_dataset[0]
    assert sample["video"] in ("clip.mp4", "other.mp4") and len(sample["images"]) == 2  # 2 s (1.5 s) at 1 fps
