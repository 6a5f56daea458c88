"""Tool rollouts keep their KV cache across turns, with the tokens, masks and metrics of TRL's own tool loop.

Each rollout makes two scripted ``zoom_in`` rounds, every other rollout with a bad box (an error text, no image:
one batch holds both kinds of reply), then answers with the tiny model's own greedy tokens. A scripted turn is
the model's own first tokens followed by the call, so the next turn reuses cache slots the decode wrote as well as
the prompt's. The same step with ``share_prefill`` off runs TRL's loop with ``generate`` for every turn: the
rollouts' tokens, tool masks and logged metrics must be equal. Independently of the code under test, forward hooks
count the tokens prefilled (the language model's embedding calls over more than one token) and the images the vision
tower encodes in the turns after the first: they must be the tokens and images new to each rollout. Negative
control: rows handed another rollout's held cache must change the answers.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from e2e_utils import base_args, make_dataset
from test_generation_parity import sharp_model_getter
from test_tool_turns_fast import BOX
from vlm_grpo.fastpath import turn_cache
from vlm_grpo.grpo_jsonl import main, parse_args
from vlm_grpo.testing.tiny import FAMILIES
from vlm_grpo.trainer import VLMGRPOTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROUNDS = 2  # scripted tool rounds before the answer
OWN = 3  # the model's own tokens at the head of a scripted turn


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("turn_cache"), kinds=("single",))


@pytest.fixture(scope="module")
def sharp_models(tmp_path_factory):
    return sharp_model_getter(tmp_path_factory.mktemp("sharp_turns"))


def _vision_tower(model):
    inner = model.model
    return getattr(inner, "visual", None) or inner.vision_tower


def run(family: str, model_dir, dataset, out, share: bool, swap_rows: bool = False) -> dict:
    """One GRPO step; returns the rollouts (ids, masks), the tool metrics, and per later turn: the rows' inputs and
    outputs, the tokens prefilled and the images encoded (counted by hooks)."""
    data, plugin = dataset
    calls = [
        {"name": "zoom_in", "arguments": {"bbox_2d": BOX[family], "image_index": 0}},
        {"name": "zoom_in", "arguments": {"bbox_2d": [50, 50, 10, 10]}},  # inverted: an error text, no image
    ]
    texts = [f"<tool_call>\n{json.dumps(call)}\n</tool_call><|im_end|>" for call in calls]
    seen: dict = {"turns": [], "rollouts": None}
    generate = VLMGRPOTrainer._generate_single_turn
    counter = {"tokens": 0, "images": 0}

    def scripted(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if not getattr(self, "_hooked", False):
            self._hooked = True
            unwrapped = self.accelerator.unwrap_model(self.model)
            pad = self._tokenizer.pad_token_id

            def embed_hook(module, args):
                ids = args[0]
                if ids.dim() == 2 and ids.size(1) > 1:  # a prefill; decode steps feed one token a row
                    counter["tokens"] += int((ids != pad).sum())

            def vision_hook(module, args, kwargs):
                grid = kwargs.get("grid_thw")
                if grid is None and len(args) > 1:
                    grid = args[1]
                pixels = args[0] if args else kwargs["pixel_values"]  # InternVL: one tile an image here
                counter["images"] += int(grid.size(0)) if grid is not None else int(pixels.size(0))

            unwrapped.get_input_embeddings().register_forward_pre_hook(embed_hook)
            _vision_tower(unwrapped).register_forward_pre_hook(vision_hook, with_kwargs=True)
        round_ = 0 if num_generations > 1 else self._round + 1
        self._round = round_
        before = dict(counter)
        config = self.generation_config
        budget = config.max_new_tokens
        if round_ < ROUNDS:
            config.max_new_tokens = OWN
        try:
            ids, logprobs = generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        finally:
            config.max_new_tokens = budget
        seen["turns"].append(
            {
                "inputs": [list(p) for p in prompt_ids],
                "outputs": [list(x) for x in ids],
                "images": [len(x) if x else 0 for x in images] if images is not None else None,
                "prefilled": counter["tokens"] - before["tokens"],
                "encoded": counter["images"] - before["images"],
            }
        )
        if round_ < ROUNDS:
            eos = set(self.eos_token_ids)
            ids = [
                [t for t in own if t not in eos]
                + self._tokenizer.encode(texts[i % 2] if round_ == 0 else texts[0], add_special_tokens=False)
                for i, own in enumerate(ids)
            ]
        return ids, logprobs

    real_generate = VLMGRPOTrainer._generate

    def recorded(self, prompts):
        result = real_generate(self, prompts)
        seen["rollouts"] = (result[1], result[2])
        return result

    match = turn_cache.TurnCache.match

    def swapped(self, ids, keys=()):
        held, n = match(self, ids, keys)
        if held is not None and len(self.held) > 1:
            other = self.held[(self.held.index(held) + 1) % len(self.held)]
            held = dataclasses.replace(held, row=other.row)
        return held, n

    argv = base_args(model_dir, data, plugin, out, steps=1)
    argv += ["--generation_kwargs", '{"max_new_tokens": 10, "do_sample": false}', "--share_prefill", str(share)]
    argv += ["--tools", "zoom_in", "--max_tool_calling_iterations", str(ROUNDS), "--max_completion_length", "400"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(VLMGRPOTrainer, "_generate_single_turn", scripted)
        mp.setattr(VLMGRPOTrainer, "_generate", recorded)
        if swap_rows:
            mp.setattr(turn_cache.TurnCache, "match", swapped)
        trainer = main(*parse_args(argv))
    logged = trainer.state.log_history[0]
    seen["metrics"] = {k: v for k, v in logged.items() if k.startswith(("tools/", "completions/"))}
    seen["stats"] = trainer.last_turn_stats
    return seen


def new_tokens(turns: list[dict]) -> list[int]:
    """Per later turn: the tokens of each row not held from its previous turn (what that turn fed and generated,
    all but the last generated token), all but the row's last token (the decode feeds it), summed over rows."""
    counts = []
    for previous, turn in itertools.pairwise(turns):
        held = [inp + out[:-1] for inp, out in zip(previous["inputs"], previous["outputs"], strict=True)]
        total = 0
        for ids in turn["inputs"]:
            best = 0
            for h in held:
                n = 0
                while n < min(len(h), len(ids) - 1) and h[n] == ids[n]:
                    n += 1
                best = max(best, n)
            total += len(ids) - 1 - best
        counts.append(total)
    return counts


def new_images(turns: list[dict]) -> list[int]:
    """Per later turn: the tool images the rollouts got since their previous turn (every rollout calls a tool in
    every scripted round, so each turn has the same rows)."""
    return [sum(t["images"] or [0]) - sum(p["images"] or [0]) for p, t in itertools.pairwise(turns)]


@pytest.mark.parametrize("family", FAMILIES)
def test_held_caches_give_trls_rollouts(family, sharp_models, dataset, tmp_path):
    model = sharp_models(family)
    trl = run(family, model, dataset, tmp_path / "trl", share=False)
    ours = run(family, model, dataset, tmp_path / "ours", share=True)
    assert len(ours["turns"]) == len(trl["turns"]) == ROUNDS + 1
    assert all(len(t["inputs"]) == 4 for t in ours["turns"])
    assert ours["rollouts"] == trl["rollouts"]  # every token of every rollout, and its tool mask
    assert ours["metrics"] == trl["metrics"]
    answers = ours["turns"][-1]["outputs"]
    assert len(answers) == 4 and all(answers) and len({tuple(a) for a in answers}) > 1
    stats = ours["stats"]
    assert stats.calls == ROUNDS and not stats.fallbacks
    # Only what is new to each rollout is prefilled, and only the new tool images are encoded.
    assert [t["prefilled"] for t in ours["turns"][1:]] == new_tokens(ours["turns"])
    assert [t["encoded"] for t in ours["turns"][1:]] == new_images(ours["turns"])
    # TRL's loop prefills every history again and re-encodes every image: the counts see the difference.
    assert sum(t["prefilled"] for t in trl["turns"][1:]) > 2 * sum(new_tokens(trl["turns"]))
    assert [t["encoded"] for t in trl["turns"][1:]] == [sum(t["images"]) for t in trl["turns"][1:]]
    assert sum(new_images(trl["turns"])) < sum(sum(t["images"]) for t in trl["turns"][1:])
    if family == "qwen2_5_vl":  # the control: each row reads its held slots from another rollout's row of the cache
        broken = run(family, model, dataset, tmp_path / "broken", share=True, swap_rows=True)
        assert broken["turns"][-1]["outputs"] != trl["turns"][-1]["outputs"]


def test_match_takes_the_longest_held_prefix_and_never_cuts_an_image():
    """What is held is matched by tokens: the longest held prefix, all but the row's last token, cut before an image
    (never inside one), and refused when an image of the held turn lies past the cut (its positions would differ)
    or is not the row's own image (equal tokens, other pixels)."""
    pad = 9
    cache = turn_cache.TurnCache(image_pad_id=pad, pad_id=0)

    def held(ids, keys=None):
        n = cache.count_images(ids)
        return turn_cache.Held([], 0, [(0, len(ids))], ids, 0, n, tuple(keys or [b"k%d" % i for i in range(n)]))

    a, b = held([1, 2, 3, 4, 5]), held([1, 2, 7, 8])
    cache.held = [a, b]
    assert cache.match([1, 2, 3, 4, 5, 6, 7]) == (a, 5)  # the whole held turn, then new tokens
    assert cache.match([1, 2, 3, 4, 5]) == (a, 4)  # the last token is fed by the decode
    assert cache.match([1, 2, 7, 8, 1]) == (b, 4)
    assert cache.match([1, 2, 3, 6]) == (a, 3)  # a turn cut short: the common prefix
    assert cache.match([5, 5]) == (None, 0)
    img = held([1, pad, pad, pad, 2, 3])
    cache.held = [img]
    assert cache.count_images(img.ids) == 1
    assert cache.match([1, pad, pad, pad, 2, 3, 4], (b"k0",)) == (img, 6)
    assert cache.match([1, pad, pad, pad, 2, 3, 4], (b"other pixels",)) == (None, 0)  # same tokens, other image
    assert cache.match([1, pad, pad, 5]) == (None, 0)  # the held image lies past the cut
    two = held([1, pad, pad, 2, pad, pad])
    cache.held = [two]
    assert cache.count_images([1, pad, pad, 2, pad, pad, pad]) == 2
    assert cache.match([1, pad, pad, 2, pad, pad, pad, 3], (b"k0", b"k1")) == (None, 0)  # inside the 2nd image
