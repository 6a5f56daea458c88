"""Bad-input messages point at the right line: blank lines, multi-line JSON records and table rows counted
as a user's editor counts them (1-based)."""

from __future__ import annotations

import json

import pytest

from vlm_grpo.data import read_rows
from vlm_grpo.data.records import iter_records, read_any_rows
from vlm_grpo.data.sources import read_sources


def _row(question="What is 2 + 2?", answer="4"):
    return {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]}


NO_ANSWER = {"conversations": [{"from": "human", "value": "?"}]}


@pytest.fixture
def jsonl(tmp_path):
    lines = [
        "",  # 1
        json.dumps(_row()),  # 2
        "   ",  # 3
        "",  # 4
        '{"conversations": [',  # 5: bad JSON
        "\t",  # 6
        json.dumps(NO_ANSWER),  # 7: no answer turn
        json.dumps(_row("Why?", "because")),  # 8
        "",  # 9
        b'{"conversations": "caf\xe9"}',  # 10: not UTF-8
    ]
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    return path


@pytest.mark.parametrize("reader", [read_rows, read_sources, read_any_rows])
def test_jsonl_lines_count_blank_lines(jsonl, reader):
    good, bad = reader([str(jsonl)]) if reader is not read_sources else reader(str(jsonl))
    assert [r["source"] for r in good] == [f"{jsonl}:2", f"{jsonl}:8"]
    assert [(b.source, b.field) for b in bad] == [
        (f"{jsonl}:5", "<json>"),
        (f"{jsonl}:7", "conversations"),
        (f"{jsonl}:10", "<encoding>"),
    ]
    assert "bad JSON" in bad[0].reason and "column" in bad[0].reason
    assert str(bad[1]).startswith(f"{jsonl}:7: field 'conversations': ")


def test_a_json_list_names_the_line_each_record_starts_on(tmp_path):
    path = tmp_path / "rows.json"
    text = "\n\n[\n" + json.dumps(_row(), indent=2) + ",\n\n" + json.dumps(NO_ANSWER, indent=2) + ",\n"
    text += json.dumps(_row("Why?", "because")) + "\n]\n"
    path.write_text(text)
    starts = [i for i, line in enumerate(text.split("\n"), start=1) if line.startswith("{")]
    assert [r.source for r in iter_records(path)] == [f"{path}:{n}" for n in starts]
    good, bad = read_any_rows([str(path)])
    assert [b.source for b in bad] == [f"{path}:{starts[1]}"]
    assert [r["source"] for r in good] == [f"{path}:{starts[0]}", f"{path}:{starts[2]}"]


def test_a_json_syntax_error_names_its_line(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text('\n[\n  {"conversations": []},\n  {"conversations": [}\n]\n')
    (record,) = iter_records(path)
    assert record.source == f"{path}:4" and "bad JSON" in record.error


def test_table_rows_are_numbered_from_one(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [_row(), {"conversations": [{"from": "human", "value": "?"}, {"from": "human", "value": "?"}]}, _row()]
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    for good, bad in (read_sources(str(path)), read_any_rows([str(path)])):
        assert [b.source for b in bad] == [f"{path}:2"]
        assert [r["source"] for r in good] == [f"{path}:1", f"{path}:3"]


def test_a_json_object_of_records_keeps_its_keys_as_ids_and_names_each_line(tmp_path):
    path = tmp_path / "vqa_x.json"
    text = '{\n  "q1": ' + json.dumps(_row()) + ',\n\n  "q2" :\n    ' + json.dumps({**NO_ANSWER, "id": "own"}) + "\n}\n"
    path.write_text(text)
    records = list(iter_records(path))
    assert [r.source for r in records] == [f"{path}:2", f"{path}:5"]
    assert [r.value["id"] for r in records] == ["q1", "own"]  # a record's own id wins
    good, bad = read_any_rows([str(path)])
    assert [r["source"] for r in good] == [f"{path}:2"] and [b.source for b in bad] == [f"{path}:5"]


def test_one_json_record_and_odd_json_files(tmp_path):
    one = tmp_path / "one.json"
    one.write_text("\n\n" + json.dumps(_row(), indent=1) + "\n")
    (record,) = iter_records(one)
    assert record.source == f"{one}:3" and record.value == _row()  # where the record starts
    empty = tmp_path / "empty.json"
    empty.write_text("  \n")
    assert list(iter_records(empty)) == []
    good, bad = read_any_rows([str(empty)])
    assert good == [] and [(b.source, b.field) for b in bad] == [(str(empty), "<file>")]  # named as a whole file
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'[\n{"a": 1},\n{"b": "caf\xe9"}\n]\n')
    (record,) = iter_records(latin)
    assert record.source == f"{latin}:3" and record.error.startswith("not valid UTF-8 (byte 0xe9)")
    good, bad = read_any_rows([str(latin)])
    assert [(b.source, b.field) for b in bad] == [(f"{latin}:3", "<json>")] and "UTF-8" in bad[0].reason
    bom = tmp_path / "bom.json"
    bom.write_bytes(b"\xef\xbb\xbf[" + json.dumps(_row()).encode() + b"]")
    assert [r.value for r in iter_records(bom)] == [_row()]


def test_parquet_nulls_are_dropped_so_rows_read_back_as_written(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{**_row(), "system": "be brief", "extra": {"k": 1, "z": None}}, _row("Why?", "because")]
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    values = [r.value for r in iter_records(path)]
    assert values[0]["extra"] == {"k": 1} and "system" not in values[1] and "extra" not in values[1]
    assert values[1] == _row("Why?", "because")


def test_unsupported_and_missing_files_are_named(tmp_path):
    from vlm_grpo.data.formats import DataError
    from vlm_grpo.data.records import file_kind

    assert [file_kind(f"x{s}") for s in (".jsonl", ".JSON", ".parquet")] == ["jsonl", "json", "parquet"]
    expected = r"unsupported file type '\.csv' \(expected one of \.jsonl, \.json, \.parquet\)"
    with pytest.raises(DataError, match=expected):
        file_kind(tmp_path / "rows.csv")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet")
    with pytest.raises(DataError, match="not a readable parquet file"):
        list(iter_records(broken))


def test_iter_records_goes_on_past_bad_lines_naming_each(jsonl):
    records = list(iter_records(jsonl))
    assert [r.source for r in records] == [f"{jsonl}:{n}" for n in (2, 5, 7, 8, 10)]
    assert [r.error is None for r in records] == [True, False, True, True, False]
    assert records[1].error.startswith("bad JSON: ") and "UTF-8" in records[4].error
    assert records[3].value == _row("Why?", "because")


@pytest.mark.parametrize("kind", ["jsonl", "json"])
def test_images_are_found_in_the_image_folder_whatever_the_file_kind(tmp_path, kind):
    from PIL import Image

    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (32, 32), (0, 90, 0)).save(tmp_path / "imgs" / "a.png")
    rows = [{**_row("<image>Colour?", "green"), "image": "a.png"}]
    path = tmp_path / f"rows.{kind}"
    path.write_text(json.dumps(rows) if kind == "json" else json.dumps(rows[0]) + "\n")
    good, bad = read_any_rows([str(path)], [str(tmp_path / "imgs")])
    assert bad == [] and good[0]["image_path"] == [str(tmp_path / "imgs" / "a.png")]
    good, bad = read_any_rows([str(path)], [str(tmp_path / "imgs")], task_type="counting")  # options reach read_rows
    assert good[0]["task_type"] == "counting"


@pytest.mark.parametrize("key", ["conversations", "conversation", "problem"])
def test_a_json_file_holding_one_record_is_not_read_as_a_mapping_of_records(tmp_path, key):
    record = {"conversations": _row()["conversations"]} if key == "conversations" else {key: "x", "answer": "y"}
    path = tmp_path / "one.json"
    path.write_text(json.dumps({**record, "id": "r1"}))
    (only,) = iter_records(path)
    assert only.value == {**record, "id": "r1"} and only.source == f"{path}:1"


def test_compact_json_and_odd_values_keep_their_lines(tmp_path):
    compact = tmp_path / "compact.json"
    compact.write_text("[" + json.dumps(_row()) + ",\n" + json.dumps(NO_ANSWER) + "]")
    assert [r.source for r in iter_records(compact)] == [f"{compact}:1", f"{compact}:2"]
    mapping = tmp_path / "mapping.json"
    mapping.write_text('{"a":' + json.dumps(_row()) + ',\n"b":5}')
    records = list(iter_records(mapping))
    assert [r.source for r in records] == [f"{mapping}:1", f"{mapping}:2"] and records[1].value == 5
    good, bad = read_any_rows([str(mapping)])
    assert [(b.source, b.field) for b in bad] == [(f"{mapping}:2", "<row>")] and good[0]["id"] == "a"
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'[\n{"b": "caf\xe9"},\n{"a": 1},\n{"c": 2}\n]\n')
    (record,) = iter_records(latin)
    assert record.source == f"{latin}:2"
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    good, bad = read_any_rows([str(empty)])
    assert [(b.source, b.field) for b in bad] == [(str(empty), "<file>")] and "holds no rows" in bad[0].reason


def test_file_errors_carry_the_file(tmp_path):
    from vlm_grpo.data.formats import DataError
    from vlm_grpo.data.records import file_kind

    with pytest.raises(DataError) as info:
        file_kind(tmp_path / "rows.txt")
    assert info.value.source == str(tmp_path / "rows.txt") and str(info.value).startswith(f"{tmp_path / 'rows.txt'}: ")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"PAR1 not really")
    with pytest.raises(DataError) as info:
        list(iter_records(broken))
    assert info.value.source == str(broken) and "not a readable parquet file" in str(info.value)
