"""The remote-reward client (``listener``, ``http``) against real servers on loopback: the listener service with a
tiny model (uvicorn in a thread), pytest-httpserver for scripted failures, and a port nobody listens on."""

from __future__ import annotations

import json
import logging
import time

import pytest
from PIL import Image

from vlm_grpo.rewards import REWARDS, build_reward_funcs
from vlm_grpo.rewards.client import ClientConfig, clear_clients, distributed_rank, resolve_config
from vlm_grpo.rewards.http_endpoint import http_reward
from vlm_grpo.rewards.listener import describe_text, listener_reward, listener_url, parse_lewis_target
from vlm_grpo.serve.threaded import ThreadedServer, free_port

SPEAKER = "<thinking>it is red</thinking><coarse>a red square</coarse><detailed>A red square on the left.</detailed>"
FAST = {"max_retries": 2, "backoff_factor": 0.01, "timeout": 5, "down_cooldown": 0}


@pytest.fixture(autouse=True)
def _fresh_clients(monkeypatch):
    for name in ("LISTENER_URL", "LISTENER_CHUNK_SIZE", "LISTENER_FALLBACK", "HTTP_REWARD_URL", "HTTP_PROXY"):
        monkeypatch.delenv(name, raising=False)
    clear_clients()
    yield
    clear_clients()


class Recorder:
    """ASGI wrapper that keeps (path, JSON body) of every request, to count what reached the server."""

    def __init__(self, app) -> None:
        self.app = app
        self.requests: list[tuple[str, object]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        parts: list[bytes] = []

        async def recording_receive():
            message = await receive()
            if message["type"] == "http.request":
                parts.append(message.get("body", b""))
                if not message.get("more_body"):
                    body = b"".join(parts)
                    self.requests.append((scope["path"], json.loads(body) if body else None))
            return message

        await self.app(scope, recording_receive, send)

    def batch_sizes(self) -> list[int]:
        return [len(body["batch"]) for path, body in self.requests if path == "/batch_score"]


@pytest.fixture(scope="module")
def lewis_images(tmp_path_factory):
    root = tmp_path_factory.mktemp("lewis_images")
    colors = [(220, 30, 30), (30, 200, 30), (30, 30, 220), (220, 220, 30), (30, 200, 200)]
    for i, color in enumerate(colors):
        img = Image.new("RGB", (40 + 8 * i, 48), (250, 250, 250))
        img.paste(color, (6, 6, 30, 30))
        img.save(root / f"img{i}.png")
    return root


@pytest.fixture(scope="module")
def listener_server(tiny_models, lewis_images):
    from vlm_grpo.serve.app import create_app
    from vlm_grpo.serve.models import ListenerScorer, load_vlm
    from vlm_grpo.serve.settings import ServeSettings

    vlm = load_vlm(str(tiny_models["qwen2_5_vl"]), device="cpu")
    app = Recorder(
        create_app(ServeSettings(batch_size=4, image_roots=(str(lewis_images),)), listener=ListenerScorer(vlm))
    )
    with ThreadedServer(app) as server:
        server.recorder = app
        yield server


def lewis_columns(images, n: int):
    """``n`` rows: the target is image i % 5, the candidates three images of the folder."""
    image_path, solution = [], []
    for i in range(n):
        target = f"img{i % 5}.png"
        candidates = [target, f"img{(i + 1) % 5}.png", f"img{(i + 2) % 5}.png"]
        image_path.append([str(images / target)])
        solution.append(json.dumps({"candidates": candidates, "target": 0}))
    return image_path, solution


# --------------------------------------------------------------------------- against the listener service
def test_listener_reward_scores_through_the_service_in_chunks(listener_server, lewis_images):
    recorder = listener_server.recorder
    recorder.requests.clear()
    image_path, solution = lewis_columns(lewis_images, 5)
    completions = [SPEAKER.replace("red", word) for word in ("red", "green", "blue", "big", "small")]
    metrics: dict[str, float] = {}
    rewards = listener_reward(
        completions,
        image_path=image_path,
        solution=solution,
        url=listener_server.url,
        chunk_size=2,
        log_metric=metrics.__setitem__,
        **FAST,
    )
    assert recorder.batch_sizes() == [2, 2, 1]
    assert all(r in (0.0, 1.0) for r in rewards)
    # the reward is 1.0 exactly when the service's own answer picks the target
    first_request = recorder.requests[0][1]["batch"][0]
    assert first_request["question"] == (
        "Does this description match the image? Description: a red square A red square on the left."
    )
    assert first_request["candidate_paths"] == [str(lewis_images / n) for n in ("img0.png", "img1.png", "img2.png")]
    assert metrics == {"rewards/listener/server_failures": 0.0, "rewards/listener/cache_hits": 0.0}

    probability = listener_reward(
        completions, image_path=image_path, solution=solution, url=listener_server.url, mode="probability", **FAST
    )
    assert all(0.0 <= p <= 1.0 for p in probability)


def test_cache_avoids_a_second_request_for_the_same_input(listener_server, lewis_images):
    recorder = listener_server.recorder
    image_path, solution = lewis_columns(lewis_images, 3)
    completions = [SPEAKER, SPEAKER.replace("left", "right"), SPEAKER]  # the third repeats the first
    recorder.requests.clear()
    metrics: dict[str, float] = {}
    kwargs = {"image_path": image_path, "solution": solution, "url": listener_server.url, **FAST}
    first = listener_reward(completions, log_metric=metrics.__setitem__, **kwargs)
    sent = len(recorder.requests)
    assert sent == 1
    second = listener_reward(completions, log_metric=metrics.__setitem__, **kwargs)
    assert len(recorder.requests) == sent, "the cached answers were asked for again"
    assert second == first
    assert metrics["rewards/listener/cache_hits"] == 3.0


def test_url_and_chunking_from_the_environment(listener_server, lewis_images, monkeypatch):
    monkeypatch.setenv("LISTENER_URL", listener_server.url + "/score")
    monkeypatch.setenv("LISTENER_CHUNK_SIZE", "3")
    recorder = listener_server.recorder
    recorder.requests.clear()
    image_path, solution = lewis_columns(lewis_images, 4)
    completions = [f"<coarse>shape {i}</coarse><detailed>thing {i}</detailed>" for i in range(4)]
    rewards = listener_reward(completions, image_path=image_path, solution=solution, max_retries=0)
    assert recorder.batch_sizes() == [3, 1]
    assert None not in rewards


def test_registered_and_built_like_any_reward(listener_server, lewis_images):
    assert {"listener", "http", "llm_judge"} <= set(REWARDS.names())
    (reward,) = build_reward_funcs(["listener"], reward_kwargs={"listener": {"url": listener_server.url, **FAST}})
    image_path, solution = lewis_columns(lewis_images, 2)
    values = reward([SPEAKER, "<coarse></coarse><detailed> </detailed>"], image_path=image_path, solution=solution)
    assert values[0] in (0.0, 1.0) and values[1] == 0.0  # nothing said: no request, no reward


# --------------------------------------------------------------------------- scripted failures (pytest-httpserver)
@pytest.fixture(scope="session")
def httpserver_listen_address():
    return ("127.0.0.1", 0)  # pytest-httpserver on loopback, on a port the OS picks


def _listener_answer(n: int, predicted: int = 0) -> dict:
    return {"results": [{"yes_probabilities": [0.9, 0.2, 0.1], "predicted_index": predicted}] * n, "took": 0.01}


def test_retries_a_server_that_fails_twice_then_answers(httpserver, lewis_images):
    httpserver.expect_ordered_request("/batch_score", method="POST").respond_with_data("warming up", status=503)
    httpserver.expect_ordered_request("/batch_score", method="POST").respond_with_data("busy", status=502)
    httpserver.expect_ordered_request("/batch_score", method="POST").respond_with_json(_listener_answer(2))
    image_path, solution = lewis_columns(lewis_images, 2)
    metrics: dict[str, float] = {}
    rewards = listener_reward(
        [SPEAKER, SPEAKER.replace("left", "right")],
        image_path=image_path,
        solution=solution,
        url=httpserver.url_for("/"),
        log_metric=metrics.__setitem__,
        **FAST,
    )
    assert len(httpserver.log) == 3
    assert rewards == [1.0, 1.0]  # predicted 0 == target 0
    assert metrics["rewards/listener/server_failures"] == 0.0
    httpserver.check_assertions()


def test_client_errors_are_not_retried(httpserver, lewis_images, caplog):
    httpserver.expect_request("/batch_score").respond_with_json({"detail": "invalid request: nope"}, status=422)
    image_path, solution = lewis_columns(lewis_images, 2)
    with caplog.at_level(logging.WARNING, logger="vlm_grpo.rewards.client"):
        rewards = listener_reward(
            [SPEAKER, SPEAKER],
            image_path=image_path,
            solution=solution,
            url=httpserver.url_for("/"),
            fallback=0.0,
            **FAST,
        )
    assert len(httpserver.log) == 1
    assert rewards == [0.0, 0.0]
    assert "HTTP 422" in caplog.text and "invalid request: nope" in caplog.text


def test_a_server_that_is_down_gives_the_fallback_quickly_and_warns_once_per_n(lewis_images, caplog):
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    image_path, solution = lewis_columns(lewis_images, 4)
    metrics: list[tuple[str, float]] = []
    completions = [SPEAKER.replace("red", w) for w in ("red", "green", "blue", "pink")]
    kwargs = {
        "image_path": image_path, "solution": solution, "url": url, "warn_every": 8, "fallback": -1.0,
        "max_retries": 2, "backoff_factor": 0.05, "chunk_size": 1, "timeout": 2,
    }  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="vlm_grpo.rewards.client"):
        start = time.monotonic()
        first = listener_reward(completions, log_metric=lambda k, v: metrics.append((k, v)), **kwargs)
        elapsed = time.monotonic() - start
        # during the cool-down (down_cooldown, 30 s by default) the next calls do not even try
        start = time.monotonic()
        for _ in range(3):
            again = listener_reward(completions, **kwargs)
        fast = time.monotonic() - start
    assert first == [-1.0] * 4 and again == [-1.0] * 4
    assert elapsed < 5, f"a down server took {elapsed:.1f} s"  # 3 refused attempts and ~0.15 s of back-off
    assert fast < 1.0
    assert ("rewards/listener/server_failures", 4.0) in metrics
    warnings = [r.getMessage() for r in caplog.records if "got the fallback reward" in r.getMessage()]
    assert len(warnings) == 3  # 4, 8, 12, 16 failed samples with warn_every 8: at the 1st, the 8th and the 16th
    assert "ConnectError" in warnings[0] and "Training continues" in warnings[0]
    assert "server marked down" in warnings[1]


def test_down_server_does_not_stop_grpo_training(tiny_models, lewis_images, tmp_path):
    from vlm_grpo.data.lewis import write_lewis_dataset
    from vlm_grpo.grpo_jsonl import main, parse_args

    data = write_lewis_dataset(lewis_images, tmp_path / "lewis.jsonl", rows=4, k=3)
    down = f"http://127.0.0.1:{free_port()}"
    listener_kwargs = {"url": down, "max_retries": 1, "backoff_factor": 0.01, "timeout": 2}
    argv = [
        "--model_name_or_path", str(tiny_models["qwen2_5_vl"]),
        "--data_file_paths", str(data),
        "--image_folders", str(lewis_images),
        "--reward_funcs", "listener", "format",
        "--reward_kwargs", json.dumps({"listener": listener_kwargs}),
        "--task_type", "raw",
        "--output_dir", str(tmp_path / "out"),
        "--max_steps", "2",
        "--per_device_train_batch_size", "2",
        "--num_generations", "2",
        "--max_completion_length", "8",
        "--gradient_checkpointing", "false",
        "--logging_steps", "1",
        "--save_strategy", "no",
        "--report_to", "none",
        "--dataloader_num_workers", "0",
    ]  # fmt: skip
    trainer = main(*parse_args(argv))
    assert trainer.state.global_step == 2
    logged = [e for e in trainer.state.log_history if "rewards/listener/server_failures" in e]
    assert len(logged) == 2 and all(e["rewards/listener/server_failures"] > 0 for e in logged)


# --------------------------------------------------------------------------- the generic http reward
def test_http_reward_sends_columns_and_uses_the_scores(httpserver):
    def handler(request):
        from werkzeug import Response

        batch = request.get_json()["batch"]
        scores = [len(item["completion"]) / 10 if item["solution"] != "skip" else None for item in batch]
        return Response(json.dumps({"scores": scores}), content_type="application/json")

    httpserver.expect_request("/reward", method="POST").respond_with_handler(handler)
    metrics: dict[str, float] = {}
    rewards = http_reward(
        ["abc", "abcdef", "x"],
        url=httpserver.url_for("/reward"),
        solution=["a", "b", "skip"],
        question=["q1", "q2", "q3"],
        task_type=[None, None, None],
        trainer_state=object(),
        chunk_size=2,
        log_metric=metrics.__setitem__,
        **FAST,
    )
    assert rewards == [0.3, 0.6, None]  # null from the endpoint: no reward, not a failure
    assert metrics["rewards/http/server_failures"] == 0.0
    first = httpserver.log[0][0].get_json()["batch"][0]
    assert first == {"completion": "abc", "solution": "a", "question": "q1", "task_type": None}
    assert len(httpserver.log) == 2


def test_http_reward_wrong_answer_shape_and_slow_server_give_the_fallback(httpserver):
    httpserver.expect_request("/short").respond_with_json({"scores": [1.0]})

    def slow(request):
        from werkzeug import Response

        time.sleep(0.6)
        return Response("{}", content_type="application/json")

    httpserver.expect_request("/slow").respond_with_handler(slow)
    assert http_reward(["a", "b"], url=httpserver.url_for("/short"), fallback=0.5, **FAST) == [0.5, 0.5]
    start = time.monotonic()
    slow_fast = {**FAST, "timeout": 0.2, "max_retries": 1}
    assert http_reward(["a"], url=httpserver.url_for("/slow"), fallback=0.0, **slow_fast) == [0.0]
    assert time.monotonic() - start < 3


def test_bearer_token_is_sent_and_never_logged(httpserver, monkeypatch, caplog):
    secret = "tok-9d2e-secret"
    monkeypatch.setenv("HTTP_REWARD_TOKEN", secret)
    httpserver.expect_request("/r", headers={"Authorization": f"Bearer {secret}"}).respond_with_json({"scores": [1]})
    httpserver.expect_request("/bad").respond_with_data(f"you sent {secret}", status=500)
    with caplog.at_level(logging.DEBUG):
        assert http_reward(["a"], url=httpserver.url_for("/r"), **FAST) == [1.0]
        assert http_reward(["a"], url=httpserver.url_for("/bad"), **FAST) == [None]
    assert "HTTP 500" in caplog.text and "you sent ***" in caplog.text
    assert secret not in caplog.text


# --------------------------------------------------------------------------- pieces
def test_lewis_rows_and_descriptions():
    cands, target = parse_lewis_target('{"candidates": ["a.png", "/abs/b.png"], "target": "b.png"}', ["/d/x.png"])
    assert cands == ["/d/a.png", "/abs/b.png"] and target == 1
    assert parse_lewis_target("<answer>1</answer>", ["/d/x.png", "/d/y.png"]) == (["/d/x.png", "/d/y.png"], 1)
    assert parse_lewis_target({"candidates": ["a.png"], "target": 0}, None, "/root")[0] == ["/root/a.png"]
    for bad in ("5", "yes", '{"candidates": [], "target": 0}', '{"candidates": ["a"], "target": true}'):
        with pytest.raises(ValueError):
            parse_lewis_target(bad, ["/d/x.png", "/d/y.png"])
    assert describe_text(SPEAKER) == "a red square A red square on the left."
    assert describe_text("<thinking>hm</thinking> plain <b>words</b>") == "hm plain words"
    assert describe_text(SPEAKER, ("detailed",)) == "A red square on the left."


def test_config_resolution(monkeypatch):
    monkeypatch.setenv("LISTENER_TIMEOUT", "7.5")
    monkeypatch.setenv("LISTENER_MAX_RETRIES", "5")
    config = resolve_config("LISTENER", url="http://127.0.0.1:9/x", max_retries=1)
    assert (config.timeout, config.max_retries, config.chunk_size) == (7.5, 1, 16)
    assert config.is_loopback and "zzz" not in repr(ClientConfig(url="http://h:1", token="zzz"))
    with pytest.raises(ValueError, match="LISTENER_URL"):
        resolve_config("LISTENER")
    monkeypatch.setenv("LISTENER_CHUNK_SIZE", "lots")
    with pytest.raises(ValueError, match="LISTENER_CHUNK_SIZE"):
        resolve_config("LISTENER", url="http://127.0.0.1:9")
    with pytest.raises(ValueError, match="chunk_size"):
        ClientConfig(url="http://127.0.0.1:9", chunk_size=0)
    assert listener_url("http://h:9") == "http://h:9/batch_score"
    assert listener_url("http://h:9/score") == "http://h:9/batch_score"
    assert listener_url("http://h:9/api/batch_score") == "http://h:9/api/batch_score"
    assert distributed_rank() == 0  # single process: each rank (here, the only one) calls for its own shard


def test_backoff_grows_exponentially_with_bounded_jitter():
    from vlm_grpo.rewards.client import ResilientClient

    client = ResilientClient(
        ClientConfig(url="http://127.0.0.1:9", backoff_factor=1.0, jitter=0.5, max_backoff=30), "t"
    )
    for attempt, base in enumerate((1, 2, 4, 8)):
        delays = [client.backoff(attempt) for _ in range(50)]
        assert all(0.5 * base <= d <= 1.5 * base for d in delays)
        assert len(set(delays)) > 1  # jittered
    assert client.backoff(10) == 30  # capped
    assert client.backoff(0, retry_after=5.0) >= 5.0
