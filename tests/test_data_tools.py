"""Data commands: preprocess / convert-vqa goldens, check (every kind of bad row, file:line, exit 1), format, merge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from vlm_grpo.data import read_rows
from vlm_grpo.data.cli import main as data_main
from vlm_grpo.data.records import iter_records, read_any_rows, write_rows
from vlm_grpo.tasks import RYNNBRAIN_OUTPUT_FORMATS as OUTPUT_FORMATS

DEMO = Path(__file__).resolve().parents[1] / "data" / "demo"

SYSTEM = {
    "trajectory": "You are an embodied agent. You are given a video to solve a trajectory prediction problem.",
    "affordance": "You are an embodied agent. You are given a video to solve an affordance prediction problem.",
    "area": "You are an embodied agent. You are given a video to solve an area prediction problem.",
    "counting": "You are an embodied agent. You are given a video to solve a counting problem.",
    "segment": "You are an embodied agent. You are given a video to solve an object detection problem.",
    "general": "You are a helpful assistant. Think step by step and provide your final answer after `####`.",
}
# The output-format hints belong to the RynnBrain rewards (one definition for data and rewards).
HINT = OUTPUT_FORMATS


def _img(path: Path, size=(64, 48), color=(200, 10, 10)) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return str(path)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _row(rid, images, system, question, answer, task, source=None, **extra):
    conversations = ([{"from": "system", "value": system}] if system else []) + [
        {"from": "human", "value": question},
        {"from": "gpt", "value": answer},
    ]
    row = {"id": rid, "image": images, "conversations": conversations, "task_type": task}
    row.update(extra)
    row["data_source"] = source or task
    return row


# ----------------------------------------------------------------------------------------------- preprocess
# Hand-written raw records, one file per task type, as RynnBrain users have them.
RAW = {
    # multi-frame (three frames of a video, with sizes), Thinking turn, float coordinates, id given
    "trajectory": """\
{"id": "traj-1", "conversation": [
  {"role": "user", "content": [
    {"type": "image", "image": "/data/v1/001.jpg", "width": 1920, "height": 1080},
    {"type": "image", "image": "/data/v1/002.jpg", "width": 1920, "height": 1080},
    {"type": "image", "image": "/data/v1/003.jpg", "width": 1920, "height": 1080},
    {"type": "text", "text": "Track the robot arm and predict its trajectory to grasp the red cube. "}]},
  {"role": "Thinking", "content": [{"type": "text", "text": "The arm moves from left to right."}]},
  {"role": "assistant", "content": [{"frame3": [[450, 320], [480, 350], [520.5, 400]]}]}]}
""",
    # single image, no Thinking turn (SFT rows with --simple)
    "affordance": """\
{"conversation": [
  {"role": "user", "content": [{"type": "image", "image": "scene.jpg"},
                               {"type": "text", "text": "Where should I click to pick up the apple?"}]},
  {"role": "assistant", "content": [{"frame1": [[325, 480]]}]}]}
""",
    # a video item listing its frames; the record's own task_type
    "area": """\
{"task_type": "area", "conversation": [
  {"role": "user", "content": [{"type": "text", "text": "Frames:"}, {"type": "video", "video": ["f1.png", "f2.png"]},
                               {"type": "text", "text": "Where can the cup be placed?"}]},
  {"role": "Thinking", "content": [{"type": "text", "text": "The table is free on the right."}]},
  {"role": "assistant", "content": [{"frame2": [[10, 20], [30, 40], [50, 60]]}]}]}
""",
    # text answer with a number; the question already states the output format (no hint added)
    "counting": """\
{"conversation": [
  {"role": "user", "content": [{"type": "image", "image": "a.jpg"}, {"type": "image", "image": "b.jpg"},
    {"type": "text", "text": "How many chairs? Output format: #### <answer><counting>N</counting></answer>"}]},
  {"role": "Thinking", "content": [{"type": "text", "text": "Two chairs in a, one more in b."}]},
  {"role": "assistant", "content": [{"type": "text", "text": "3"}]}]}
""",
    # a box written as one 4-number entry; alias 'segmentation'; a system turn of its own
    "segment": """\
{"task_type": "segmentation", "conversation": [
  {"role": "system", "content": [{"type": "text", "text": "Detect objects."}]},
  {"role": "user", "content": [{"type": "image", "image": "k.jpg"}, {"type": "text", "text": "Find the knife."}]},
  {"role": "Thinking", "content": [{"type": "text", "text": "The knife is on the board."}]},
  {"role": "assistant", "content": [{"frame1": [[100, 200, 300, 400]]}]}]}
""",
    # free-form answer, text only
    "general": """\
{"conversation": [
  {"role": "user", "content": [{"type": "text", "text": "What colour is the sky on a clear day?"}]},
  {"role": "Thinking", "content": [{"type": "text", "text": "Clear daytime sky scatters blue light."}]},
  {"role": "assistant", "content": [{"type": "text", "text": "Blue."}]}]}
""",
}
EXPECTED_RL = {
    "trajectory": _row(
        "traj-1",
        ["/data/v1/001.jpg", "/data/v1/002.jpg", "/data/v1/003.jpg"],
        SYSTEM["trajectory"],
        "<image><image><image>Track the robot arm and predict its trajectory to grasp the red cube.\n"
        + HINT["trajectory"],
        "<answer><trajectory><frame 3> (450, 320), (480, 350), (520.5, 400)</trajectory></answer>",
        "trajectory",
    ),
    "affordance": _row(
        "affordance-0",
        ["scene.jpg"],
        SYSTEM["affordance"],
        "<image>Where should I click to pick up the apple?\n" + HINT["affordance"],
        "<answer><affordance><frame 1> (325, 480)</affordance></answer>",
        "affordance",
    ),
    "area": _row(
        "area-0",
        ["f1.png", "f2.png"],
        SYSTEM["area"],
        "Frames:<image><image>Where can the cup be placed?\n" + HINT["area"],
        "<answer><area><frame 2> (10, 20), (30, 40), (50, 60)</area></answer>",
        "area",
    ),
    "counting": _row(
        "counting-0",
        ["a.jpg", "b.jpg"],
        SYSTEM["counting"],
        "<image><image>How many chairs? Output format: #### <answer><counting>N</counting></answer>",
        "<answer><counting>3</counting></answer>",
        "counting",
    ),
    "segment": _row(
        "segment-0",
        ["k.jpg"],
        "Detect objects.",
        "<image>Find the knife.\n" + HINT["segment"],
        "<answer><object><frame 1> (100, 200), (300, 400)</object></answer>",
        "segment",
    ),
    "general": _row(
        "general-0",
        [],
        SYSTEM["general"],
        "What colour is the sky on a clear day?\n" + HINT["general"],
        "<answer>Blue.</answer>",
        "general",
    ),
}
THINKING = {
    "trajectory": "The arm moves from left to right.",
    "area": "The table is free on the right.",
    "counting": "Two chairs in a, one more in b.",
    "segment": "The knife is on the board.",
    "general": "Clear daytime sky scatters blue light.",
}


def _cot(task: str) -> dict:
    row = json.loads(json.dumps(EXPECTED_RL[task]))
    solution = row["conversations"][-1]["value"]
    thinking = THINKING.get(task)
    row["conversations"][-1]["value"] = f"{thinking}\n#### {solution}" if thinking else f"#### {solution}"
    return row


@pytest.mark.parametrize("task", list(RAW))
def test_preprocess_golden_rows_per_task(task, tmp_path):
    raw = tmp_path / f"{task}.jsonl"
    raw.write_text(" ".join(RAW[task].split("\n")).strip() + "\n")  # one record per line
    out = tmp_path / "out"
    argv = ["preprocess", "-i", str(raw), "-o", str(out), "--task_type", task]
    if task == "affordance":
        argv.append("--simple")
    assert data_main(argv) == 0
    assert _rows(out / "train" / f"{task}_rl_train.jsonl") == [EXPECTED_RL[task]]
    assert _rows(out / "train" / f"{task}_cot_train.jsonl") == [_cot(task)]
    assert not (out / "test").exists()  # --train_split 100


@pytest.mark.parametrize("task", list(RAW))
def test_preprocessed_rows_fit_the_rynnbrain_rewards(task):
    """The SFT targets have the layout format_rynnbrain rewards; the solutions parse as the rewards read them."""
    from vlm_grpo.data.preprocess import TASK_TAGS
    from vlm_grpo.rewards.format import rynnbrain_format_score
    from vlm_grpo.rewards.rynnbrain import parse_counting_solution, parse_solution

    assert rynnbrain_format_score(_cot(task)["conversations"][-1]["value"], task) == 1.0
    solution = EXPECTED_RL[task]["conversations"][-1]["value"]
    if task == "counting":
        assert parse_counting_solution(solution) == 3
    elif TASK_TAGS[task]:
        parsed = parse_solution(solution, TASK_TAGS[task])
        assert parsed.frame is not None and parsed.points


def test_preprocess_reads_a_json_list_and_writes_parquet_that_reads_back(tmp_path):
    records = [json.loads(" ".join(RAW[t].split("\n"))) for t in ("trajectory", "general")]
    for record, task in zip(records, ("trajectory", "general"), strict=True):
        record["task_type"] = task
    raw = tmp_path / "raw.json"
    raw.write_text(json.dumps(records, indent=2))
    out = tmp_path / "out"
    assert data_main(["preprocess", "-i", str(raw), "-o", str(out), "--output_format", "parquet", "--stage", "rl"]) == 0
    assert not list(out.rglob("*_cot_*"))
    parquet = out / "train" / "trajectory_rl_train.parquet"
    _, bad = read_any_rows([str(parquet)])  # training reads it; its frames do not exist on this machine
    assert [(b.source, b.field) for b in bad] == [(f"{parquet}:1", "image")]
    back = [r.value for r in iter_records(out / "train" / "general_rl_train.parquet")]
    assert back == [{**EXPECTED_RL["general"], "id": "general-1"}]  # default ids count records of the input


def test_preprocess_split_is_seeded_and_shared_by_both_stages(tmp_path):
    lines = []
    for i in range(10):
        record = json.loads(" ".join(RAW["general"].split("\n")))
        record["id"] = f"g{i}"
        lines.append(json.dumps(record))
    raw = tmp_path / "raw.jsonl"
    raw.write_text("\n".join(lines) + "\n")

    def split(out, seed):
        argv = ["preprocess", "-i", str(raw), "-o", str(out), "--task_type", "general", "--train_split", "70"]
        assert data_main([*argv, "--seed", str(seed)]) == 0
        ids = {}
        for part in ("train", "test"):
            for stage in ("rl", "cot"):
                ids[part, stage] = [r["id"] for r in _rows(out / part / f"general_{stage}_{part}.jsonl")]
        return ids

    a, b, c = split(tmp_path / "a", 1), split(tmp_path / "b", 1), split(tmp_path / "c", 2)
    assert a == b
    assert len(a["train", "rl"]) == 7 and len(a["test", "rl"]) == 3
    assert a["train", "rl"] == a["train", "cot"] and a["test", "rl"] == a["test", "cot"]
    assert sorted(a["train", "rl"] + a["test", "rl"]) == sorted(f"g{i}" for i in range(10))
    assert a["train", "rl"] == sorted(a["train", "rl"], key=lambda i: int(i[1:]))  # file order kept
    assert c["test", "rl"] != a["test", "rl"]
    # an existing output is not overwritten without -y
    assert data_main(["preprocess", "-i", str(raw), "-o", str(tmp_path / "a"), "--task_type", "general"]) == 1


def test_preprocess_reports_bad_records_with_file_line_and_writes_nothing(tmp_path, capsys):
    good = " ".join(RAW["trajectory"].split("\n"))
    outside = good.replace("[520.5, 400]", "[1200, 400]")
    no_thinking = " ".join(RAW["affordance"].split("\n"))
    raw = tmp_path / "raw.jsonl"
    two_frames = good.replace('[{"frame3"', '[{"frame1": [[1, 2]]}, {"frame3"')
    lines = [good, "{broken", outside, no_thinking, '{"conversation": [], "task_type": "dance"}', two_frames]
    raw.write_text("\n".join(lines))
    out = tmp_path / "out"
    assert data_main(["preprocess", "-i", str(raw), "-o", str(out), "--task_type", "trajectory"]) == 1
    err = capsys.readouterr().err
    assert f"{raw}:2: bad JSON" in err
    assert f"{raw}:3: field 'assistant': 1 coordinate(s) outside 0-1000: (1200, 400)" in err
    assert f"{raw}:4: field 'Thinking'" in err and "--simple" in err
    assert f"{raw}:5: field 'task_type': unknown task type 'dance'" in err
    assert f"{raw}:6: field 'assistant': the answer lists 2 frames (frame1, frame3)" in err
    assert not out.exists()
    # skipped on request: the good record is written
    assert (
        data_main(["preprocess", "-i", str(raw), "-o", str(out), "--task_type", "trajectory", "--skip_bad_rows"]) == 0
    )
    assert [r["id"] for r in _rows(out / "train" / "trajectory_rl_train.jsonl")] == ["traj-1"]


def test_preprocess_passes_supported_rows_through_verbatim(tmp_path):
    out = tmp_path / "out"
    assert data_main(["preprocess", "-i", str(DEMO / "train.jsonl"), "-o", str(out), "--simple"]) == 0
    demo = _rows(DEMO / "train.jsonl")
    counting = _rows(out / "train" / "counting_rl_train.jsonl")
    assert len(counting) + len(_rows(out / "train" / "rec_rl_train.jsonl")) == len(demo)
    first = next(r for r in demo if r["task_type"] == "counting")
    images = first["image"] if isinstance(first["image"], list) else [first["image"]]
    expected = {**first, "image": images, "data_source": "counting"}
    assert counting[0] == expected
    assert _rows(out / "train" / "counting_cot_train.jsonl")[0] == expected  # --simple: the answer alone


# ----------------------------------------------------------------------------------------------- convert-vqa
VQA_X = {
    "262148000": {
        "question": "Where is the man?",
        "answers": [
            {"answer": "beach", "answer_confidence": "yes"},
            {"answer": "shore", "answer_confidence": "yes"},
            {"answer": "beach", "answer_confidence": "maybe"},
        ],
        "explanation": ["there is sand and water", "he stands on sand"],
        "image_id": 262148,
        "image_name": "COCO_val2014_000000262148.jpg",
    },
    "393225001": {
        "question": "Is it raining?",
        "answer": "no",
        "explanation": "the sky is clear",
        "image_id": 393225,
    },
}


def test_convert_vqa_golden(tmp_path):
    src = tmp_path / "vqax.json"
    src.write_text(json.dumps(VQA_X, indent=2))
    out = tmp_path / "rows.jsonl"
    template = "<image>Answer with <think>, <answer> and <explain> tags.\nQuestion: {question}"
    argv = ["convert-vqa", "-i", str(src), "-o", str(out), "--prompt_template", template]
    argv += ["--image_template", "COCO_train2014_{image_id:012d}.jpg", "--system_prompt", "You are a VQA system."]
    assert data_main(argv) == 0
    system = {"from": "system", "value": "You are a VQA system."}
    assert _rows(out) == [
        {
            "id": "262148000",
            "image": "COCO_val2014_000000262148.jpg",
            "conversations": [
                system,
                {"from": "human", "value": "<image>Answer with <think>, <answer> and <explain> tags.\n"
                                           "Question: Where is the man?"},
                {"from": "gpt", "value": "<answer>beach</answer><explain>there is sand and water</explain>"
                                         "<explain>he stands on sand</explain>"},
            ],
            "task_type": "raw",
        },
        {
            "id": "393225001",
            "image": "COCO_train2014_000000393225.jpg",
            "conversations": [
                system,
                {"from": "human", "value": "<image>Answer with <think>, <answer> and <explain> tags.\n"
                                           "Question: Is it raining?"},
                {"from": "gpt", "value": "<answer>no</answer><explain>the sky is clear</explain>"},
            ],
            "task_type": "raw",
        },
    ]  # fmt: skip


def test_convert_vqa_solutions_reach_training_verbatim(tmp_path):
    items = [
        {"question": "What?", "answer": "a cat", "explanation": ["it has whiskers", "it purrs"], "image": "c.jpg"},
        {"question": "Pre?", "solution": "<answer> x </answer><explain>kept as is</explain>", "image": "c.jpg"},
    ]
    src = tmp_path / "items.json"
    src.write_text(json.dumps(items))
    _img(tmp_path / "c.jpg")
    out = tmp_path / "rows.jsonl"
    assert data_main(["convert-vqa", "-i", str(src), "-o", str(out), "--explanation", "each"]) == 0
    rows, bad = read_rows([str(out)], [str(tmp_path)])
    assert bad == []
    assert [r["solution"] for r in rows] == [
        "<answer>a cat</answer><explain>it has whiskers</explain>",
        "<answer>a cat</answer><explain>it purrs</explain>",
        "<answer> x </answer><explain>kept as is</explain>",
    ]
    assert [r["id"] for r in rows] == ["1-0", "1-1", "2"]
    assert all(r["question"].startswith("<image>You are a Visual Question Answering system") for r in rows)
    assert rows[0]["question"].endswith("Question: What?")


def test_convert_vqa_reports_bad_items(tmp_path, capsys):
    src = tmp_path / "items.json"
    src.write_text('[\n  {"question": "Q?", "answer": "a", "explanation": "e", "image": "x.jpg"},\n'
                   '  {"question": "Q?", "explanation": "e", "image": "x.jpg"},\n'
                   '  {"question": "Q?", "answer": "a", "explanation": "e", "image_id": 7}\n]\n')  # fmt: skip
    assert data_main(["convert-vqa", "-i", str(src), "-o", str(tmp_path / "o.jsonl")]) == 1
    err = capsys.readouterr().err
    assert f"{src}:3: field 'answer'" in err and f"{src}:4: field 'image'" in err
    assert not (tmp_path / "o.jsonl").exists()


# ----------------------------------------------------------------------------------------------- check
def _vlm_r1(rid, images, question, answer, task=None):
    row = {"id": rid, "image": images, "conversations": [{"from": "human", "value": question},
                                                         {"from": "gpt", "value": answer}]}  # fmt: skip
    if task:
        row["task_type"] = task
    return row


@pytest.fixture
def bad_file(tmp_path):
    _img(tmp_path / "img" / "a.png")
    _img(tmp_path / "img" / "b.png", (80, 80))
    lines = [
        json.dumps(_vlm_r1("ok", "a.png", "<image>How many?", "<answer>2</answer>", "counting")),
        "{this is not json",
        json.dumps(_vlm_r1("missing", "nope.png", "<image>How many?", "<answer>2</answer>")),
        json.dumps(_vlm_r1("count", ["a.png", "b.png"], "<image>Which one?", "<answer>a</answer>")),
        json.dumps(_vlm_r1("task", "a.png", "<image>Dance?", "<answer>yes</answer>", "dance")),
        json.dumps(_vlm_r1("coords", "a.png", "<image>Where?",
                           "<answer><affordance><frame 1> (1001, 20)</affordance></answer>", "affordance")),
        json.dumps(_vlm_r1("ok2", ["a.png", "b.png"], "<image> vs <image>?", "<answer>b</answer>", "vqa")),
        json.dumps({"task_type": "trajectory", "conversation": [  # a raw RynnBrain row, read as is
            {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "Path?"}]},
            {"role": "assistant", "content": [{"frame1": [[10, 20], [-5, 1400]]}]}]}),
    ]  # fmt: skip
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_check_reports_each_kind_of_bad_row_with_file_line(bad_file, capsys):
    report = bad_file.with_name("report.json")
    code = data_main(["check", str(bad_file), "--image_folders", str(bad_file.parent / "img"), "--report", str(report)])
    out = capsys.readouterr().out
    assert code == 1
    expected = {
        2: ("<json>", "bad JSON"),
        3: ("image", "image file not found"),
        4: ("image", "1 '<image>' placeholder(s) but the row has 2 image(s)"),
        5: ("task_type", "unknown task type 'dance'"),
        6: ("solution", "outside 0-1000: (1001, 20)"),
        8: ("solution", "outside 0-1000: (-5, 1400)"),
    }
    for line, (field, reason) in expected.items():
        assert f"{bad_file}:{line}: field '{field}': " in out and reason in out, (line, out)
    data = json.loads(report.read_text())
    assert data["rows"] == 8 and data["bad_rows"] == 6 and data["good_rows"] == 2
    assert [b["source"] for b in data["bad"]] == [f"{bad_file}:{n}" for n in (2, 3, 4, 5, 6, 8)]
    assert data["per_task"] == {"counting": 1, "vqa": 1}
    assert data["bad_per_task"] == {"affordance": 1, "dance": 1, "default": 3, "trajectory": 1}
    assert "RESULT: 6 bad row(s)" in out


def test_check_with_a_model_counts_image_tokens_and_prompt_lengths(bad_file, tiny_models, capsys):
    clean = bad_file.with_name("clean.jsonl")
    lines = bad_file.read_text().splitlines()
    clean.write_text("\n".join([lines[0], lines[6]]) + "\n")
    model = str(tiny_models["qwen2_5_vl"])
    images = str(bad_file.parent / "img")
    report = bad_file.with_name("r.json")
    assert data_main(["check", str(clean), "--image_folders", images, "--model", model, "--report", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["images"] == 3 and data["image_tokens_per_row"]["count"] == 2
    assert (
        data["image_tokens_per_row"]["min"] > 0
        and data["image_tokens_per_row"]["max"] > data["image_tokens_per_row"]["min"]
    )
    lengths = data["text_length_prompt tokens, images included"]
    assert lengths["count"] == 2 and lengths["max"] > data["image_tokens_per_row"]["max"]
    assert "RESULT: OK" in capsys.readouterr().out
    # the training prompt-length check, reused: both rows are longer than 10 tokens
    assert (
        data_main(["check", str(clean), "--image_folders", images, "--model", model, "--max_prompt_length", "10"]) == 1
    )
    out = capsys.readouterr().out
    assert f"{clean}:1: field 'prompt'" in out and f"{clean}:2: field 'prompt'" in out


def test_check_json_and_parquet_report_their_own_lines(tmp_path, capsys):
    _img(tmp_path / "a.png")
    rows = [
        _vlm_r1("1", "a.png", "<image>Q?", "<answer>1</answer>"),
        _vlm_r1("2", "x.png", "<image>Q?", "<answer>1</answer>"),
    ]
    as_json = tmp_path / "rows.json"
    as_json.write_text(json.dumps(rows, indent=2))
    write_rows(tmp_path / "rows.parquet", rows)
    assert data_main(["check", str(as_json), str(tmp_path / "rows.parquet")]) == 1
    out = capsys.readouterr().out
    second_record_line = as_json.read_text().splitlines().index("  {", 2) + 1
    assert f"{as_json}:{second_record_line}: field 'image': image file not found" in out
    assert f"{tmp_path / 'rows.parquet'}:2: field 'image': image file not found" in out


def test_check_clean_demo_data_exits_0(capsys):
    assert data_main(["check", str(DEMO / "train.jsonl"), "--image_folders", str(DEMO / "images")]) == 0
    out = capsys.readouterr().out
    assert "RESULT: OK" in out and "counting" in out and "rec" in out


# ----------------------------------------------------------------------------------------------- format
def test_format_writes_canonical_rows_with_sizes_and_lengths(tmp_path, tiny_models, capsys):
    src = tmp_path / "in.jsonl"
    demo = _rows(DEMO / "train.jsonl")[:6]
    for row in demo:
        row["data_source"] = "demo"
    src.write_text("".join(json.dumps(r) + "\n" for r in demo))
    out = tmp_path / "formatted.jsonl"
    argv = ["format", "--ann_path", str(src), "--save_path", str(out), "--data_root", str(DEMO / "images")]
    argv += ["--tokenizer_path", str(tiny_models["qwen2_5_vl"]), "--nproc", "2"]
    assert data_main(argv) == 0
    rows = _rows(out)
    assert [r["id"] for r in rows] == [r["id"] for r in demo]
    for row, raw in zip(rows, demo, strict=True):
        images = raw["image"] if isinstance(raw["image"], list) else [raw["image"]]
        assert row["image"] == [str((DEMO / "images" / p).resolve()) for p in images]
        assert row["image_sizes"] == [list(Image.open(p).size) for p in row["image"]]
        assert isinstance(row["text_sequence_length"], int) and row["text_sequence_length"] > 10
        assert row["conversations"] == raw["conversations"] and row["data_source"] == "demo"
        assert row["task_type"] == raw["task_type"]
    # the formatted file trains as is: absolute paths, no image folder needed
    good, bad = read_rows([str(out)])
    assert bad == [] and len(good) == 6
    # refuses to overwrite without -y
    assert data_main(argv) == 1
    assert "Refusing to overwrite" in capsys.readouterr().err
    assert data_main([*argv, "-y"]) == 0


# ----------------------------------------------------------------------------------------------- merge
def _write_split(root: Path, name: str, rows: list[dict]) -> Path:
    split = name.rsplit("_", 1)[1].split(".")[0]
    return write_rows(root / split / name, rows)


def test_merge_concatenates_per_task_files_and_keeps_them(tmp_path, capsys):
    a = [_vlm_r1(f"a{i}", [], "Q?", "<answer>1</answer>", "counting") for i in range(3)]
    b = [_vlm_r1(f"b{i}", [], "Q?", "<answer>2</answer>", "general") for i in range(2)]
    for name, rows in [("counting_rl_train.jsonl", a), ("general_rl_train.jsonl", b), ("general_rl_test.jsonl", b[:1])]:
        _write_split(tmp_path, name, rows)
    assert data_main(["merge", "-i", str(tmp_path)]) == 0
    assert [r["id"] for r in _rows(tmp_path / "train.jsonl")] == ["a0", "a1", "a2", "b0", "b1"]
    assert [r["id"] for r in _rows(tmp_path / "test.jsonl")] == ["b0"]
    assert (tmp_path / "train" / "counting_rl_train.jsonl").is_file()  # originals kept
    assert data_main(["merge", "-i", str(tmp_path)]) == 1  # no silent overwrite
    assert "Refusing to overwrite" in capsys.readouterr().err
    # parquet in, parquet out
    pq = tmp_path / "pq"
    _write_split(pq, "counting_rl_train.parquet", a)
    _write_split(pq, "general_rl_train.parquet", b)
    assert data_main(["merge", "-i", str(pq), "-o", str(tmp_path / "pq_out")]) == 0
    assert [r.value["id"] for r in iter_records(tmp_path / "pq_out" / "train.parquet")] == [
        "a0",
        "a1",
        "a2",
        "b0",
        "b1",
    ]


def test_merge_refuses_schema_conflicts_and_mixed_stages(tmp_path, capsys):
    _write_split(tmp_path, "counting_rl_train.jsonl", [_vlm_r1("1", [], "Q?", "<answer>1</answer>")])
    _write_split(tmp_path, "general_rl_train.jsonl", [_vlm_r1(2, [], "Q?", "<answer>1</answer>")])
    assert data_main(["merge", "-i", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "Schema conflict in column 'id': string in" in err and "counting_rl_train.jsonl" in err
    assert "number in" in err and "general_rl_train.jsonl" in err
    assert not (tmp_path / "train.jsonl").exists()

    stages = tmp_path / "stages"
    _write_split(stages, "counting_rl_train.jsonl", [_vlm_r1("1", [], "Q?", "<answer>1</answer>")])
    _write_split(stages, "counting_cot_train.jsonl", [_vlm_r1("1", [], "Q?", "#### <answer>1</answer>")])
    assert data_main(["merge", "-i", str(stages)]) == 1
    assert "several stages (cot, rl)" in capsys.readouterr().err
    assert data_main(["merge", "-i", str(stages), "--stage", "cot", "-o", str(stages / "cot")]) == 0
    assert _rows(stages / "cot" / "train.jsonl")[0]["conversations"][1]["value"] == "#### <answer>1</answer>"


def test_every_command_has_help(capsys):
    for command in ("preprocess", "convert-vqa", "check", "format", "merge"):
        with pytest.raises(SystemExit) as exc:
            data_main([command, "--help"])
        assert exc.value.code == 0
        assert "usage: vlm-grpo-data " + command in capsys.readouterr().out


def test_preprocess_rl_stage_needs_no_thinking_turn(tmp_path):
    """RynnBrain's own single-image example has no Thinking turn: the RL stage is written, the CoT stage refuses."""
    raw = tmp_path / "raw.jsonl"
    raw.write_text(" ".join(RAW["affordance"].split("\n")) + "\n")
    out = tmp_path / "out"
    argv = ["preprocess", "-i", str(raw), "-o", str(out), "--task_type", "affordance"]
    assert data_main([*argv, "--stage", "rl"]) == 0
    (row,) = _rows(out / "train" / "affordance_rl_train.jsonl")
    assert row["conversations"][-1]["value"] == "<answer><affordance><frame 1> (325, 480)</affordance></answer>"
    assert not (out / "train" / "affordance_cot_train.jsonl").exists()
    assert data_main([*argv, "-o", str(tmp_path / "cot"), "--stage", "cot"]) == 1  # the CoT stage needs one
