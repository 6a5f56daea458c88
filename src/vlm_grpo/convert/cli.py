"""``vlm-grpo-convert``: checkpoint layout conversions.

vlm-grpo-convert internvl-chat SRC DST          # original InternVL / Vintern (remote code) -> transformers
vlm-grpo-convert to-internvl-chat SRC DST --code_from ORIGINAL   # and back, after training
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from vlm_grpo.convert.internvl_chat import ConversionError, convert_internvl_chat, export_internvl_chat


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlm-grpo-convert", description="Convert checkpoint layouts.")
    sub = parser.add_subparsers(dest="command", required=True)
    forward = sub.add_parser(
        "internvl-chat",
        help="original InternVL / Vintern checkpoint (model_type internvl_chat) -> transformers internvl layout",
    )
    forward.add_argument("src", help="local folder of the original checkpoint (config.json, weights, tokenizer)")
    forward.add_argument("dst", help="output folder: pass it as --model_name_or_path")
    back = sub.add_parser(
        "to-internvl-chat", help="transformers internvl checkpoint (a trained one) -> original internvl_chat layout"
    )
    back.add_argument("src", help="transformers internvl checkpoint folder (a full or merged-LoRA output_dir)")
    back.add_argument("dst", help="output folder")
    back.add_argument("--code_from", help="the original checkpoint folder: its remote-code *.py files are copied")
    for p in (forward, back):
        p.add_argument("-y", "--yes", action="store_true", help="write into a non-empty DST")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "internvl-chat":
            out = convert_internvl_chat(args.src, args.dst, overwrite=args.yes)
            print(f"converted {args.src} -> {out}; train it with --model_name_or_path {out}")
        else:
            out = export_internvl_chat(args.src, args.dst, code_from=args.code_from, overwrite=args.yes)
            print(f"wrote {out} in the internvl_chat layout")
    except (ConversionError, FileNotFoundError, OSError) as exc:
        print(f"vlm-grpo-convert: error: {exc}", file=sys.stderr)
        return 1
    return 0


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
