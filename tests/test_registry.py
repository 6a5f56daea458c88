"""The generic registry (names, lazy specs, file plugins) and SafeReward's failure isolation."""

from __future__ import annotations

import logging
import sys
import textwrap

import pytest

from vlm_grpo.registry import Registry, UnknownEntryError, load_object
from vlm_grpo.rewards import REWARDS, SafeReward, build_reward_funcs, completion_text

# ----------------------------------------------------------------------------------------------- Registry


def _reward_a(completions, **kwargs):
    return [1.0] * len(completions)


def _reward_b(completions, **kwargs):
    return [0.0] * len(completions)


def test_register_and_get():
    reg: Registry = Registry("reward")

    @reg.register("a")
    def fn(completions, **kwargs):
        return [1.0] * len(completions)

    reg.register("b", _reward_b)
    assert reg.get("a") is fn
    assert reg.get("b") is _reward_b
    assert reg.names() == ["a", "b"]
    assert "a" in reg and "zzz" not in reg
    assert list(reg) == ["a", "b"]


def test_lazy_module_attr_is_imported_on_first_get(tmp_path, monkeypatch):
    package = tmp_path / "lazy_reward_pkg_for_test"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text("def fn(completions, **kw):\n    return [0.25] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg: Registry = Registry("reward")
    reg.register("lazy", "lazy_reward_pkg_for_test.mod:fn")
    assert "lazy_reward_pkg_for_test.mod" not in sys.modules
    fn = reg.get("lazy")
    assert fn(["x", "y"]) == [0.25, 0.25]
    assert reg.get("lazy") is fn  # resolved once, then cached
    monkeypatch.delitem(sys.modules, "lazy_reward_pkg_for_test.mod")
    monkeypatch.delitem(sys.modules, "lazy_reward_pkg_for_test")


def test_unregistered_module_spec_is_loaded_directly():
    reg: Registry = Registry("reward")
    assert reg.get("math:sqrt")(9) == 3


def test_plugin_file(tmp_path):
    plugin = tmp_path / "my_reward.py"
    plugin.write_text(
        textwrap.dedent(
            """
            def length_reward(completions, **kwargs):
                return [float(len(c)) for c in completions]
            """
        )
    )
    spec = f"{plugin}:length_reward"
    fn = REWARDS.get(spec)
    assert fn(["ab", "abc"]) == [2.0, 3.0]
    assert REWARDS.get(spec) is fn  # the module is loaded once
    (safe,) = build_reward_funcs([spec])
    assert isinstance(safe, SafeReward) and safe.__name__ == "length_reward"
    assert safe(["abcd"], solution=["x"]) == [4.0]


def test_plugin_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_object(f"{tmp_path / 'missing.py'}:fn")
    plugin = tmp_path / "empty_plugin.py"
    plugin.write_text("x = 1\n")
    with pytest.raises(AttributeError, match="has no attribute 'fn'"):
        load_object(f"{plugin}:fn")
    with pytest.raises(ValueError, match="module:attr"):
        load_object("no_colon_here")


def test_plugin_file_that_fails_to_import_is_not_cached(tmp_path):
    plugin = tmp_path / "flaky_plugin.py"
    plugin.write_text("raise RuntimeError('broken plugin')\n")
    with pytest.raises(RuntimeError, match="broken plugin"):
        load_object(f"{plugin}:fn")
    plugin.write_text("def fn(completions, **kw):\n    return [1.0] * len(completions)\n")
    assert load_object(f"{plugin}:fn")(["a"]) == [1.0]


def test_unknown_name_lists_available():
    with pytest.raises(KeyError) as excinfo:
        REWARDS.get("x")
    message = str(excinfo.value)
    assert message.startswith("Unknown reward 'x'. Available: ")
    for name in ("accuracy", "format", "iou"):
        assert name in message
    assert isinstance(excinfo.value, UnknownEntryError)


def test_unknown_name_in_small_registry():
    reg: Registry = Registry("widget")
    reg.register("b", _reward_b)
    reg.register("a", _reward_a)
    with pytest.raises(KeyError, match=r"^Unknown widget 'c'\. Available: a, b$"):
        reg.get("c")


def test_duplicate_registration_errors():
    reg: Registry = Registry("reward")
    reg.register("a", _reward_a)
    reg.register("a", _reward_a)  # the very same object again is harmless
    with pytest.raises(ValueError, match="reward 'a' is already registered"):
        reg.register("a", _reward_b)
    with pytest.raises(ValueError, match="already registered"):

        @reg.register("a")
        def other(completions, **kwargs):
            return []


def test_duplicate_lazy_registration():
    reg: Registry = Registry("reward")
    reg.register("lazy", "tests_module_does_not_exist:fn")
    reg.register("lazy", "tests_module_does_not_exist:fn")  # same spec: fine
    with pytest.raises(ValueError, match="already registered"):
        reg.register("lazy", "other_module:fn")
    with pytest.raises(ValueError, match="already registered"):
        reg.register("lazy", _reward_a)  # defined elsewhere than the lazy spec names


def test_lazy_entry_may_be_replaced_by_its_own_module():
    # A lazily registered module that decorates its function with the same name on import is fine.
    reg: Registry = Registry("reward")
    reg.register("a", f"{__name__}:_reward_a")
    reg.register("a", _reward_a)
    assert reg.get("a") is _reward_a


# ----------------------------------------------------------------------------------------------- SafeReward


def _raise_on_boom(completions, **kwargs):
    out = []
    for c in completions:
        if c == "boom":
            raise RuntimeError("boom!")
        out.append(1.0)
    return out


def test_safe_reward_isolates_a_failing_sample(caplog):
    metrics = []
    safe = SafeReward(_raise_on_boom, "boomy")
    with caplog.at_level(logging.WARNING, logger="vlm_grpo.rewards.base"):
        out = safe(
            ["ok", "boom", "ok"],
            solution=["a", "b", "c"],
            log_metric=lambda name, value: metrics.append((name, value)),
            trainer_state=object(),
        )
    assert out == [1.0, None, 1.0]
    assert safe.failures == 1
    assert metrics == [("rewards/boomy/failures", 1.0)]
    assert "boomy" in caplog.text and "boom!" in caplog.text
    assert any(r.levelno == logging.WARNING for r in caplog.records)


def test_safe_reward_counts_failures_across_calls():
    metrics = []
    safe = SafeReward(_raise_on_boom, "boomy")
    log = lambda name, value: metrics.append(value)  # noqa: E731
    safe(["boom", "boom"], log_metric=log)
    safe(["ok"], log_metric=log)
    safe(["boom"], log_metric=log)
    assert safe.failures == 3
    assert metrics == [2.0, 0.0, 1.0]


def test_safe_reward_slices_columns_per_sample():
    def needs_solution(completions, solution, **kwargs):
        if "bad" in solution:
            raise ValueError("bad row")
        return [1.0 if c == s else 0.0 for c, s in zip(completions, solution, strict=True)]

    safe = SafeReward(needs_solution, "match")
    assert safe(["a", "b", "c"], solution=["a", "bad", "x"], prompts=["p1", "p2", "p3"]) == [1.0, None, 0.0]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (float("inf"), None),
        (float("-inf"), None),
        (float("nan"), None),
        (10**400, None),  # float() overflows
        ("abc", None),
        (None, None),
        (True, 1.0),
        (0.5, 0.5),
        ("0.25", 0.25),
    ],
)
def test_safe_reward_cleans_values(value, expected):
    safe = SafeReward(lambda completions, **kw: [value, 1.0], "const")
    assert safe(["a", "b"]) == [expected, 1.0]
    assert safe.failures == (0 if value is None or expected is not None else 1)


def test_safe_reward_wrong_length_falls_back_to_per_sample():
    calls = []

    def sometimes_wrong(completions, **kwargs):
        calls.append(len(completions))
        return [1.0]  # one value, whatever the batch size

    safe = SafeReward(sometimes_wrong, "len")
    assert safe(["a", "b", "c"]) == [1.0, 1.0, 1.0]
    assert calls == [3, 1, 1, 1]


def test_safe_reward_passes_only_accepted_kwargs():
    seen = {}

    def narrow(completions, solution):
        seen["args"] = (list(completions), list(solution))
        return [0.5] * len(completions)

    safe = SafeReward(narrow, "narrow")
    out = safe(
        ["a"], solution=["s"], prompts=["p"], trainer_state=None, log_metric=lambda *a: None, image_sizes=[[[1, 1]]]
    )
    assert out == [0.5]
    assert seen["args"] == (["a"], ["s"])
    assert safe.failures == 0


def test_safe_reward_passes_everything_to_var_kwargs():
    seen = {}

    def wide(completions, **kwargs):
        seen.update(kwargs)
        return [0.0] * len(completions)

    SafeReward(wide, "wide")(["a"], solution=["s"], task_type=["rec"])
    assert seen == {"solution": ["s"], "task_type": ["rec"]}


def test_build_reward_funcs_builtins():
    funcs = build_reward_funcs(["accuracy", "format", "iou"])
    assert [f.__name__ for f in funcs] == ["accuracy", "format", "iou"]
    accuracy, fmt, iou = funcs
    completions = ["<think>a</think><answer>[0, 0, 10, 10]</answer>", "oops"]
    assert fmt(completions) == [1.0, 0.0]
    assert iou(completions, solution=["[0, 0, 10, 10]", "[0, 0, 10, 10]"]) == [1.0, 0.0]
    assert accuracy(["<answer>3</answer>"], solution=["3"], accu_reward_method=[None]) == [1.0]
    with pytest.raises(KeyError, match="Unknown reward"):
        build_reward_funcs(["nope"])


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("plain", "plain"),
        ([{"role": "assistant", "content": "hi"}], "hi"),
        ([{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "image"}]}], "a"),
        ([{"role": "assistant", "content": None}], ""),
        (None, ""),
    ],
)
def test_completion_text(completion, expected):
    assert completion_text(completion) == expected


def test_a_reward_whose_optional_package_is_missing_names_the_extra():
    from vlm_grpo.rewards import build_reward_funcs

    def needs_a_package(completions, **kwargs):
        return [0.0 for _ in completions]

    needs_a_package.requires = {"vlm_grpo_no_such_package": "someextra"}
    with pytest.raises(
        ImportError, match=r"needs the 'vlm_grpo_no_such_package' package: pip install 'vlm-grpo\[someextra\]'"
    ):
        build_reward_funcs([needs_a_package.__name__], overrides={needs_a_package.__name__: needs_a_package})
    needs_a_package.requires = {"json": "none"}  # present: no error
    assert len(build_reward_funcs(["needs_a_package"], overrides={"needs_a_package": needs_a_package})) == 1
