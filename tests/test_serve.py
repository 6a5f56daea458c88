"""The scoring service served for real by uvicorn on free loopback ports (in a thread, sharing one tiny model)."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
from PIL import Image

from vlm_grpo.serve.threaded import ThreadedServer, free_port

TOKEN = "test-token-5f1c"
COLORS = [(220, 30, 30), (30, 200, 30), (30, 30, 220), (220, 220, 30), (200, 30, 200)]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Five images under an allowed root, one outside it, and a symlink inside pointing outside."""
    root = tmp_path_factory.mktemp("serve_images")
    allowed = root / "allowed"
    outside = root / "outside"
    allowed.mkdir()
    outside.mkdir()
    paths = []
    for i, color in enumerate(COLORS):
        img = Image.new("RGB", (40 + 8 * i, 48), (250, 250, 250))
        img.paste(color, (6, 6, 30, 30))
        path = allowed / f"img{i}.png"
        img.save(path)
        paths.append(str(path))
    secret = outside / "secret.png"
    Image.new("RGB", (32, 32), (0, 0, 0)).save(secret)
    (allowed / "link.png").symlink_to(secret)
    return {"allowed": str(allowed), "paths": paths, "outside": str(secret), "link": str(allowed / "link.png")}


@pytest.fixture(scope="module")
def vlm(tiny_models):
    from vlm_grpo.serve.models import load_vlm

    return load_vlm(str(tiny_models["qwen2_5_vl"]), device="cpu")


@pytest.fixture(scope="module")
def service(vlm, images):
    """The listener app under uvicorn on a free loopback port, with a token and settings from the environment.

    (The command-line entry point runs as a real subprocess in test_lewis_script.py.)"""
    from vlm_grpo.serve.app import create_app
    from vlm_grpo.serve.models import ListenerScorer
    from vlm_grpo.serve.settings import ServeSettings

    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLM_GRPO_SERVE_TOKEN", TOKEN)
        env.setenv("LISTENER_BATCH_SIZE", "2")
        env.setenv("INFERENCE_CONCURRENCY", "1")
        settings = ServeSettings.from_env("listener", image_roots=(images["allowed"],))
    app = create_app(settings, listener=ListenerScorer(vlm))
    with ThreadedServer(app) as server:
        headers = {"Authorization": f"Bearer {TOKEN}"}
        with httpx.Client(base_url=server.url, headers=headers, timeout=60, trust_env=False) as client:
            yield client


def test_health_reports_model_device_and_queue(service, tiny_models):
    health = service.get("/health").json()
    assert health["status"] == "ok"
    assert health["roles"] == ["listener"]
    assert health["model"] == str(tiny_models["qwen2_5_vl"])
    assert health["device"] == "cpu"
    assert health["queue_depth"] == 0
    assert health["batch_size"] == 2  # LISTENER_BATCH_SIZE from the environment


def test_score_gives_a_probability_per_candidate(service, images):
    paths = images["paths"][:4]
    response = service.post("/score", json={"candidate_paths": paths, "question": "Is the square red?", "topk": 2})
    assert response.status_code == 200, response.text
    body = response.json()
    probs = body["yes_probabilities"]
    assert len(probs) == 4
    assert all(0.0 <= p <= 1.0 for p in probs)
    assert body["predicted_index"] == max(range(4), key=lambda i: probs[i])
    assert len(body["topk_indices"]) == 2 and body["topk_indices"][0] == body["predicted_index"]


def test_batch_score_equals_single_calls(service, images):
    p = images["paths"]
    requests = [
        {"candidate_paths": [p[0], p[1], p[2]], "question": "Is the square red?", "topk": 1},
        {"candidate_paths": [p[3], p[4]], "question": "Is there a yellow square?", "topk": 2},
        {"candidate_paths": [p[4]], "question": "Is the picture wide?", "topk": 1},
    ]
    batch = service.post("/batch_score", json={"batch": requests})
    assert batch.status_code == 200, batch.text
    body = batch.json()
    assert body["took"] >= 0 and len(body["results"]) == 3
    for request, result in zip(requests, body["results"], strict=True):
        single = service.post("/score", json=request).json()
        assert result["yes_probabilities"] == pytest.approx(single["yes_probabilities"], abs=1e-5)
        assert result["predicted_index"] == single["predicted_index"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"candidate_paths": ["a.png"]}, "question"),
        ({"candidate_paths": [], "question": "q"}, "candidate_paths"),
        ({"candidate_paths": ["a.png"], "question": "q", "topk": 2}, "topk"),
        ({"candidate_paths": ["a.png"], "question": "q", "topk": 0}, "topk"),
        ({"candidate_paths": "a.png", "question": "q"}, "candidate_paths"),
        ({"candidate_paths": [1, 2], "question": "q"}, "candidate_paths"),
        ({"candidate_paths": ["a.png"], "question": "q", "colour": "red"}, "colour"),
    ],
)
def test_bad_body_is_422_with_a_clear_message(service, body, needle):
    response = service.post("/score", json=body)
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert detail.startswith("invalid request:") and needle in detail


def test_bad_batch_body_and_non_json_are_422(service):
    assert service.post("/batch_score", json={"batch": []}).status_code == 422
    response = service.post("/batch_score", json={"batch": [{"question": "q"}]})
    assert response.status_code == 422 and "batch.0.candidate_paths" in response.json()["detail"]
    response = service.post("/score", content=b"{not json", headers={"Content-Type": "application/json"})
    assert response.status_code == 422


def test_paths_outside_the_roots_are_403(service, images):
    inside = images["paths"][0]
    for bad in (images["outside"], images["link"], os.path.join(images["allowed"], "..", "outside", "secret.png")):
        response = service.post("/score", json={"candidate_paths": [inside, bad], "question": "Is it red?"})
        assert response.status_code == 403, bad
        assert "outside the allowed image roots" in response.json()["detail"]
    batch = {
        "batch": [{"candidate_paths": [inside], "question": "q"}, {"candidate_paths": ["/etc/passwd"], "question": "q"}]
    }
    response = service.post("/batch_score", json=batch)
    assert response.status_code == 403 and "batch.1.candidate_paths[0]" in response.json()["detail"]
    missing = os.path.join(images["allowed"], "nope.png")
    assert service.post("/score", json={"candidate_paths": [missing], "question": "q"}).status_code == 404


def test_token_is_required_when_set(service, images):
    body = {"candidate_paths": images["paths"][:1], "question": "Is it red?"}
    url = str(service.base_url)
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as anonymous:
        assert anonymous.post("/score", json=body).status_code == 401
        response = anonymous.post("/score", json=body, headers={"Authorization": "Bearer wrong"})
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        assert anonymous.post("/batch_score", json={"batch": [body]}).status_code == 401
        assert anonymous.get("/health").status_code == 200  # liveness stays open
    assert service.post("/score", json=body).status_code == 200


def test_busy_server_answers_503_when_no_slot_frees_in_time(vlm, images):
    from vlm_grpo.serve.app import create_app
    from vlm_grpo.serve.models import ListenerScorer
    from vlm_grpo.serve.settings import ServeSettings

    # The probe arrives a few ms after the long request (40 one-image forwards, >= ~0.4 s) has taken the only slot,
    # and waits 0.05 s for it.
    settings = ServeSettings(concurrency=1, acquire_timeout=0.05, batch_size=1, image_roots=(images["allowed"],))
    app = create_app(settings, listener=ListenerScorer(vlm))
    long_batch = {"batch": [{"candidate_paths": images["paths"] * 8, "question": "Is it red?"}]}
    outcome: dict[str, int] = {}
    with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=60, trust_env=False) as client:

        def hold_the_slot() -> None:
            outcome["long"] = client.post("/batch_score", json=long_batch).status_code

        worker = threading.Thread(target=hold_the_slot)
        worker.start()
        deadline = time.monotonic() + 30
        while client.get("/health").json()["in_flight"] != 1:
            assert time.monotonic() < deadline, "the long request never started"
            time.sleep(0.01)
        busy = client.post("/score", json={"candidate_paths": images["paths"][:1], "question": "Is it red?"})
        health = client.get("/health").json()
        worker.join(60)
        assert busy.status_code == 503, busy.text
        assert "server busy" in busy.json()["detail"] and busy.headers["retry-after"] == "1"
        assert health["queue_depth"] >= 1
        assert outcome["long"] == 200
        after = client.post("/score", json={"candidate_paths": images["paths"][:1], "question": "Is it red?"})
        assert after.status_code == 200


def test_speaker_describes_and_parses_fields(vlm, images):
    from vlm_grpo.serve.app import create_app
    from vlm_grpo.serve.models import SpeakerDescriber, parse_speaker_output
    from vlm_grpo.serve.settings import ServeSettings

    settings = ServeSettings(batch_size=2, image_roots=(images["allowed"],), max_new_tokens=8)
    app = create_app(settings, speaker=SpeakerDescriber(vlm, max_new_tokens=4))
    with ThreadedServer(app) as server, httpx.Client(base_url=server.url, timeout=60, trust_env=False) as client:
        assert client.get("/health").json()["roles"] == ["speaker"]
        one = client.post("/describe", json={"image_path": images["paths"][0], "max_new_tokens": 3})
        assert one.status_code == 200, one.text
        assert set(one.json()) == {"text", "thinking", "coarse", "detailed"}
        batch = client.post(
            "/batch_describe",
            json={
                "batch": [{"image_path": p, "prompt": "Describe it.", "max_new_tokens": 3} for p in images["paths"][:3]]
            },
        )
        assert batch.status_code == 200 and len(batch.json()["results"]) == 3 and batch.json()["took"] >= 0
        assert client.post("/describe", json={"image_path": images["outside"]}).status_code == 403
        assert client.post("/describe", json={"prompt": "x"}).status_code == 422
        assert client.post("/score", json={"candidate_paths": ["a"], "question": "q"}).status_code == 404  # no role

    parsed = parse_speaker_output(
        "<thinking>red square, left</thinking>\n<coarse> A red square. </coarse>"
        "<detailed>A small red square.</detailed>"
    )
    assert parsed == {"thinking": "red square, left", "coarse": "A red square.", "detailed": "A small red square."}
    assert parse_speaker_output("just text") == {"thinking": None, "coarse": None, "detailed": None}


def test_settings_read_the_environment(monkeypatch, tmp_path):
    from vlm_grpo.serve.settings import ServeSettings

    monkeypatch.setenv("INFERENCE_CONCURRENCY", "3")
    monkeypatch.setenv("INFERENCE_ACQUIRE_TIMEOUT", "2.5")
    monkeypatch.setenv("LISTENER_BATCH_SIZE", "5")
    monkeypatch.setenv("VLM_GRPO_SERVE_IMAGE_ROOTS", f"{tmp_path}{os.pathsep}{tmp_path / 'b'}")
    settings = ServeSettings.from_env("listener", batch_size=None)
    assert (settings.concurrency, settings.acquire_timeout, settings.batch_size) == (3, 2.5, 5)
    assert settings.image_roots == (os.path.realpath(tmp_path), os.path.realpath(tmp_path / "b"))
    assert settings.token is None
    with_token = ServeSettings.from_env("listener", batch_size=7, token="t0ps3cret")
    assert with_token.batch_size == 7 and with_token.token == "t0ps3cret" and "t0ps3cret" not in repr(with_token)
    monkeypatch.setenv("INFERENCE_CONCURRENCY", "many")
    with pytest.raises(ValueError, match="INFERENCE_CONCURRENCY"):
        ServeSettings.from_env()


def test_cli_wait_gives_up_on_a_server_that_is_not_there(capsys):
    from vlm_grpo.serve.cli import build_parser, main

    with pytest.raises(SystemExit) as exited:
        main(["wait", f"http://127.0.0.1:{free_port()}", "--timeout", "0.3", "--interval", "0.05"])
    assert exited.value.code == 1 and "did not answer within" in capsys.readouterr().err
    args = build_parser().parse_args(["listener", "--model", "m", "--image_root", "a", "--image_root", "b"])
    assert (args.host, args.port, args.image_root, args.token) == ("127.0.0.1", 9000, ["a", "b"], None)
