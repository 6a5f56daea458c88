"""``python -m vlm_grpo.data <command>``: see :mod:`vlm_grpo.data.cli`."""

from vlm_grpo.data.cli import cli

cli()
