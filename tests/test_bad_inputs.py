"""A corpus of bad (and odd but valid) inputs, one kind per file, through ``vlm-grpo-data check`` and training.

Every kind gives a bad row naming ``file:line`` and the field, a counted skip, or is accepted; never a
traceback, never a silent change. The check and training read rows through the same code (``read_rows`` and
``validate_rows``); the check adds a full decode of every image, which training does at draw time (a row
whose image fails there is a counted skip). Training is run for real (one GRPO step on the tiny model) on
the whole corpus with ``--skip_bad_rows``.
"""

from __future__ import annotations

import base64
import io
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlm_grpo.data import DataValidationError
from vlm_grpo.data.cli import main as data_main
from vlm_grpo.data.formats import DataError
from vlm_grpo.data.records import read_any_rows

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_PROMPT_LENGTH = 300
CHECK_ONLY = {"truncated_png"}  # found by the check's full decode; training skips it when drawn


def _row(question: str = "<image>What colour is it?", image=("ok.png",), solution: str = "<answer>red</answer>"):
    row = {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": solution}]}
    if image is not None:
        row["image"] = list(image)
    return row


def _png(path: Path, size=(64, 64), mode="RGB", color=(200, 30, 30)) -> Path:
    Image.new(mode, size, color).save(path)
    return path


def _uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _build_images(images: Path) -> None:
    images.mkdir()
    _png(images / "ok.png")
    _png(images / "ok2.png", color=(30, 30, 200))
    (images / "zero.png").write_bytes(b"")
    full = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(full, "PNG")
    (images / "truncated.png").write_bytes(full.getvalue()[: len(full.getvalue()) // 2])
    (images / "text.png").write_text("this is not a picture\n")
    (images / "folder.png").mkdir()
    Image.new("1", (12000, 12000), 1).save(images / "huge.png")  # a few KB on disk, 144 MP decoded
    _png(images / "aspect.png", size=(6000, 28))  # aspect ratio 214: the Qwen processor refuses it
    _png(images / "tiny.png", size=(1, 1))
    Image.fromarray((np.arange(64 * 64).reshape(64, 64) * 16).astype(np.uint16)).save(images / "grey16.png")
    _png(images / "rgba.png", mode="RGBA", color=(255, 0, 0, 0))
    _png(images / "la.png", mode="LA", color=(0, 128))
    palette = Image.new("P", (64, 64), 0)
    palette.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    palette.save(images / "palette.png", transparency=0)
    _png(images / "cmyk.jpg", mode="CMYK", color=(0, 255, 255, 0))
    _png(images / "bilevel.png", mode="1", color=1)
    frames = [Image.new("P", (64, 64), i) for i in range(3)]
    frames[0].save(images / "anim.gif", save_all=True, append_images=frames[1:], duration=50)
    Image.fromarray(np.full((64, 64), 40000, dtype=np.uint16)).save(images / "grey16.tif")


# kind -> (file content as lines (str rows are JSON-dumped), expected (field, reason words) or None if accepted)
def _kinds(images: Path) -> dict[str, tuple[list, tuple[str, str] | None]]:
    small_png = io.BytesIO()
    Image.new("RGB", (32, 32), (0, 200, 0)).save(small_png, "PNG")
    long_question = "<image>" + " ".join(["describe the picture in great detail"] * 150)
    return {
        # accepted
        "good": ([_row()], None),
        "blank_lines": (["", _row(), "   ", ""], None),
        "bom": ([b"\xef\xbb\xbf" + json.dumps(_row()).encode()], None),
        "crlf": ([json.dumps(_row()) + "\r"], None),
        "tiny_image": ([_row(image=["tiny.png"])], None),
        "grey_16bit": ([_row(image=["grey16.png"])], None),
        "grey_16bit_tiff": ([_row(image=["grey16.tif"])], None),
        "rgba": ([_row(image=["rgba.png"])], None),
        "grey_alpha": ([_row(image=["la.png"])], None),
        "palette_transparency": ([_row(image=["palette.png"])], None),
        "cmyk_jpeg": ([_row(image=["cmyk.jpg"])], None),
        "bilevel": ([_row(image=["bilevel.png"])], None),
        "animated_gif": ([_row(image=["anim.gif"])], None),
        "data_uri": ([_row(image=[_uri(small_png.getvalue())])], None),
        "text_only": ([_row(question="What is 2 + 2?", image=None, solution="<answer>4</answer>")], None),
        "absolute_path": ([_row(image=[str(images / "ok2.png")])], None),
        "duplicates": ([_row("<image>Which colour, twice?"), _row("<image>Which colour, twice?")], None),
        "easyr1": ([{"problem": "<image>Colour?", "answer": "red", "images": ["ok.png"]}], None),
        "no_marker_images_first": ([_row(question="What colour?")], None),  # VLM-R1 puts the images first
        # bad rows
        "malformed_json": (['{"conversations": [{"from": "human"'], ("<json>", "bad JSON")),
        "empty_file": ([], ("<file>", "holds no rows")),
        "only_blank_lines": (["", "  ", ""], ("<file>", "holds no rows")),
        "non_utf8": ([b'{"conversations": [{"from": "human", "value": "caf\xe9"}]}'], ("<encoding>", "UTF-8")),
        "row_is_list": ([[_row()]], ("<row>", "JSON object, got list")),
        "row_is_number": ([42], ("<row>", "JSON object, got int")),
        "unknown_format": ([{"image": "ok.png", "question": "?"}], ("conversations", "unknown row format")),
        "no_solution_turn": (
            [{"image": "ok.png", "conversations": [{"from": "human", "value": "<image>?"}]}],
            ("conversations", "no 'gpt' turn"),
        ),
        "turn_value_not_string": (
            [{"conversations": [{"from": "human", "value": 5}, {"from": "gpt", "value": "a"}]}],
            ("conversations[0].value", "must be a string"),
        ),
        "image_wrong_type": ([{**_row(), "image": 5}], ("image", "expected a path")),
        "conversations_null": ([{"conversations": None}], ("conversations", "missing field")),
        "easyr1_no_answer": ([{"problem": "<image>?", "images": ["ok.png"]}], ("answer", "missing field")),
        "empty_solution": ([_row(solution="  ")], ("solution", "empty solution")),
        "too_many_placeholders": ([_row(question="<image><image>Same?")], ("image", "2 '<image>' placeholder")),
        "missing_image": ([_row(image=["nope.png"])], ("image", "not found")),
        "zero_byte_image": ([_row(image=["zero.png"])], ("image", "0 bytes")),
        "truncated_png": ([_row(image=["truncated.png"])], ("image", "truncated")),
        "not_an_image": ([_row(image=["text.png"])], ("image", "not an image")),
        "image_is_directory": ([_row(image=["folder.png"])], ("image", "is a directory")),
        "path_traversal": ([_row(image=["../../../../../../../../etc/passwd"])], ("image", "not an image")),
        "huge_image": ([_row(image=["huge.png"])], ("image", "12000x12000")),
        "aspect_ratio": ([_row(image=["aspect.png"])], ("image", "aspect ratio")),
        "bad_base64": ([_row(image=["data:image/png;base64,@@not base64@@"])], ("image", "bad base64")),
        "data_uri_not_base64": ([_row(image=["data:image/png,abc"])], ("image", "not base64")),
        "over_long_prompt": ([_row(question=long_question)], ("prompt", f"--max_prompt_length {MAX_PROMPT_LENGTH}")),
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_inputs")
    images = root / "images"
    _build_images(images)
    files = {}
    for kind, (lines, expected) in _kinds(images).items():
        path = root / f"{kind}.jsonl"
        with open(path, "wb") as handle:
            for line in lines:  # bytes and str are written as they are, anything else as JSON
                raw = line if isinstance(line, bytes) else line.encode() if isinstance(line, str) else None
                handle.write((raw if raw is not None else json.dumps(line).encode()) + b"\n")
        files[kind] = (path, expected)
    return root, images, files


def _expected_line(path: Path) -> int:
    """The line of the one bad row: the first non-blank line."""
    lines = path.read_bytes().split(b"\n")
    return next((i for i, line in enumerate(lines, start=1) if line.strip()), 0)


def _source(path: Path, field: str) -> str:
    return str(path) if field == "<file>" else f"{path}:{_expected_line(path)}"


def test_corpus_has_at_least_35_kinds(corpus):
    _, _, files = corpus
    assert len(files) >= 35
    assert sum(expected is not None for _, expected in files.values()) >= 25


def test_check_names_every_bad_row_and_accepts_the_rest(corpus, tiny_models, tmp_path, capsys):
    _, images, files = corpus
    report_path = tmp_path / "report.json"
    argv = ["check", *(str(p) for p, _ in files.values()), "--image_folders", str(images)]
    argv += ["--model", str(tiny_models["qwen2_5_vl"]), "--max_prompt_length", str(MAX_PROMPT_LENGTH)]
    assert data_main([*argv, "--report", str(report_path)]) == 1
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    report = json.loads(report_path.read_text())
    bad = {b["source"]: b for b in report["bad"]}
    for kind, (path, expected) in files.items():
        mine = [b for source, b in bad.items() if source == str(path) or source.startswith(f"{path}:")]
        if expected is None:
            assert mine == [], f"{kind} should be accepted: {mine}"
            continue
        field, words = expected
        assert len(mine) == 1, f"{kind}: expected one bad row, got {mine}"
        assert mine[0]["source"] == _source(path, field), kind
        assert mine[0]["field"] == field and words in mine[0]["reason"], (kind, mine[0])
    accepted = sum(len([1 for line in p.read_bytes().split(b"\n") if line.strip()]) for p, e in files.values() if not e)
    assert report["good_rows"] == accepted
    dup = files["duplicates"][0]
    assert {"source": f"{dup}:2", "repeats": f"{dup}:1"} in report["duplicates"]
    assert f"{dup}:2 repeats {dup}:1" in out.out


WHOLE_FILE = {
    "directory": "is a directory",
    "missing": "not found",
    "unsupported": "unsupported file type",
    "corrupt_parquet": "not a readable parquet file",
}


@pytest.mark.parametrize("kind", sorted(WHOLE_FILE))
def test_whole_file_problems_are_an_error_naming_the_file(kind, corpus, capsys):
    root, images, _ = corpus
    path = {
        "directory": images,
        "missing": root / "absent.jsonl",
        "unsupported": root / "rows.txt",
        "corrupt_parquet": root / "rows.parquet",
    }[kind]
    if kind == "unsupported":
        path.write_text("{}\n")
    if kind == "corrupt_parquet":
        path.write_bytes(b"PAR1 but not really")
    assert data_main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vlm-grpo-data check: error: ") and str(path) in err and "Traceback" not in err
    words = WHOLE_FILE[kind]
    assert words in err
    with pytest.raises(DataError, match=words):  # what training's loader raises (its CLI prints `error:`)
        read_any_rows([str(path)])


@pytest.mark.parametrize("command", [["check"], ["format", "--check", "--ann_path"]])
def test_a_local_model_path_that_is_not_there_is_named(command, corpus, tmp_path, capsys):
    """Not the Hub's "Repo id must use alphanumeric chars" about a path the user meant as a folder."""
    root, _, _ = corpus
    rows = root / "one.jsonl"
    rows.write_text(
        '{"image": "a.png", "conversations": [{"from": "human", "value": "<image>q"}, {"from": "gpt", "value": "a"}]}\n'
    )
    missing = str(tmp_path / "no_model")
    assert data_main([*command, str(rows), "--model", missing]) == 2
    err = capsys.readouterr().err
    assert f"error: --model {missing}: no such folder" in err and "Traceback" not in err


def _script_args(files, images, skip: bool):
    from vlm_grpo.configs import GRPOScriptArguments

    return GRPOScriptArguments(
        data_file_paths=":".join(str(p) for p, _ in files.values()),
        image_folders=str(images),
        max_prompt_length=MAX_PROMPT_LENGTH,
        skip_bad_rows=skip,
    )


def test_training_loader_finds_the_same_bad_rows_as_the_check(corpus, tiny_models):
    """recipe.load_checked_rows (what grpo_jsonl / sft_jsonl call) on the whole corpus: without skipping, one
    error listing every bad row the check found except the check-only full decode; with skipping, those are the
    rows left out."""
    from vlm_grpo.data.check import load_module_and_processor
    from vlm_grpo.recipe import load_checked_rows

    _, images, files = corpus
    module, processor = load_module_and_processor(str(tiny_models["qwen2_5_vl"]))
    expected = {_source(path, e[0]) for kind, (path, e) in files.items() if e is not None and kind not in CHECK_ONLY}
    with pytest.raises(DataValidationError) as failure:
        load_checked_rows(_script_args(files, images, skip=False), module, processor)
    assert {b.source for b in failure.value.bad_rows} == expected
    assert f"Found {len(expected)} bad row(s)" in str(failure.value)
    kept = load_checked_rows(_script_args(files, images, skip=True), module, processor)
    kept_files = {Path(r["source"].rpartition(":")[0]).stem for r in kept}
    assert kept_files == {k for k, (_, e) in files.items() if e is None} | CHECK_ONLY


def test_one_training_step_on_the_whole_corpus_skips_and_counts(corpus, tiny_models, tmp_path, caplog):
    """A real GRPO step with --skip_bad_rows on every file of the corpus: bad rows are counted and skipped up
    front; the truncated PNG (whose header reads fine) is skipped when drawn, with a warning naming it."""
    from vlm_grpo.grpo_jsonl import main, parse_args

    _, images, files = corpus
    n_bad = sum(1 for kind, (_, e) in files.items() if e is not None and kind not in CHECK_ONLY)
    n_kept = sum(len([1 for line in p.read_bytes().split(b"\n") if line.strip()]) for p, e in files.values() if not e)
    n_kept += len(CHECK_ONLY)
    argv = [
        "--model_name_or_path", str(tiny_models["qwen2_5_vl"]),
        "--data_file_paths", ":".join(str(p) for p, _ in files.values()),
        "--image_folders", str(images),
        "--skip_bad_rows", "true",
        "--max_prompt_length", str(MAX_PROMPT_LENGTH),
        "--reward_funcs", "format",
        "--output_dir", str(tmp_path / "out"),
        "--max_steps", "1",
        "--per_device_train_batch_size", str(2 * n_kept),  # every kept row is drawn in the one step
        "--num_generations", "2",
        "--max_completion_length", "4",
        "--gradient_checkpointing", "false",
        "--save_strategy", "no",
        "--report_to", "none",
        "--seed", "3",
        "--dataloader_num_workers", "0",
    ]  # fmt: skip
    with caplog.at_level(logging.WARNING):
        trainer = main(*parse_args(argv))
    assert trainer.state.global_step == 1
    assert f"Skipped {n_bad} bad row(s) out of" in caplog.text
    truncated = files["truncated_png"][0]
    assert f"Skipped {truncated}:1: image data is damaged or truncated" in caplog.text
    assert "1 row(s) skipped so far" in caplog.text
