"""``llm_judge`` against a local OpenAI-compatible stub (FastAPI + uvicorn in a thread, on a free loopback port)."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from vlm_grpo.rewards import build_reward_funcs
from vlm_grpo.rewards.client import clear_clients
from vlm_grpo.rewards.judge import chat_completions_url, llm_judge_reward, load_template, parse_verdict
from vlm_grpo.serve.threaded import ThreadedServer, free_port

SECRET = "sk-local-test-7c1f9a"


class StubJudge:
    """``POST /v1/chat/completions``: answers from the candidate answer in the prompt -- ``red`` -> "Yes", ``score``
    -> "Score: 7/10", ``garbage`` -> an unparseable reply, ``explode`` -> HTTP 500 echoing the Authorization header --
    after ``delay`` seconds; records requests, Authorization headers and the peak number of requests in flight."""

    def __init__(self) -> None:
        self.delay = 0.0
        self.prompts: list[str] = []
        self.auth: list[str | None] = []
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.peak = 0
        self.app = FastAPI()
        self.app.post("/v1/chat/completions")(self.complete)

    async def complete(self, request: Request):
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("authorization"))
        prompt = body["messages"][-1]["content"]
        self.prompts.append(prompt)
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
        finally:
            self.in_flight -= 1
        answer = re.search(r"Candidate answer: (.*)", prompt)
        said = answer.group(1).strip() if answer else prompt
        if "explode" in said:
            return JSONResponse({"error": f"boom, you sent {request.headers.get('authorization')}"}, status_code=500)
        reply = (
            "Yes"
            if said == "red"
            else "<think>let me see</think>Score: 7/10"
            if said == "score"
            else "I cannot decide."
            if said == "garbage"
            else "The answer matches the reference.\nJudgement: 1"
            if said == "deepeyes-right"
            else "Judgement: 0"
            if said == "deepeyes-wrong"
            else "No"
        )
        return {
            "id": "x",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}],
        }


@pytest.fixture(scope="module")
def stub():
    judge = StubJudge()
    with ThreadedServer(judge.app) as server:
        judge.url = f"{server.url}/v1"
        yield judge


@pytest.fixture(autouse=True)
def _reset(stub, monkeypatch):
    for name in ("JUDGE_BASE_URL", "JUDGE_MODEL", "JUDGE_TEMPLATE", "JUDGE_FALLBACK", "JUDGE_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    stub.delay = 0.0
    stub.prompts.clear()
    stub.auth.clear()
    stub.bodies.clear()
    stub.peak = 0
    clear_clients()
    yield
    clear_clients()


FAST = {"max_retries": 1, "backoff_factor": 0.01, "timeout": 5, "down_cooldown": 0}
QUESTION = "<image>What colour is the square?"
SOLUTION = "<answer>red</answer>"


@pytest.mark.parametrize(
    ("reply", "mode", "max_score", "expected"),
    [
        ("Yes", "auto", None, 1.0),
        ("no.", "auto", None, 0.0),
        ("**Verdict:** incorrect", "auto", None, 0.0),
        ("Judgement: correct", "auto", None, 1.0),
        ("The answer is not correct.", "auto", None, 0.0),
        ("<think>No wait... it is fine</think>\nyes", "auto", None, 1.0),
        ("Score: 8/10", "auto", None, 0.8),
        ("<score>3</score>", "auto", 5, 0.6),
        ("rating = 0.25", "auto", None, 0.25),
        ("7", "score", 10, 0.7),
        ("I would give it 4 out of 5", "score", None, 0.8),
        ("Score: 12/10", "score", None, None),
        ("Score: 7", "score", None, None),  # no denominator, no max_score, above 1
        ("I cannot decide.", "auto", None, None),
        ("", "auto", None, None),
        (None, "auto", None, None),
        ("yes", "score", None, None),
        ("Score: 9/10", "yes_no", None, None),
    ],
)
def test_verdict_parsing(reply, mode, max_score, expected):
    assert parse_verdict(reply, mode, max_score) == (pytest.approx(expected) if expected is not None else None)


def test_judge_grades_through_the_endpoint_with_the_default_template(stub):
    completions = ["<think>hm</think><answer>red</answer>", "<answer>blue</answer>", "<answer>score</answer>"]
    metrics: dict[str, float] = {}
    rewards = llm_judge_reward(
        completions,
        question=[QUESTION] * 3,
        solution=[SOLUTION] * 3,
        judge_base_url=stub.url,
        judge_model="stub-judge",
        log_metric=metrics.__setitem__,
        **FAST,
    )
    assert rewards == [1.0, 0.0, pytest.approx(0.7)]
    assert metrics == {"rewards/llm_judge/server_failures": 0.0, "rewards/llm_judge/cache_hits": 0.0}
    (prompt,) = [p for p in stub.prompts if "Candidate answer: red" in p]  # requests ran concurrently: any order
    assert "Question: What colour is the square?" in prompt and "<image>" not in prompt
    assert "Reference answer: red" in prompt
    assert stub.bodies[0]["model"] == "stub-judge" and stub.bodies[0]["temperature"] == 0.0
    assert stub.auth == [None, None, None]  # no key in the environment: no Authorization header
    assert load_template().strip().splitlines()[-1] in prompt


def test_custom_template_env_and_registry(stub, tmp_path, monkeypatch):
    template = tmp_path / "judge.txt"
    template.write_text('Q={question} R={solution} JSON {"keep": "braces"} Candidate answer: {answer}')
    monkeypatch.setenv("JUDGE_BASE_URL", stub.url)
    monkeypatch.setenv("JUDGE_MODEL", "env-model")
    (reward,) = build_reward_funcs(["llm_judge"], reward_kwargs={"llm_judge": {"template": str(template), **FAST}})
    assert reward(["<answer>red</answer>"], question=["Which?"], solution=["red"]) == [1.0]
    assert stub.prompts == ['Q=Which? R=red JSON {"keep": "braces"} Candidate answer: red']
    assert stub.bodies[0]["model"] == "env-model"


def test_requests_run_concurrently_up_to_the_limit(stub):
    stub.delay = 0.3
    completions = [f"<answer>colour {i}</answer>" for i in range(8)]
    start = time.monotonic()
    rewards = llm_judge_reward(
        completions, question=[QUESTION] * 8, solution=[SOLUTION] * 8, base_url=stub.url, model="m",
        max_concurrency=3, **FAST,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert rewards == [0.0] * 8
    assert len(stub.prompts) == 8
    assert stub.peak == 3, f"peak concurrency {stub.peak}, limit 3"
    assert elapsed >= 3 * 0.3 - 0.05  # 8 requests, 3 at a time: at least 3 rounds


def test_cache_and_unparseable_verdicts(stub):
    kwargs = {"question": [QUESTION] * 3, "solution": [SOLUTION] * 3, "base_url": stub.url, "model": "m", **FAST}
    completions = ["<answer>red</answer>", "<answer>garbage</answer>", "<answer>red</answer>"]
    metrics: dict[str, float] = {}
    assert llm_judge_reward(completions, fallback=0.25, log_metric=metrics.__setitem__, **kwargs) == [1.0, 0.25, 1.0]
    assert len(stub.prompts) == 2  # identical requests are sent once
    assert metrics["rewards/llm_judge/server_failures"] == 1.0
    assert llm_judge_reward(completions, fallback=0.25, log_metric=metrics.__setitem__, **kwargs) == [1.0, 0.25, 1.0]
    assert len(stub.prompts) == 3  # only the unparseable one is asked again
    assert metrics["rewards/llm_judge/cache_hits"] == 2.0


def test_the_api_key_is_sent_but_never_logged(stub, monkeypatch, caplog, capfd):
    monkeypatch.setenv("MY_JUDGE_KEY", SECRET)
    kwargs = {"base_url": stub.url, "model": "m", "api_key_env": "MY_JUDGE_KEY", "warn_every": 1, **FAST}
    with caplog.at_level(logging.DEBUG):
        good = llm_judge_reward(["<answer>red</answer>"], question=[QUESTION], solution=[SOLUTION], **kwargs)
        bad = llm_judge_reward(
            ["<answer>explode</answer>", "<answer>garbage</answer>"],
            question=[QUESTION] * 2,
            solution=[SOLUTION] * 2,
            **kwargs,
        )
        with pytest.raises(ValueError, match="environment") as refused:
            llm_judge_reward(["x"], question=["q"], solution=["s"], api_key=SECRET, **kwargs)
    assert good == [1.0] and bad == [None, None]
    assert stub.auth[0] == f"Bearer {SECRET}"  # the key was used
    assert "HTTP 500" in caplog.text and "unparseable judge verdict" in caplog.text
    assert "***" in caplog.text  # the server echoed the header back; it was scrubbed
    out, err = capfd.readouterr()
    for text in (caplog.text, out, err, str(refused.value)):
        assert SECRET not in text


def test_a_judge_that_is_down_gives_the_fallback_within_the_time_bound():
    down = f"http://127.0.0.1:{free_port()}/v1"
    start = time.monotonic()
    rewards = llm_judge_reward(
        ["<answer>a</answer>", "<answer>b</answer>"], question=["q"] * 2, solution=["s"] * 2, base_url=down,
        model="m", fallback=0.0, max_retries=2, backoff_factor=0.05, timeout=2,
    )  # fmt: skip
    assert rewards == [0.0, 0.0]
    assert time.monotonic() - start < 5


def test_runs_inside_a_running_event_loop(stub):
    async def inside():
        return llm_judge_reward(
            ["<answer>red</answer>"], question=["q"], solution=["red"], base_url=stub.url, model="m"
        )

    assert asyncio.run(inside()) == [1.0]


def test_configuration_errors():
    with pytest.raises(ValueError, match="base_url"):
        llm_judge_reward(["x"], model="m")
    with pytest.raises(ValueError, match="model"):
        llm_judge_reward(["x"], base_url="http://127.0.0.1:1/v1")
    with pytest.raises(ValueError, match="verdict"):
        llm_judge_reward(["x"], base_url="http://127.0.0.1:1/v1", model="m", verdict="maybe")
    assert chat_completions_url("http://h:8000/v1/") == "http://h:8000/v1/chat/completions"
    assert chat_completions_url("http://h/v1/chat/completions") == "http://h/v1/chat/completions"


# The reply formats llm_judge reads (the README's table): reply -> (auto, yes_no, score with max_score=10).
VERDICTS = [
    ("Judgement: 1", 1.0, 1.0, None),
    ("Judgement: 0", 0.0, 0.0, None),
    ("The answer looks correct.\nJudgement: 0", 0.0, 0.0, None),  # the label wins over a verdict word
    ("[[A]]", 1.0, 1.0, None),
    ("[[B]]", 0.0, 0.0, None),
    ("Rating: [[7]]", 0.7, None, 0.7),
    ("Score: 7/10", 0.7, None, 0.7),
    ("1", 0.1, None, 0.1),  # a bare number is a score (here out of max_score=10)
    ("YES", 1.0, 1.0, None),
    ("no.", 0.0, 0.0, None),
    ("Incorrect", 0.0, 0.0, None),
    ("I cannot decide.", None, None, None),
]


@pytest.mark.parametrize(("reply", "auto", "yes_no", "score"), VERDICTS)
def test_verdict_table(reply, auto, yes_no, score):
    assert parse_verdict(reply, "auto", max_score=10) == auto
    assert parse_verdict(reply, "yes_no") == yes_no
    assert parse_verdict(reply, "score", max_score=10) == score


def test_bare_zero_and_one_without_max_score():
    assert parse_verdict("1") == 1.0 and parse_verdict("0") == 0.0


def test_a_deepeyes_style_judge_is_read(stub, caplog):
    """DeepEyes' judge answers "Judgement: 1/0"; an unparseable reply is counted and quoted (80 characters)."""
    metrics: dict[str, float] = {}
    with caplog.at_level(logging.WARNING):
        rewards = llm_judge_reward(
            ["<answer>deepeyes-right</answer>", "<answer>deepeyes-wrong</answer>", "<answer>garbage</answer>"],
            question=[QUESTION] * 3, solution=[SOLUTION] * 3, base_url=stub.url, model="m", warn_every=1,
            log_metric=metrics.__setitem__, **FAST,
        )  # fmt: skip
    assert rewards == [1.0, 0.0, None]
    assert metrics["rewards/llm_judge/server_failures"] == 1.0
    assert "unparseable judge verdict: 'I cannot decide.'" in caplog.text
