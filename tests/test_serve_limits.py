"""Service limits: a request cannot make the service read a huge body or decode a huge image (413/422, never 500),
and peak memory stays bounded while a client sends the largest requests the limits allow."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import textwrap

import httpx
import pytest
from PIL import Image

from vlm_grpo.serve.threaded import ThreadedServer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _png_bytes(size: tuple[int, int], mode: str = "1") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, 1 if mode == "1" else (200, 30, 30)).save(buffer, "PNG")
    return buffer.getvalue()


def _uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def limited(tiny_models, tmp_path_factory):
    """A listener with small limits: 64 KiB bodies, 256x256-pixel images, 2 data: URIs of at most 16 KiB."""
    from vlm_grpo.serve.app import create_app
    from vlm_grpo.serve.models import ListenerScorer, load_vlm
    from vlm_grpo.serve.settings import ServeSettings

    root = tmp_path_factory.mktemp("limits")
    Image.new("RGB", (256, 256), (30, 200, 30)).save(root / "ok.png")
    Image.new("RGB", (257, 256), (30, 200, 30)).save(root / "big.png")
    (root / "truncated.png").write_bytes(_png_bytes((64, 64), "RGB")[:60])
    settings = ServeSettings(
        image_roots=(str(root),),
        max_body_bytes=64 * 1024,
        max_image_pixels=256 * 256,
        max_data_uris=2,
        max_data_uri_bytes=16 * 1024,
        batch_size=2,
    )
    app = create_app(settings, listener=ListenerScorer(load_vlm(str(tiny_models["qwen2_5_vl"]), device="cpu")))
    with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=60, trust_env=False) as client:
        yield client, root


def _score(client: httpx.Client, paths: list[str]) -> httpx.Response:
    return client.post("/score", json={"candidate_paths": paths, "question": "Is it green?"})


def test_body_over_the_limit_is_413_declared_or_streamed(limited):
    client, root = limited
    body = json.dumps({"candidate_paths": [str(root / "ok.png")], "question": "x" * 70_000}).encode()
    declared = client.post("/score", content=body, headers={"content-type": "application/json"})
    assert declared.status_code == 413 and "max_body_bytes" in declared.json()["detail"]

    def chunks():  # no Content-Length: the limit counts bytes as they arrive
        for start in range(0, len(body), 8192):
            yield body[start : start + 8192]

    streamed = client.post("/score", content=chunks(), headers={"content-type": "application/json"})
    assert streamed.status_code == 413, streamed.text
    # control: the same request under the limit is read (and refused only for its over-long question)
    short = client.post("/score", json={"candidate_paths": [str(root / "ok.png")], "question": "x" * 9000})
    assert short.status_code == 422 and "question" in short.json()["detail"]


def test_image_over_the_pixel_limit_is_413_before_decoding(limited):
    client, root = limited
    assert _score(client, [str(root / "ok.png")]).status_code == 200  # exactly at the limit
    big = _score(client, [str(root / "ok.png"), str(root / "big.png")])
    assert big.status_code == 413
    assert "candidate_paths[1]" in big.json()["detail"] and "257x256" in big.json()["detail"]
    # 12000^2 and 15000^2 in a few KB (15000^2 is past PIL's own bomb limit, which used to give 500)
    for side in (12000, 15000):
        (root / f"huge{side}.png").write_bytes(_png_bytes((side, side)))
        response = _score(client, [str(root / f"huge{side}.png")])
        assert response.status_code == 413, (side, response.text)
        detail = response.json()["detail"]
        assert f"{side}x{side}" in detail or f"{side * side} pixels" in detail, detail


def test_data_uri_count_size_and_bad_images_are_4xx(limited):
    client, root = limited
    small = _uri(_png_bytes((32, 32), "RGB"))
    assert _score(client, [small, small]).status_code == 200
    three = _score(client, [small, small, small])
    assert three.status_code == 413 and "max_data_uris" in three.json()["detail"]
    large = _uri(os.urandom(20 * 1024))
    too_long = _score(client, [large])
    assert too_long.status_code == 413 and "max_data_uri_bytes" in too_long.json()["detail"]
    bad_base64 = _score(client, ["data:image/png;base64,@@@not-base64@@@"])
    assert bad_base64.status_code == 422 and "base64" in bad_base64.json()["detail"]
    not_an_image = _score(client, [_uri(b"hello, not a picture")])
    assert not_an_image.status_code == 422 and "not an image" in not_an_image.json()["detail"]
    truncated = _score(client, [str(root / "truncated.png")])
    assert truncated.status_code == 422 and "truncated" in truncated.json()["detail"]


def test_limits_come_from_flags_over_environment_over_defaults(monkeypatch):
    from vlm_grpo.serve.cli import build_parser
    from vlm_grpo.serve.settings import ServeSettings

    defaults = ServeSettings()
    assert (defaults.max_body_bytes, defaults.max_image_pixels, defaults.max_data_uris) == (2**24, 2**24, 16)
    monkeypatch.setenv("VLM_GRPO_SERVE_MAX_BODY_BYTES", "1000")
    monkeypatch.setenv("VLM_GRPO_SERVE_MAX_DATA_URIS", "0")
    args = build_parser().parse_args(
        ["listener", "--model", "m", "--max_body_bytes", "2000", "--max_image_pixels", "9"]
    )
    settings = ServeSettings.from_env(
        "listener", max_body_bytes=args.max_body_bytes, max_image_pixels=args.max_image_pixels
    )
    assert (settings.max_body_bytes, settings.max_image_pixels, settings.max_data_uris) == (2000, 9, 0)
    assert ServeSettings.from_env("listener").max_body_bytes == 1000
    monkeypatch.setenv("VLM_GRPO_SERVE_MAX_IMAGE_PIXELS", "lots")
    with pytest.raises(ValueError, match="VLM_GRPO_SERVE_MAX_IMAGE_PIXELS"):
        ServeSettings.from_env("listener")
    with pytest.raises(ValueError, match="max_body_bytes must be >= 1"):
        ServeSettings(max_body_bytes=0)


_RSS_SCRIPT = textwrap.dedent(
    """
    import base64, io, json, sys
    from fastapi.testclient import TestClient
    from PIL import Image
    from vlm_grpo.serve.app import create_app
    from vlm_grpo.serve.models import ListenerScorer, load_vlm
    from vlm_grpo.serve.settings import ServeSettings

    def peak_mb():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM"):
                return int(line.split()[1]) / 1024

    def uri(side):
        buffer = io.BytesIO()
        Image.new("RGB", (side, side), (200, 30, 30)).save(buffer, "PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()

    vlm = load_vlm(sys.argv[1], device="cpu")
    out = {}
    limits = ServeSettings(image_roots=("/",), max_image_pixels=1024 * 1024, max_data_uris=8, batch_size=2)
    client = TestClient(create_app(limits, listener=ListenerScorer(vlm)))
    client.post("/score", json={"candidate_paths": [uri(64)], "question": "red?"})  # warm up
    start = peak_mb()
    codes = [client.post("/score", json={"candidate_paths": [uri(1024)] * 8, "question": "red?"}).status_code
             for _ in range(3)]
    codes.append(client.post("/score", json={"candidate_paths": [uri(6000)], "question": "red?"}).status_code)
    out["limited"] = {"codes": codes, "growth_mb": peak_mb() - start}
    # control: the same service with the pixel limit raised decodes the 6000x6000 image
    raised = ServeSettings(image_roots=("/",), max_image_pixels=40_000_000, batch_size=2)
    client = TestClient(create_app(raised, listener=ListenerScorer(vlm)))
    start = peak_mb()
    code = client.post("/score", json={"candidate_paths": [uri(6000)], "question": "red?"}).status_code
    out["unlimited"] = {"codes": [code], "growth_mb": peak_mb() - start}
    print(json.dumps(out))
    """
)

#: the stated bound: peak RSS growth while a client sends the largest requests the limits allow
RSS_CAP_MB = 250


def test_peak_memory_stays_bounded_at_the_limits(tiny_models):
    """8 data: URIs of 1024x1024 (the most pixels these limits allow per request), three times, then an
    over-limit 6000x6000 image: peak RSS grows by less than RSS_CAP_MB. Control: with the pixel limit
    raised the same 6000x6000 image alone takes more than that, so the measurement can fail."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(tiny_models["qwen2_5_vl"])],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["limited"]["codes"] == [200, 200, 200, 413]
    assert out["limited"]["growth_mb"] < RSS_CAP_MB, out
    assert out["unlimited"]["codes"] == [200]
    assert out["unlimited"]["growth_mb"] > RSS_CAP_MB, out
