"""Other projects' spellings of our flags (``vlm_grpo.cli_aliases``), read by both recipes."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("module", ["grpo_jsonl", "sft_jsonl"])
def test_older_scripts_torch_dtype_is_trls_dtype(module, tmp_path):
    """VLM-R1's grpo_rec.py scripts and open-r1's SFT scripts pass --torch_dtype, TRL's name before ``dtype``."""
    parse = importlib.import_module(f"vlm_grpo.{module}").parse_args
    base = ["--model_name_or_path", "m", "--output_dir", str(tmp_path)]
    assert parse(base)[2].dtype != "bfloat16"  # TRL's default: the flag below changes something
    assert parse([*base, "--torch_dtype", "bfloat16"])[2].dtype == "bfloat16"
    assert parse([*base, "--torch_dtype=bfloat16"])[2].dtype == "bfloat16"
    with pytest.raises(SystemExit, match="--dtype and --torch_dtype are the same option"):
        parse([*base, "--dtype", "float32", "--torch_dtype", "bfloat16"])
