"""Merge a LoRA adapter into its base model: a plain Hugging Face model folder.

    vlm-grpo-merge-lora --adapter runs/grpo_lora --output_dir runs/grpo_merged [--base_model PATH] [--dtype bfloat16]
    python -m vlm_grpo.merge_lora ...

The base comes from ``--base_model`` or the adapter's ``adapter_config.json``; the model is loaded through
the family's VLM module. The output folder holds the merged weights, ``config.json``, the generation config
of the base (and the processor: the adapter folder's when it has one, else the base's), so it loads with
``from_pretrained`` and gives the adapter model's greedy outputs.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlm_grpo.cli_errors import USER_ERROR_EXIT, run_cli

logger = logging.getLogger("vlm_grpo")

_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "tokenizer_config.json")


def is_adapter(path: str | Path) -> bool:
    return (Path(path) / "adapter_config.json").is_file()


def adapter_base(adapter: str | Path, base_model: str | None = None) -> str:
    """The base model of an adapter: ``base_model`` if given, else the one its ``adapter_config.json`` names."""
    if base_model:
        return base_model
    config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{adapter}/adapter_config.json names no base model; pass --base_model PATH")
    return base


def processor_source(adapter: str | Path, base: str) -> str:
    """Where the processor is read from: the adapter folder when training saved one there, else the base."""
    return str(adapter) if any((Path(adapter) / f).is_file() for f in _PROCESSOR_FILES) else base


def load_model_and_processor(
    path: str,
    *,
    base_model: str | None = None,
    vlm_module: str | None = None,
    dtype: str | None = None,
    limits: Any = None,
    trust_remote_code: bool = False,
) -> tuple[Any, Any, Any]:
    """(model, processor, module) of a full checkpoint or of a LoRA adapter (wrapped in ``PeftModel``)."""
    from vlm_grpo.modules import get_vlm_module

    base = adapter_base(path, base_model) if is_adapter(path) else path
    module = get_vlm_module(base, vlm_module, limits)
    model = module.load_model(base, dtype=dtype, trust_remote_code=trust_remote_code)
    if is_adapter(path):
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, path)
        processor = module.load_processor(processor_source(path, base), trust_remote_code=trust_remote_code)
    else:
        processor = module.load_processor(path, trust_remote_code=trust_remote_code)
    model.eval()
    return model, processor, module


def save_merged(peft_model: Any, processor: Any, output_dir: str | Path, base: str | None = None) -> Path:
    """Merge the adapter into the weights and write a plain model folder (weights, config, generation config,
    processor). ``base``: a local base folder whose ``generation_config.json`` is copied verbatim."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(output_dir)
    processor.save_pretrained(output_dir)
    if base and (Path(base) / "generation_config.json").is_file():
        shutil.copyfile(Path(base) / "generation_config.json", output_dir / "generation_config.json")
    return output_dir


def merge_lora(
    adapter: str | Path,
    output_dir: str | Path,
    *,
    base_model: str | None = None,
    vlm_module: str | None = None,
    dtype: str | None = None,
    overwrite: bool = False,
) -> Path:
    adapter = Path(adapter)
    if not is_adapter(adapter):
        raise FileNotFoundError(f"{adapter} holds no adapter_config.json: not a LoRA adapter folder")
    output_dir = Path(output_dir)
    if output_dir.exists() and any(output_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"Refusing to write into non-empty {output_dir} (pass -y / --yes to overwrite)")
    base = adapter_base(adapter, base_model)
    model, processor, _ = load_model_and_processor(str(adapter), base_model=base, vlm_module=vlm_module, dtype=dtype)
    return save_merged(model, processor, output_dir, base)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vlm-grpo-merge-lora",
        description="Merge a LoRA adapter into its base model and save a plain Hugging Face model folder "
        "(weights, config, generation config, processor).",
    )
    parser.add_argument("--adapter", "--lora_path", required=True, help="adapter folder (has adapter_config.json)")
    parser.add_argument("--output_dir", "--target_dir", required=True, help="where the merged model goes")
    parser.add_argument("--base_model", help="base model (default: base_model_name_or_path of adapter_config.json)")
    parser.add_argument("--vlm_module", help="VLM module name (default: from the base's config.json model_type)")
    parser.add_argument("--dtype", default=None, help="load (and save) dtype, e.g. bfloat16 (default: the base's)")
    parser.add_argument("-y", "--yes", action="store_true", help="write into a non-empty output_dir")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        out = merge_lora(
            args.adapter,
            args.output_dir,
            base_model=args.base_model,
            vlm_module=args.vlm_module,
            dtype=args.dtype,
            overwrite=args.yes,
        )
    except (FileExistsError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USER_ERROR_EXIT
    print(f"merged model written to {out}")
    return 0


def cli() -> None:
    sys.exit(run_cli(main))


if __name__ == "__main__":
    cli()
