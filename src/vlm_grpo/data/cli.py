"""``vlm-grpo-data`` / ``python -m vlm_grpo.data``: the data commands of the two-stage pipeline.

    preprocess    RynnBrain-style raw records -> GRPO rows (rl) and SFT chain-of-thought rows (cot)
    convert-vqa   VQA-X-style JSON -> VLM-R1 rows with a prompt template, <answer>/<explain> solutions
    check         validate files against the images on disk (and a model's processor); exit 1 on bad rows
    format        normalise to the canonical row format with image sizes and text_sequence_length
    merge         per-task train/ and test/ files -> train.* and test.*

Exit status: 0 on success; 1 when rows are bad, files conflict or an output would be overwritten; 2 on user
errors (a missing or unreadable file, a directory given as a file, a bad flag value), printed as
``error: <what, where, how to fix>`` without a traceback (``--debug`` shows one).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from vlm_grpo.cli_errors import run_cli
from vlm_grpo.data.jsonl import split_paths

PROG = "vlm-grpo-data"


def _paths(values: Sequence[str]) -> list[str]:
    return split_paths(list(values))


def _print_bad(bad: Sequence, limit: int = 50) -> None:
    for item in list(bad)[:limit]:
        source, reason = (item.source, f"field '{item.field}': {item.reason}") if hasattr(item, "field") else item
        print(f"  {source}: {reason}", file=sys.stderr)
    if len(bad) > limit:
        print(f"  ... and {len(bad) - limit} more", file=sys.stderr)


def _refuse_bad(bad: Sequence, skip_bad_rows: bool, noun: str) -> bool:
    """Print the bad inputs; True when they stop the command (nothing was written)."""
    if not bad:
        return False
    print(f"{'Skipped' if skip_bad_rows else 'Found'} {len(bad)} bad {noun}(s):", file=sys.stderr)
    _print_bad(bad)
    if skip_bad_rows:
        return False
    print(f"Nothing written. Fix these {noun}s or pass --skip_bad_rows.", file=sys.stderr)
    return True


# --------------------------------------------------------------------------- preprocess


def _add_preprocess(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "preprocess",
        help="raw RynnBrain-style records -> GRPO (rl) and SFT chain-of-thought (cot) rows",
        description="Convert raw multi-frame conversations (user / Thinking / assistant, frameN answers) into GRPO "
        "rows (system prompt, question, solution in the task's output format, task_type) and SFT rows "
        "(<think> from the Thinking turn + the solution). Rows of a supported format (VLM-R1, EasyR1) pass through "
        "with their solution verbatim. Output: <out>/train/<task>_<stage>_train.<fmt> and "
        "<out>/test/<task>_<stage>_test.<fmt>.",
    )
    p.add_argument(
        "--local_dataset_path", "--input", "-i", nargs="+", required=True, help="input JSON / JSONL / parquet file(s)"
    )
    p.add_argument(
        "--local_save_dir", "--output_dir", "-o", default="~/data/vlm_grpo", help="output folder (default %(default)s)"
    )
    p.add_argument(
        "--task_type",
        help="task of records without their own task_type (trajectory, affordance, area, counting, segment, "
        "general, or a package task such as vqa / rec)",
    )
    p.add_argument("--data_source", help="data_source written on each row (default: the task type)")
    p.add_argument(
        "--train_split",
        type=float,
        default=100.0,
        help="percentage of records in train; the rest go to test (default 100)",
    )
    p.add_argument("--seed", type=int, default=42, help="seed of the train/test shuffle (default 42)")
    p.add_argument("--stage", choices=["rl", "cot", "both"], default="both", help="which rows to write (default both)")
    p.add_argument("--simple", action="store_true", help="SFT rows without the Thinking turn (answer only)")
    p.add_argument(
        "--cot_layout",
        choices=["auto", "rynnbrain", "think"],
        default="auto",
        help="SFT answer layout: rynnbrain = '{Thinking}\\n#### <answer>…</answer>', think = "
        "'<think>{Thinking}</think><answer>…</answer>'; auto (default): rynnbrain for converted RynnBrain records, "
        "think for rows already in a supported format",
    )
    p.add_argument(
        "--keep_images",
        action="store_true",
        help="keep images of the Thinking turn (appended to the prompt); default: dropped",
    )
    p.add_argument("--system_prompt", help="system prompt for every row ('' for none); default: the task's")
    p.add_argument(
        "--no_format_hint", action="store_true", help="do not append the task's output-format hint to the question"
    )
    p.add_argument("--output_format", choices=["jsonl", "parquet"], default="jsonl", help="file type (default jsonl)")
    p.add_argument("--skip_bad_rows", action="store_true", help="skip bad records (counted) instead of failing")
    p.add_argument("-y", "--yes", action="store_true", help="overwrite existing output files")
    p.set_defaults(func=_run_preprocess)


def _run_preprocess(args: argparse.Namespace) -> int:
    from vlm_grpo.data.preprocess import preprocess

    result = preprocess(
        _paths(args.local_dataset_path),
        args.local_save_dir,
        task_type=args.task_type,
        data_source=args.data_source,
        train_split=args.train_split,
        seed=args.seed,
        stages=("rl", "cot") if args.stage == "both" else (args.stage,),
        simple=args.simple,
        keep_images=args.keep_images,
        system_prompt=args.system_prompt,
        format_hint=not args.no_format_hint,
        cot_layout=args.cot_layout,
        output_format=args.output_format,
        skip_bad_rows=args.skip_bad_rows,
        overwrite=args.yes,
    )
    if _refuse_bad(result.bad, args.skip_bad_rows, "record"):
        return 1
    for key, path in result.written.items():
        print(f"wrote {result.counts[key]:>7} rows  {path}")
    return 0


# --------------------------------------------------------------------------- convert-vqa


def _add_convert_vqa(sub: argparse._SubParsersAction) -> None:
    from vlm_grpo.data.convert_vqa import EXPLANATION_MODES

    p = sub.add_parser(
        "convert-vqa",
        help="VQA-X-style JSON -> VLM-R1 GRPO rows with <answer>…</answer><explain>…</explain> solutions",
        description="Convert a VQA-X-style JSON (question, answer(s), explanation(s), image name or id) into VLM-R1 "
        "rows. The prompt template's '{question}' is replaced by the question; '<image>' goes where the template "
        "puts it (front when absent). Solutions are written once, verbatim, never stripped or re-wrapped.",
    )
    p.add_argument("--input", "-i", required=True, help="VQA-X-style JSON (a list, or an object of id -> item)")
    p.add_argument("--output", "-o", required=True, help="output .jsonl / .json / .parquet")
    p.add_argument(
        "--prompt_template", help="prompt with a {question} placeholder (default: a think/answer/explain prompt)"
    )
    p.add_argument("--prompt_file", help="read the prompt template from this file")
    p.add_argument("--system_prompt", help="optional system turn for every row")
    p.add_argument(
        "--explanation",
        choices=EXPLANATION_MODES,
        default="all",
        help="several explanations: all in one row, one <explain> per reference for CIDEr (default); the first; "
        "joined into one; or one row each",
    )
    p.add_argument(
        "--image_template",
        help="image file name from image_id when items have no image_name, e.g. 'COCO_train2014_{image_id:012d}.jpg'",
    )
    p.add_argument(
        "--task_type",
        default="raw",
        help="task_type of the rows (default raw: the prompt template is the whole prompt; 'vqa' would append a "
        "think/answer instruction)",
    )
    p.add_argument("--reward_method", help="accu_reward_method of the rows (default: none)")
    p.add_argument("--skip_bad_rows", action="store_true", help="skip bad items instead of failing")
    p.add_argument("-y", "--yes", action="store_true", help="overwrite the output file")
    p.set_defaults(func=_run_convert_vqa)


def _run_convert_vqa(args: argparse.Namespace) -> int:
    from vlm_grpo.data.convert_vqa import convert_vqa, read_template

    result = convert_vqa(
        args.input,
        args.output,
        prompt_template=read_template(args.prompt_template, args.prompt_file),
        system_prompt=args.system_prompt,
        explanation_mode=args.explanation,
        image_template=args.image_template,
        task_type=args.task_type or None,
        accu_reward_method=args.reward_method,
        skip_bad_rows=args.skip_bad_rows,
        overwrite=args.yes,
    )
    if _refuse_bad(result.bad, args.skip_bad_rows, "item"):
        return 1
    print(f"wrote {len(result.rows)} rows  {result.path}")
    return 0


# --------------------------------------------------------------------------- check / format


def _add_model_flags(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument(
        "--model",
        "--model_name_or_path",
        "--tokenizer_path",
        dest="model",
        required=required,
        help="checkpoint whose processor counts tokens",
    )
    p.add_argument("--vlm_module", help="VLM module name (default: from the checkpoint's config.json model_type)")


def _add_check(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "check",
        help="validate files against images on disk (and a model's processor); exit 1 on bad rows",
        description="Validate JSONL / JSON / parquet files the way training reads them: JSON, fields, image files, "
        "<image> count = image count, known task types, coordinates within 0-1000 and, with --model, the prompt length "
        "(--max_prompt_length). Prints every bad row as file:line, image-token counts, text-length distribution and "
        "rows per task. Exit status 1 when any row is bad.",
    )
    p.add_argument("data_files", nargs="+", help="data files (':'-separated lists work too)")
    p.add_argument(
        "--image_folders",
        "--data_root",
        help="image folders, ':'-separated, one per file or one for all (default: each file's folder)",
    )
    _add_model_flags(p)
    p.add_argument(
        "--max_prompt_length", type=int, help="with --model: rows whose prompt (text + image tokens) is longer are bad"
    )
    p.add_argument("--task_type", help="task of rows without their own")
    p.add_argument(
        "--task_types", nargs="*", default=[], help="more task types to accept (e.g. ones your plugins handle)"
    )
    p.add_argument("--min_pixels", type=int)
    p.add_argument("--max_pixels", type=int)
    p.add_argument("--max_anyres_num", type=int)
    p.add_argument("--nproc", type=int, default=8, help="threads reading image headers (default 8)")
    p.add_argument("--report", help="also write the report as JSON here")
    p.add_argument("--max_report", type=int, default=50, help="bad rows printed (default 50; all go into --report)")
    p.set_defaults(func=_run_check)


def _run_check(args: argparse.Namespace) -> int:
    from vlm_grpo.data.check import check

    report = check(
        _paths(args.data_files),
        split_paths(args.image_folders),
        model=args.model,
        vlm_module=args.vlm_module,
        max_prompt_length=args.max_prompt_length,
        task_type=args.task_type,
        extra_task_types=args.task_types,
        min_pixels=args.min_pixels,
        max_pixels=args.max_pixels,
        max_anyres_num=args.max_anyres_num,
        num_threads=args.nproc,
    )
    print(report.render(args.max_report))
    if args.report:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        Path(args.report).write_text(json.dumps(report.as_dict(), indent=2, ensure_ascii=False) + "\n")
    return 0 if report.ok else 1


def _add_format(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "format",
        help="normalise rows to the canonical format with image sizes and text_sequence_length",
        description="Rewrite rows of any supported format as canonical VLM-R1 rows with absolute image paths, "
        "image_sizes ([width, height] per image, from the file headers) and text_sequence_length (tokens of the whole "
        "templated conversation, images excluded). Other fields of the rows are kept. Refuses to overwrite without -y.",
    )
    p.add_argument(
        "--ann_path", "--input", "-i", nargs="+", required=True, help="input file(s): jsonl, json or parquet"
    )
    p.add_argument(
        "--save_path", "--output", "-o", help="output .jsonl / .json / .parquet (not needed with --check / --debug)"
    )
    _add_model_flags(p, required=True)
    p.add_argument(
        "--data_root",
        "--image_folders",
        dest="image_folders",
        help="folder(s) that relative image paths are resolved against",
    )
    p.add_argument("--task_type", help="task of rows without their own")
    p.add_argument("--nproc", type=int, default=None, help="worker threads (default: CPU count)")
    p.add_argument("--skip_bad_rows", action="store_true", help="leave bad rows out instead of failing")
    p.add_argument(
        "--layout",
        choices=["vlm_r1", "chatml"],
        default="vlm_r1",
        help="vlm_r1 (default): canonical VLM-R1 rows; chatml: RynnBrain's formatted rows (ChatML 'conversation' with "
        "type/text/image/video/width/height/duration on every item, data_source, id, text_sequence_length)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="only validate the input (the report of 'vlm-grpo-data check' with this model); write nothing; exit 1 "
        "on bad rows",
    )
    p.add_argument(
        "--debug",
        dest="format_debug",
        action="store_true",
        help="format in one thread, print the first formatted row, write nothing; errors show their traceback",
    )
    p.add_argument("-y", "--yes", action="store_true", help="overwrite the output file")
    p.set_defaults(func=_run_format)


def _run_format(args: argparse.Namespace) -> int:
    from vlm_grpo.data.check import check, format_rows

    if args.check:
        report = check(
            _paths(args.ann_path),
            split_paths(args.image_folders),
            model=args.model,
            vlm_module=args.vlm_module,
            task_type=args.task_type,
            num_threads=args.nproc or os.cpu_count() or 1,
        )
        print(report.render())
        return 0 if report.ok else 1
    if not args.save_path and not args.format_debug:
        raise ValueError("--save_path is required (or pass --check / --debug to write nothing)")
    result = format_rows(
        _paths(args.ann_path),
        args.save_path,
        model=args.model,
        image_folders=split_paths(args.image_folders),
        vlm_module=args.vlm_module,
        task_type=args.task_type,
        nproc=1 if args.format_debug else args.nproc,
        overwrite=args.yes,
        skip_bad_rows=args.skip_bad_rows,
        layout=args.layout,
        write=not args.format_debug,
    )
    if _refuse_bad(result.bad, args.skip_bad_rows, "row"):
        return 1
    if args.format_debug:
        if result.rows:
            print(json.dumps(result.rows[0], ensure_ascii=False, indent=2))
        print(f"formatted {len(result.rows)} rows; --debug: nothing written")
        return 0
    print(f"wrote {len(result.rows)} rows  {result.path}")
    return 0


# --------------------------------------------------------------------------- merge


def _add_merge(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "merge",
        help="merge per-task train/ and test/ files into train.* and test.*",
        description="Merge <input_dir>/train/* into <output_dir>/train.<ext> and <input_dir>/test/* into "
        "<output_dir>/test.<ext>. The per-task files are kept. Files of different types, row formats or column types "
        "are refused with the conflicting column and files named.",
    )
    p.add_argument("--input_dir", "-i", required=True, help="folder holding train/ and test/")
    p.add_argument("--output_dir", "-o", help="where train.* / test.* go (default: --input_dir)")
    p.add_argument("--splits", nargs="+", default=["train", "test"], help="sub-folders to merge (default: train test)")
    p.add_argument("--stage", help="merge only <task>_<stage>_<split> files of this stage (rl or cot)")
    p.add_argument("-y", "--yes", action="store_true", help="overwrite existing merged files")
    p.set_defaults(func=_run_merge)


def _run_merge(args: argparse.Namespace) -> int:
    from vlm_grpo.data.merge import merge

    result = merge(args.input_dir, args.output_dir, splits=args.splits, stage=args.stage, overwrite=args.yes)
    for split, path in result.written.items():
        print(f"wrote {result.counts[split]:>7} rows  {path}  (from {len(result.inputs[split])} file(s))")
    return 0


# --------------------------------------------------------------------------- entry point


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    parser.set_defaults(format_debug=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_preprocess(sub)
    _add_convert_vqa(sub)
    _add_check(sub)
    _add_format(sub)
    _add_merge(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.debug = args.debug or args.format_debug  # format --debug (RynnBrain's format_data.py flag) shows tracebacks
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from vlm_grpo.data.merge import SchemaConflict

    try:
        return args.func(args)
    except (FileExistsError, SchemaConflict) as exc:  # nothing written: the files conflict
        if args.debug:
            raise
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:  # DataError, ImageError, missing files, permissions, bad values
        if args.debug:
            raise
        print(f"{PROG} {args.command}: error: {_user_message(exc)}", file=sys.stderr)
        return 2


def _user_message(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc)


def cli() -> None:
    """Console-script entry point."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(run_cli(main))


if __name__ == "__main__":
    cli()
