"""``python -m vlm_grpo.serve listener --model PATH ...`` (same as ``vlm-grpo-serve``)."""

from vlm_grpo.serve.cli import cli

if __name__ == "__main__":
    cli()
