"""The Lewis-game speaker's format reward as its seed defines it: all of <thinking>, <coarse>, <detailed> present
and closed. The strict layout stays available as format_speaker_strict."""

from __future__ import annotations

import pytest

from vlm_grpo.rewards import REWARDS, build_reward_funcs

SEED_CASES = [
    ("<thinking>r</thinking>\n<coarse>A dog</coarse>\n<detailed>A brown dog.</detailed>", 1.0, 1.0),
    ("<coarse>A dog</coarse><thinking>r</thinking><detailed>x</detailed>", 1.0, 0.0),  # reordered
    ("Sure! <thinking>r</thinking><coarse>A dog</coarse><detailed>x</detailed> Done.", 1.0, 0.0),  # text around
    ("<thinking>r</thinking><coarse>a</coarse><coarse>b</coarse><detailed>x</detailed>", 1.0, 0.0),  # repeated
    ("<thinking>r</thinking><coarse>A dog</coarse>", 0.0, 0.0),  # detailed missing
    ("<thinking>r</thinking><coarse>A dog<detailed>x</detailed>", 0.0, 0.0),  # coarse not closed
    ("</coarse>x<coarse><thinking>r</thinking><detailed>x</detailed>", 0.0, 0.0),  # closed before it opens
    ("<think>r</think><coarse>A dog</coarse><detailed>x</detailed>", 0.0, 0.0),  # wrong tag name
    ("<THINKING>r</THINKING><coarse>A dog</coarse><detailed>x</detailed>", 0.0, 0.0),  # the seed's tags are lower case
    ("", 0.0, 0.0),
]


@pytest.mark.parametrize(("completion", "seed", "strict"), SEED_CASES)
def test_format_speaker_is_the_seeds_and_strict_stays_strict(completion, seed, strict):
    lenient, strict_reward = build_reward_funcs(["format_speaker", "format_speaker_strict"])
    assert lenient([completion]) == [seed]
    assert strict_reward([completion]) == [strict]
    # chat-style completions are read the same way
    assert lenient([[{"role": "assistant", "content": completion}]]) == [seed]


def test_the_lewis_preset_uses_the_seeds_format():
    from vlm_grpo.rewards.catalog import SEED_ALIASES

    assert SEED_ALIASES["lewis"]["format"] == "format_speaker"
    assert {"format_speaker", "format_speaker_strict"} <= set(REWARDS.names())
