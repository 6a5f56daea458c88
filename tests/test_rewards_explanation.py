"""The explanation reward: CIDEr-D parity with pycocoevalcap, hand-computed cases, and the CLIP term on a tiny random
CLIP built offline."""

from __future__ import annotations

import logging
import math
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from vlm_grpo.rewards import build_reward_funcs
from vlm_grpo.rewards import explanation as explanation_module
from vlm_grpo.rewards.explanation import (
    RunningCiderCorpus,
    batch_cider,
    cider_d,
    cider_tokens,
    clip_similarity,
    explanation_reward,
    load_clip,
    reference_explanations,
)


def build_tiny_clip(out_dir: Path) -> Path:
    """A randomly initialised CLIP (1 layer, width 32, 32 px images) with the tiny BPE tokenizer, saved to out_dir."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    from vlm_grpo.testing.tiny import build_tokenizer

    tokenizer = build_tokenizer("qwen2_5_vl")
    pad = tokenizer.pad_token_id
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": 77,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": pad,
        "pad_token_id": pad,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 32,
        "patch_size": 8,
    }
    torch.manual_seed(0)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))
    images = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory) -> Path:
    return build_tiny_clip(tmp_path_factory.mktemp("tiny_clip"))


@pytest.fixture
def fresh_corpus(monkeypatch) -> RunningCiderCorpus:
    corpus = RunningCiderCorpus()
    monkeypatch.setattr(explanation_module, "CIDER_CORPUS", corpus)
    return corpus


# ----------------------------------------------------------------------------------------------- CIDEr


def test_cider_d_matches_pycocoevalcap():
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.cider.cider_scorer import precook

    gts = {
        0: ["a man is riding a red horse", "a person rides a horse"],
        1: ["two dogs play in the park"],
        2: ["the cat sleeps on a red sofa", "a cat is sleeping"],
    }
    res = {0: ["a man rides a horse"], 1: ["dogs play in a park"], 2: ["a red sofa"]}
    _, expected = Cider().compute_score(gts, res)
    df: Counter = Counter()
    for refs in gts.values():
        df.update({g for r in refs for g in precook(r)})
    ours = [cider_d(res[i][0], gts[i], df, math.log(len(gts))) for i in range(3)]
    assert ours == pytest.approx(list(expected), rel=1e-12)
    assert batch_cider([res[i][0] for i in range(3)], [gts[i] for i in range(3)]) == pytest.approx(list(expected))


def test_idf_batch_is_pycocoevalcap_on_the_batch():
    refs = ["<explain>a man is riding a red horse</explain>", "<explain>two dogs play in the park</explain>"]
    hyps = ["<explain>A man rides a horse.</explain>", "<explain>dogs play in a park</explain>"]
    out = explanation_reward(hyps, solution=refs, idf="batch")
    expected = batch_cider(["a man rides a horse", "dogs play in a park"], [[cider_tokens(r[9:-10])] for r in refs])
    assert out == pytest.approx([v / 10 for v in expected])


EXPLANATION_CASES = [
    # (completion, solution, expected) with a fresh running corpus holding only this reference set, so every
    # n-gram has idf log((1 + 1) / 1): CIDEr is 10 x the mean over n = 1..4 of the n-gram cosine
    # identical 3 words: cosine 1 for 1-, 2-, 3-grams, no 4-gram -> 10 * 3/4 -> 0.75
    ("<explain>A dog runs.</explain>", "<answer>chó</answer><explain>a dog runs</explain>", 0.75),
    ("<explain>a dog runs fast</explain>", "<explain>a dog runs fast</explain>", 1.0),  # all four orders
    ("<explain>cat</explain>", "<explain>a dog runs fast</explain>", 0.0),  # no shared n-gram
    ("<answer>chó</answer>", "<explain>a dog runs fast</explain>", 0.0),  # no explain tag
    ("<explain>   </explain>", "<explain>a dog runs fast</explain>", 0.0),  # empty explanation
    ("<explain>a dog runs fast", "<explain>a dog runs fast</explain>", 0.0),  # not closed
    ("<explain>a dog runs fast</explain>", "<answer>chó</answer>", None),  # no reference: does not apply
]


@pytest.mark.parametrize(("completion", "solution", "expected"), EXPLANATION_CASES)
def test_explanation_table(completion, solution, expected, fresh_corpus):
    out = explanation_reward([completion], solution=[solution])
    assert out == [pytest.approx(expected) if expected is not None else None]


def test_several_references_and_running_idf(fresh_corpus):
    solution = "<answer>x</answer><explain>a dog runs</explain><explain>the dog is running</explain>"
    assert reference_explanations(solution) == ["a dog runs", "the dog is running"]
    first = explanation_reward(["<explain>a dog runs</explain>"], solution=[solution])[0]
    assert 0 < first < 1  # one reference matches, the other only partly
    # other documents in the corpus raise the idf of the rare n-grams, not of "dog" which every document has
    explanation_reward(["x"], solution=["<explain>a dog sleeps</explain>"])
    explanation_reward(["x"], solution=["<explain>the dog barks loudly</explain>"])
    assert fresh_corpus.num_docs == 3
    explanation_reward(["x"], solution=[solution])  # a reference set counts once
    assert fresh_corpus.num_docs == 3


def test_bad_parameters_raise():
    with pytest.raises(ValueError):
        explanation_reward(["x"], solution=["<explain>y</explain>"], clip_weight=2)
    with pytest.raises(ValueError):
        explanation_reward(["x"], solution=["<explain>y</explain>"], idf="corpus")
    with pytest.raises(ValueError, match="solution"):
        explanation_reward(["x"])


def test_without_clip_the_term_is_skipped_with_a_message(caplog, monkeypatch, fresh_corpus):
    monkeypatch.setattr(explanation_module, "_NO_CLIP_WARNED", False)
    with caplog.at_level(logging.WARNING, logger="vlm_grpo.rewards.explanation"):
        out = explanation_reward(
            ["<explain>a dog runs fast</explain>"], solution=["<explain>a dog runs fast</explain>"]
        )
    assert out == [pytest.approx(1.0)]
    assert "CLIP term is skipped" in caplog.text and "clip_model" in caplog.text


# ----------------------------------------------------------------------------------------------- CLIP


def test_clip_term_mixes_in_and_loads_once(tiny_clip, tmp_path, fresh_corpus):
    image = Image.new("RGB", (40, 30), (200, 30, 30))
    path = tmp_path / "img.png"
    image.save(path)
    completions = ["<explain>a red square</explain>", "<explain>a red square</explain>", "<explain>no</explain>"]
    solution = ["<explain>a red square</explain>"] * 3
    cider_only = explanation_reward(completions, solution=solution)
    assert cider_only[:2] == [pytest.approx(0.75)] * 2

    (reward,) = build_reward_funcs(
        ["explanation"], reward_kwargs={"explanation": {"clip_model": str(tiny_clip), "clip_weight": 0.4}}
    )
    out = reward(completions, solution=solution, images=[[image], None, [image]], image_path=[None, [str(path)], None])
    clip_s = clip_similarity(["a red square"], [image], str(tiny_clip))[0]
    assert 0.0 <= clip_s <= 1.0
    assert out[0] == pytest.approx(0.6 * 0.75 + 0.4 * clip_s, abs=1e-5)
    assert out[1] == pytest.approx(out[0], abs=1e-5)  # the same image, read from image_path
    assert 0.0 <= out[2] <= 1.0
    # a row without image: CIDEr only
    assert reward(completions[:1], solution=solution[:1]) == [pytest.approx(0.75)]
    # weights are loaded once per process
    model, _ = load_clip(str(tiny_clip))
    reward(completions, solution=solution, images=[[image]] * 3)
    assert load_clip(str(tiny_clip))[0] is model
    assert sum(1 for key in explanation_module._CLIP_CACHE if key[0] == str(tiny_clip)) == 1
