"""EasyR1-style batch rewards: detection of the calling convention, the per-sample dicts they receive, ``overall`` as
the reward, every other key logged as ``rewards/<name>/<key>``, and SafeReward's per-sample isolation for them."""

from __future__ import annotations

import textwrap

import pytest

from vlm_grpo.rewards import SafeReward, batch_reward, build_reward_funcs, reward_kind
from vlm_grpo.rewards.batch import accuracy_format_reward


def _metrics():
    logged: list[tuple[str, float]] = []
    return logged, lambda name, value: logged.append((name, value))


def compute_score(reward_inputs, format_weight=0.5):
    """EasyR1 signature: detected as batch without a decorator."""
    out = []
    for item in reward_inputs:
        acc = float(item["response"].strip() == item["ground_truth"])
        fmt = float(item["response"].startswith(" "))
        out.append({"overall": (1 - format_weight) * acc + format_weight * fmt, "accuracy": acc, "format": fmt})
    return out


def sequential_score(reward_input):
    return {"overall": len(reward_input["response"]), "length": len(reward_input["response"])}


@batch_reward
def marked(items):
    return [1.0 for _ in items]


@batch_reward(sequential=True)
def marked_sequential(item):
    return 0.5


def plain(completions, **kwargs):
    return [0.0] * len(completions)


def test_reward_kind_detection():
    assert reward_kind(compute_score) == "batch"
    assert reward_kind(sequential_score) == "sequential"
    assert reward_kind(marked) == "batch"
    assert reward_kind(marked_sequential) == "sequential"
    assert reward_kind(plain) == "trl"
    assert reward_kind(accuracy_format_reward) == "batch"
    import functools

    assert reward_kind(functools.partial(compute_score, format_weight=0.1)) == "batch"
    assert reward_kind(functools.partial(marked)) == "batch"


def test_batch_reward_overall_and_metrics():
    logged, log = _metrics()
    safe = SafeReward(compute_score, "easy")
    out = safe([" 3", "4", " 5"], solution=["3", "4", "4"], log_metric=log, trainer_state=None)
    assert out == [1.0, 0.5, 0.5]
    assert dict(logged) == {
        "rewards/easy/failures": 0.0,
        "rewards/easy/accuracy": pytest.approx(2 / 3),
        "rewards/easy/format": pytest.approx(2 / 3),
    }


def test_reward_inputs_hold_every_column():
    seen = []

    @batch_reward
    def spy(reward_inputs):
        seen.extend(reward_inputs)
        return [0.0] * len(reward_inputs)

    SafeReward(spy, "spy")(
        [[{"role": "assistant", "content": "<answer>3</answer>"}]],
        prompts=[[{"role": "user", "content": "q"}]],
        completion_ids=[[5, 6, 7]],
        solution=["<answer>3</answer>"],
        image_path=[["a.png"]],
        accu_reward_method=["default"],
        task_type=["counting"],
        trainer_state=object(),
        log_metric=lambda *a: None,
        log_extra=lambda *a: None,
    )
    (item,) = seen
    assert item["response"] == item["completion"] == "<answer>3</answer>"
    assert item["ground_truth"] == item["solution"] == "<answer>3</answer>"
    assert item["response_length"] == 3
    assert item["prompt"] == [{"role": "user", "content": "q"}]
    assert (
        item["image_path"] == ["a.png"] and item["accu_reward_method"] == "default" and item["task_type"] == "counting"
    )
    assert "trainer_state" not in item and "log_metric" not in item


def test_sequential_and_plain_float_outputs():
    logged, log = _metrics()
    assert SafeReward(sequential_score, "seq")(["ab", "abcd"], log_metric=log) == [2.0, 4.0]
    assert ("rewards/seq/length", 3.0) in logged
    assert SafeReward(marked, "m")(["a", "b"]) == [1.0, 1.0]
    assert SafeReward(marked_sequential, "ms")(["a"]) == [0.5]


def test_failures_are_isolated_per_sample():
    @batch_reward
    def picky(reward_inputs):
        if any(item["response"] == "boom" for item in reward_inputs):
            raise RuntimeError("cannot score boom")
        return [{"overall": 1.0, "seen": 1.0} for _ in reward_inputs]

    logged, log = _metrics()
    safe = SafeReward(picky, "picky")
    assert safe(["ok", "boom", "ok"], solution=["a", "b", "c"], log_metric=log) == [1.0, None, 1.0]
    assert safe.failures == 1
    assert dict(logged) == {"rewards/picky/failures": 1.0, "rewards/picky/seen": 1.0}


def test_bad_outputs_become_none():
    outputs = {
        "a": {"accuracy": 1.0},
        "b": {"overall": float("nan")},
        "c": {"overall": None},
        "d": {"overall": 0.25, "note": "text"},
    }

    @batch_reward
    def bad(reward_inputs):
        return [outputs[item["response"]] for item in reward_inputs]

    logged, log = _metrics()
    safe = SafeReward(bad, "bad")
    assert safe(["a", "b", "c", "d"], log_metric=log) == [None, None, None, 0.25]
    # no 'overall' (per-sample retry fails too) and NaN are failures; None means "does not apply"
    assert safe.failures == 2
    assert ("rewards/bad/accuracy", 1.0) not in logged  # dropped with its failing sample's batch call


def test_reserved_metric_names_are_prefixed():
    @batch_reward
    def clash(reward_inputs):
        return [{"overall": 1.0, "mean": 5.0, "std": 1.0, "failures": 2.0} for _ in reward_inputs]

    logged, log = _metrics()
    SafeReward(clash, "clash")(["a"], log_metric=log)
    names = [name for name, _ in logged]
    assert names == [
        "rewards/clash/failures",
        "rewards/clash/batch_failures",
        "rewards/clash/batch_mean",
        "rewards/clash/batch_std",
    ]


def test_batch_plugin_file_with_reward_kwargs(tmp_path):
    plugin = tmp_path / "easy_plugin.py"
    plugin.write_text(
        textwrap.dedent(
            """
            REWARD_NAME = "easy"
            REWARD_TYPE = "batch"


            def compute_score(reward_inputs, format_weight=0.1):
                return [{"overall": format_weight, "accuracy": 1.0} for _ in reward_inputs]
            """
        )
    )
    spec = f"{plugin}:compute_score"
    (safe,) = build_reward_funcs([spec], reward_kwargs={spec: {"format_weight": 0.3}})
    assert safe.kind == "batch" and safe.__name__ == "compute_score"
    assert safe(["x", "y"], solution=["a", "b"]) == [0.3, 0.3]


ACCURACY_FORMAT_CASES = [
    # (completion, solution, expected overall) = 0.9 * accuracy + 0.1 * format
    ("<think>2+1</think><answer>3</answer>", "3", 1.0),
    ("<answer>3</answer>", "3", 0.9),
    ("<think>2+2</think><answer>4</answer>", "3", 0.1),
    ("nothing", "3", 0.0),
]


@pytest.mark.parametrize(("completion", "solution", "expected"), ACCURACY_FORMAT_CASES)
def test_accuracy_format_table(completion, solution, expected):
    (safe,) = build_reward_funcs(["accuracy_format"])
    assert safe([completion], solution=[solution]) == [pytest.approx(expected)]


def test_accuracy_format_metrics_and_weight():
    logged, log = _metrics()
    (safe,) = build_reward_funcs(["accuracy_format"], reward_kwargs={"accuracy_format": {"format_weight": 0.5}})
    out = safe(
        ["<think>a</think><answer>3</answer>", "<answer>3</answer>", "x"],
        solution=["3", "3", ""],  # the empty solution is a malformed row: isolated
        accu_reward_method=[None, None, None],
        log_metric=log,
    )
    assert out == [1.0, 0.5, None]
    assert dict(logged) == {
        "rewards/accuracy_format/failures": 1.0,
        "rewards/accuracy_format/accuracy": 1.0,
        "rewards/accuracy_format/format": 0.5,
        # EasyR1's names for a run with one reward (over the scored samples)
        "reward/overall": 0.75,
        "reward/accuracy": 1.0,
        "reward/format": 0.5,
    }
