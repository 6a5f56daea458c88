"""vlm-grpo: GRPO-family RL for vision-language models, as a thin layer over TRL."""

__version__ = "0.1.0"
