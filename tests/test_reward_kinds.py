"""Peers' reward files run unchanged: verl-style signatures, two plugins with one function name, and a reward
that cannot score anything stops the run with its name."""

from __future__ import annotations

import pytest

from vlm_grpo.rewards import SafeReward, build_reward_funcs, reward_kind
from vlm_grpo.rewards.base import RewardError
from vlm_grpo.rewards.catalog import reward_labels

DEEPEYES = '''
def compute_score(predict_str, ground_truth, extra_info):
    """DeepEyes' signature: the question comes in extra_info."""
    answer = predict_str.split("<answer>")[-1].split("</answer>")[0].strip()
    bonus = 0.5 if extra_info.get("question", "").startswith("What colour") else 0.0
    return {"score": float(answer == ground_truth) + bonus, "acc": float(answer == ground_truth)}
'''

VERL = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's default signature."""
    return 2.0 if data_source == "geo" and ground_truth in solution_str else 0.0
'''


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_verl_signatures_are_detected_and_called_per_sample(tmp_path):
    deepeyes = _write(tmp_path, "deepeyes_reward.py", DEEPEYES)
    verl = _write(tmp_path, "verl_reward.py", VERL)
    funcs = build_reward_funcs([f"{deepeyes}:compute_score", f"{verl}:compute_score"])
    assert [f.kind for f in funcs] == ["verl", "verl"]
    assert [f.__name__ for f in funcs] == ["deepeyes_reward.compute_score", "verl_reward.compute_score"]
    metrics = {}
    columns = {
        "solution": ["red", "blue"],
        "question": ["What colour is it?", "Which side?"],
        "data_source": ["geo", "chart"],
        "extra_info": [{"index": 3}, {"index": 4}],
        "log_metric": metrics.__setitem__,
    }
    completions = ["<answer>red</answer>", "<answer>blue</answer>"]
    assert funcs[0](completions, **columns) == [1.5, 1.0]
    assert metrics["rewards/deepeyes_reward.compute_score/acc"] == 1.0
    assert funcs[1](completions, **columns) == [2.0, 0.0]  # data_source "chart" scores 0


def test_the_extra_info_carries_the_rows_columns_and_its_own_dict():
    seen = []

    def compute_score(predict_str, ground_truth, extra_info):
        seen.append(extra_info)
        return 1.0

    assert reward_kind(compute_score) == "verl"
    SafeReward(compute_score, "x")(["a"], solution=["s"], question=["q?"], extra_info=[{"split": "train"}])
    assert seen[0]["question"] == "q?" and seen[0]["split"] == "train" and "response" not in seen[0]


def test_two_plugins_with_one_function_name_get_two_labels_and_their_own_kwargs(tmp_path):
    a = _write(
        tmp_path,
        "math_reward.py",
        "def compute_score(completions, scale=1.0, **kw):\n    return [scale] * len(completions)\n",
    )
    b = _write(
        tmp_path,
        "r1v_reward.py",
        "def compute_score(completions, scale=1.0, **kw):\n    return [-scale] * len(completions)\n",
    )
    specs = [f"{a}:compute_score", f"{b}:compute_score"]
    assert [label for label, _ in reward_labels(specs)] == ["math_reward.compute_score", "r1v_reward.compute_score"]
    funcs = build_reward_funcs(
        specs, reward_kwargs={"math_reward.compute_score": {"scale": 2.0}, specs[1]: {"scale": 3.0}}
    )
    assert [f(["x"]) for f in funcs] == [[2.0], [-3.0]]
    assert [f.__name__ for f in funcs] == ["math_reward.compute_score", "r1v_reward.compute_score"]  # metric names
    # the same function name in two modules (``package.module:fn``): labelled by the module's last part
    mods = reward_labels(["my_pkg.math_reward:compute_score", "my_pkg.r1v:compute_score", "format"])
    assert mods == [("math_reward.compute_score", "my_pkg.math_reward:compute_score"),
                    ("r1v.compute_score", "my_pkg.r1v:compute_score"), ("format", "format")]  # fmt: skip
    # A unique function name is its own label; an explicit alias wins.
    assert reward_labels([specs[0], "accuracy"]) == [("compute_score", specs[0]), ("accuracy", "accuracy")]
    assert reward_labels([f"acc2={specs[0]}"]) == [("acc2", specs[0])]
    with pytest.raises(ValueError, match="would both log as 'same'"):
        reward_labels([f"same={specs[0]}", f"same={specs[1]}"])
    with pytest.raises(ValueError, match=r"names reward 'compute_score', which is not in --reward_funcs \(labels: "):
        build_reward_funcs(specs, reward_kwargs={"compute_score": {"scale": 2.0}})


def test_a_reward_that_fails_on_every_sample_of_its_first_batch_stops_the_run(tmp_path):
    wrong = _write(tmp_path, "wrong.py", "def score(completions, answer):\n    return [1.0] * len(completions)\n")
    (safe,) = build_reward_funcs([f"{wrong}:score"])
    with pytest.raises(
        RewardError, match=r"reward 'score' raised on every sample of its first batch \(TypeError: .*answer"
    ):
        safe(["a", "b"], solution=["x", "y"])
    # Negative control: with fail-fast off, the same reward just gives no reward.
    (lenient,) = build_reward_funcs([f"{wrong}:score"], max_failed_batches=0)
    assert lenient(["a", "b"], solution=["x", "y"]) == [None, None]


def test_partial_failures_keep_training_and_n_broken_batches_in_a_row_stop_it():
    def flaky(completions, **kw):
        if any("boom" in c for c in completions):
            raise ValueError("boom")
        return [1.0] * len(completions)

    safe = SafeReward(flaky, "flaky", max_failed_batches=2)
    assert safe(["ok", "boom"]) == [1.0, None]  # partial: counted, not fatal
    assert safe(["boom"]) == [None]  # one broken batch after a good start
    assert safe(["ok"]) == [1.0]
    assert safe(["boom"]) == [None]
    with pytest.raises(RewardError, match="2 batches in a row"):
        safe(["boom", "boom"])


def test_a_reward_that_names_the_tokenizer_gets_it_and_others_do_not():
    class Processor:
        tokenizer = "the-tokenizer"

    def cosine_length(completions, tokenizer, **kwargs):
        assert "processing_class" not in kwargs  # only what it names
        return [float(tokenizer == "the-tokenizer")] * len(completions)

    def plain(completions, **kwargs):
        assert "tokenizer" not in kwargs and "processing_class" not in kwargs
        return [1.0] * len(completions)

    overrides = {"cosine_length": cosine_length, "plain": plain}
    funcs = build_reward_funcs(["cosine_length", "plain"], overrides, processing_class=Processor())
    assert [f(["a"]) for f in funcs] == [[1.0], [1.0]]


def test_vlmr1_reward_kwargs_image_grid_thw_and_answer_tags(tiny_models, tmp_path):
    """VLM-R1's iou_reward reads image_grid_thw[i] = [t, h, w] (patches of 14 px) and '<answer>'-wrapped solutions."""
    import json

    from PIL import Image

    from vlm_grpo.data import prepare_rows, read_rows, to_datasets
    from vlm_grpo.modules import get_vlm_module
    from vlm_grpo.recipe import wrap_solutions

    Image.new("RGB", (120, 64), (200, 30, 30)).save(tmp_path / "a.png")
    rows = [
        {
            "image": "a.png",
            "conversations": [{"from": "human", "value": "<image>Box?"}, {"from": "gpt", "value": "[1, 2, 3, 4]"}],
        },
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "<answer>x</answer>"}]},
    ]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    model_dir = str(tiny_models["qwen2_5_vl"])
    module = get_vlm_module(model_dir)
    processor = module.load_processor(model_dir)
    read, bad = read_rows([str(tmp_path / "rows.jsonl")], task_type="raw")
    wrap_solutions(read)
    dataset, _ = to_datasets(prepare_rows(read, bad, module, processor), module)
    first, second = dataset[0], dataset[1]
    expected = processor.image_processor(images=[Image.open(tmp_path / "a.png")], return_tensors="pt")["image_grid_thw"]
    assert first["image_grid_thw"] == expected[0].tolist()
    assert second["image_grid_thw"] is None  # no image
    assert first["solution"] == "<answer> [1, 2, 3, 4] </answer>" and second["solution"] == "<answer>x</answer>"


def test_vlmr1_rows_without_image_markers_put_the_images_first(tmp_path, caplog):
    """VLM-R1's own gui_multi-image.jsonl: two images, no <image> marker."""
    import json
    import logging

    from PIL import Image

    from vlm_grpo.data import read_rows

    for name in ("s1.png", "s2.png"):
        Image.new("RGB", (32, 32), (10, 10, 10)).save(tmp_path / name)
    row = {"image": ["s1.png", "s2.png"], "conversations": [{"from": "human", "value": "Which screen changed?"},
                                                            {"from": "gpt", "value": "the second"}]}  # fmt: skip
    path = tmp_path / "gui_multi-image.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps(row) + "\n")
    with caplog.at_level(logging.INFO):
        rows, bad = read_rows([str(path)])
    assert not bad and len(rows) == 2
    assert rows[0]["question"] == "<image><image>Which screen changed?"
    notes = [r.getMessage() for r in caplog.records if "no '<image>' marker" in r.getMessage()]
    assert len(notes) == 1 and "2 row(s)" in notes[0]  # said once per file, not per row


def test_seed_aliases_rename_only_the_seeds_names_and_say_so(caplog):
    import logging

    from vlm_grpo.rewards.catalog import apply_seed_aliases

    entries = ["accuracy", "format", "iou", "my=accuracy"]
    assert apply_seed_aliases(entries, None) == entries and apply_seed_aliases(entries, "") == entries
    with caplog.at_level(logging.INFO, logger="vlm_grpo.rewards.catalog"):
        got = apply_seed_aliases(entries, "vivqa_x")
    assert got == ["accuracy=vqa_graded", "format=format_explain", "iou", "my=accuracy"]
    assert caplog.messages == [
        "--reward_aliases vivqa_x: reward 'accuracy' is vivqa_x's name for 'vqa_graded'",
        "--reward_aliases vivqa_x: reward 'format' is vivqa_x's name for 'format_explain'",
    ]  # 'explanation' maps to itself: no note
    assert apply_seed_aliases(["explanation"], "vivqa_x") == ["explanation"]
    with pytest.raises(ValueError, match=r"^Unknown --reward_aliases 'x'\. Available: lewis, vivqa_x$"):
        apply_seed_aliases(entries, "x")


def test_labels_of_every_kind_of_entry():
    assert reward_labels(["accuracy", "a/b/my_file.py:score", "pkg.mod:fn", "x-1.y=format"]) == [
        ("accuracy", "accuracy"),
        ("score", "a/b/my_file.py:score"),
        ("fn", "pkg.mod:fn"),
        ("x-1.y", "format"),
    ]
    with pytest.raises(
        ValueError, match=r"would both log as 'score': give one a name, e\.g\. my_score=dir/f\.py:score"
    ):
        reward_labels(["score=accuracy", "dir/f.py:score"])  # an alias is not a function name: no qualifying
    with pytest.raises(ValueError, match="would both log as 'accuracy'"):
        reward_labels(["accuracy", "accuracy"])
    with pytest.raises(ValueError) as info:
        reward_labels(["a.py:f", "f=format", "b.py:g"])
    assert str(info.value) == (
        "--reward_funcs entries 'a.py:f' and 'f=format' would both log as 'f': give one a name, e.g. my_f=f=format"
    )
    with pytest.raises(
        ValueError, match=r"entries .a\.f=format. and .a\.py:f. would both log as .a\.f.: .*my_a_f=a\.py:f"
    ):
        reward_labels(["a.f=format", "a.py:f", "b.py:f"])


def test_kwargs_bind_by_label_spec_or_entry_and_unknown_names_are_refused(tmp_path):
    plugin = _write(
        tmp_path, "scaled.py", "def score(completions, scale=1.0, **kw):\n    return [scale] * len(completions)\n"
    )
    entries = [f"{plugin}:score", f"other={plugin}:score"]
    funcs = build_reward_funcs(entries, reward_kwargs={"scaled.score": {"scale": 2.0}, "other": {"scale": 5.0}})
    assert [f.__name__ for f in funcs] == ["scaled.score", "other"] and [f(["x"]) for f in funcs] == [[2.0], [5.0]]
    funcs = build_reward_funcs(entries, reward_kwargs={entries[1]: {"scale": 7.0}, f"{plugin}:score": {"scale": 3.0}})
    assert [f(["x"]) for f in funcs] == [[3.0], [7.0]]
    funcs = build_reward_funcs(entries, reward_kwargs='{"other": {"scale": 4.0}}')  # JSON text, as on the CLI
    assert [f(["x"]) for f in funcs] == [[1.0], [4.0]]
    with pytest.raises(ValueError) as info:
        build_reward_funcs(entries, reward_kwargs={"nope": {"scale": 1.0}})
    assert str(info.value) == (
        "--reward_kwargs names reward 'nope', which is not in --reward_funcs (labels: scaled.score, other)"
    )


def test_overrides_win_and_a_non_callable_is_refused():
    def mine(completions, **kwargs):
        return [9.0] * len(completions)

    (fn,) = build_reward_funcs(["accuracy"], overrides={"accuracy": mine})
    assert fn.__name__ == "accuracy" and fn(["x"], solution=["y"]) == [9.0]
    (fn,) = build_reward_funcs(["accuracy"], overrides={"accuracy": "json:dumps"})  # a lazy ``module:attr``
    assert fn.fn.__name__ == "dumps"
    with pytest.raises(TypeError, match=r"^Reward 'accuracy' resolved to 3, which is not callable$"):
        build_reward_funcs(["accuracy"], overrides={"accuracy": 3})
    (fn,) = build_reward_funcs(["format"], overrides={"accuracy": mine})  # only the names it gives
    assert fn.fn is not mine and fn(["<think>a</think><answer>b</answer>"]) != [9.0]


def test_the_run_processor_and_its_tokenizer_reach_rewards_that_name_them(tmp_path):
    from types import SimpleNamespace

    plugin = _write(
        tmp_path,
        "tok.py",
        "def by_tok(completions, tokenizer, **kw):\n    return [float(tokenizer.n)] * len(completions)\n"
        "def by_proc(completions, processing_class, **kw):\n    return [float(processing_class.tokenizer.n)]\n",
    )
    processor = SimpleNamespace(tokenizer=SimpleNamespace(n=3))
    funcs = build_reward_funcs([f"{plugin}:by_tok", f"{plugin}:by_proc"], processing_class=processor)
    assert [f(["x"]) for f in funcs] == [[3.0], [3.0]]
    text_only = SimpleNamespace(n=4)  # a text-only run passes the tokenizer itself
    (fn,) = build_reward_funcs([f"{plugin}:by_tok"], processing_class=text_only)
    assert fn(["x"]) == [4.0]


def test_a_reward_fails_the_run_after_max_failed_batches_in_a_row(tmp_path):
    plugin = _write(
        tmp_path,
        "half.py",
        "def half(completions, **kw):\n    if completions[0] == 'bad':\n        raise ValueError('no')\n"
        "    return [1.0] * len(completions)\n",
    )
    (fn,) = build_reward_funcs([f"{plugin}:half"], max_failed_batches=2)
    assert fn(["ok"]) == [1.0]
    assert fn(["bad"]) == [None]
    with pytest.raises(RewardError):
        fn(["bad"])


def test_a_reward_naming_a_missing_package_names_the_extra_to_install():
    from vlm_grpo.rewards.catalog import check_requirements

    def needs(completions, **kwargs):
        return [0.0] * len(completions)

    check_requirements("needs", needs)  # nothing required
    needs.requires = {"json": "none", "vlm_grpo_absent_pkg": "extra1"}
    with pytest.raises(ImportError) as info:
        check_requirements("needs", needs)
    assert str(info.value) == "Reward 'needs' needs the 'vlm_grpo_absent_pkg' package: pip install 'vlm-grpo[extra1]'"
    with pytest.raises(ImportError, match="vlm-grpo\\[extra1\\]"):
        build_reward_funcs(["n"], overrides={"n": needs})


def test_bad_reward_kwargs_name_the_flag_and_show_an_example():
    from vlm_grpo.rewards.catalog import parse_reward_kwargs

    assert parse_reward_kwargs('{"iou": {"threshold": 0.5}}') == {"iou": {"threshold": 0.5}}
    with pytest.raises(ValueError, match=r"^--reward_kwargs is not valid JSON \("):
        parse_reward_kwargs("{not json")
    with pytest.raises(ValueError) as info:
        parse_reward_kwargs("[1, 2]")
    assert str(info.value) == '--reward_kwargs must map names to keyword arguments, e.g. {"iou": {"threshold": 0.5}}'
