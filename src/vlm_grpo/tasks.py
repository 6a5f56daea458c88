"""Task vocabulary that the data tools and the rewards both speak: placeholders and RynnBrain's tasks.

It lives below both so that neither imports the other.
"""

from __future__ import annotations

# The image placeholder of VLM-R1-style prompts.
IMAGE_TOKEN = "<image>"

# ------------------------------------------------------------------------------------------- RynnBrain
RYNNBRAIN_TASKS = ("trajectory", "affordance", "area", "counting", "segment", "general")

# Per-task system prompts (RynnBrain's inference recipe).
RYNNBRAIN_SYSTEM_PROMPTS: dict[str, str] = {
    "trajectory": "You are an embodied agent. You are given a video to solve a trajectory prediction problem.",
    "affordance": "You are an embodied agent. You are given a video to solve an affordance prediction problem.",
    "area": "You are an embodied agent. You are given a video to solve an area prediction problem.",
    "counting": "You are an embodied agent. You are given a video to solve a counting problem.",
    "segment": "You are an embodied agent. You are given a video to solve an object detection problem.",
    "general": "You are a helpful assistant. Think step by step and provide your final answer after `####`.",
}

# The output-format instruction to append to each task's question.
RYNNBRAIN_OUTPUT_FORMATS: dict[str, str] = {
    "trajectory": "Output format: `#### <answer><trajectory><frame i> (X_1, Y_1), (X_2, Y_2), ..., (X_N, Y_N) "
    "</trajectory></answer>`. Coordinates normalized to 0-1000.",
    "affordance": "Output format: `#### <answer><affordance><frame i> (X, Y)</affordance></answer>`. "
    "Coordinates normalized to 0-1000.",
    "area": "Output format: `#### <answer><area><frame i> (X_1, Y_1), (X_2, Y_2), ..., (X_N, Y_N)</area></answer>`. "
    "Coordinates normalized to 0-1000.",
    "counting": "Output format: `#### <answer><counting>N</counting></answer>`.",
    "segment": "Output format: `#### <answer><object><frame i> (X_min, Y_min), (X_max, Y_max)</object></answer>`. "
    "Coordinates normalized to 0-1000.",
    "general": "Think step by step and provide your final answer after `####`.",
}

# task_type -> the tag wrapping the answer inside <answer>…</answer> (``general`` answers are free text).
RYNNBRAIN_TASK_TAGS: dict[str, str] = {
    "trajectory": "trajectory",
    "affordance": "affordance",
    "area": "area",
    "counting": "counting",
    "segment": "object",
}
