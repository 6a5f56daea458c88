"""The details of resuming a user relies on: what the marker lists, how checkpoints of other tools (sharded,
DeepSpeed) are judged, where a truncated safetensors file starts to count as truncated, and what is logged."""

from __future__ import annotations

import json
import logging
import struct

import pytest
import torch
from safetensors.torch import save_file

from test_resume import _checkpoint
from vlm_grpo.resume import (
    COMPLETE_MARKER,
    ResumeError,
    checkpoint_problem,
    checkpoint_step,
    mark_complete,
    resolve_resume,
)


def test_the_marker_lists_every_file_with_its_size_and_the_step(tmp_path):
    path = _checkpoint(tmp_path, 12, complete=False)
    (path / "global_step12").mkdir()
    (path / "global_step12" / "mp_rank_00_model_states.pt").write_bytes(b"x" * 7)
    mark_complete(path)
    marker = json.loads((path / COMPLETE_MARKER).read_text())
    assert marker["step"] == 12
    sizes = {p.relative_to(path).as_posix(): p.stat().st_size for p in path.rglob("*") if p.is_file()}
    del sizes[COMPLETE_MARKER]
    assert marker["files"] == sizes and marker["files"]["global_step12/mp_rank_00_model_states.pt"] == 7
    assert sorted(p.name for p in path.iterdir() if p.name.startswith(".")) == []  # no temporary file left
    other = tmp_path / "final"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"")
    mark_complete(other)
    assert json.loads((other / COMPLETE_MARKER).read_text())["step"] is None  # not a checkpoint-N folder
    mark_complete(path)  # marking again: the old marker is not listed as one of the files
    assert COMPLETE_MARKER not in json.loads((path / COMPLETE_MARKER).read_text())["files"]


def test_a_marker_that_is_not_valid_is_named(tmp_path):
    path = _checkpoint(tmp_path, 3)
    (path / COMPLETE_MARKER).write_text('{"step": 3}')
    assert checkpoint_problem(path) == f"{path / COMPLETE_MARKER} is not a valid completion marker"
    (path / COMPLETE_MARKER).write_text("{")
    assert "is not a valid completion marker" in checkpoint_problem(path)


def _sharded(root, step, shards=("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")):
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    for i, name in enumerate(shards):
        save_file({f"w{i}": torch.arange(32, dtype=torch.float32)}, path / name)
    index = {"metadata": {}, "weight_map": {f"w{i}": name for i, name in enumerate(shards)}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return path


def test_a_sharded_checkpoint_of_another_tool_is_checked_shard_by_shard(tmp_path):
    path = _sharded(tmp_path, 5)
    assert checkpoint_problem(path) is None
    second = path / "model-00002-of-00002.safetensors"
    data = second.read_bytes()
    second.write_bytes(data[:-1])
    assert checkpoint_problem(path) == f"{second} is truncated ({len(data) - 1} of {len(data)} bytes)"
    second.unlink()
    assert checkpoint_problem(path) == f"{second} is missing"
    (path / "model.safetensors.index.json").write_text('{"weight_map": ')
    assert "model.safetensors.index.json is not valid JSON" in checkpoint_problem(path)


def test_weights_deepspeed_folders_and_empty_files_of_other_tools(tmp_path):
    path = tmp_path / "checkpoint-1"
    path.mkdir()
    (path / "trainer_state.json").write_text("{}")
    weights = "model.safetensors, adapter_model.safetensors, global_step*"
    assert checkpoint_problem(path) == f"{path} holds no model weights ({weights})"
    (path / "global_step1").mkdir()  # DeepSpeed keeps its states there
    assert checkpoint_problem(path) is None
    (path / "pytorch_model.bin").write_bytes(b"")
    assert checkpoint_problem(path) == f"{path / 'pytorch_model.bin'} is empty"
    torch.save({"w": torch.zeros(2)}, path / "pytorch_model.bin")
    assert checkpoint_problem(path) is None
    for name in ("scheduler.pt", "rng_state.pth", "optimizer.pt"):
        (path / name).write_bytes(b"")
        assert checkpoint_problem(path) == f"{path / name} is empty"
        (path / name).write_bytes(b"ok")
    assert checkpoint_problem(path) is None


def _safetensors(path, header: dict, data_bytes: int):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * data_bytes)


@pytest.mark.parametrize("extra", [0, 1, -1])
def test_a_safetensors_file_is_truncated_only_when_shorter_than_its_header_says(tmp_path, extra):
    """Just at, just over and just under the length its header gives (8 + header + last offset)."""
    path = tmp_path / "checkpoint-1"
    path.mkdir()
    (path / "trainer_state.json").write_text("{}")
    header = {"__metadata__": {"format": "pt"}, "w": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]}}
    _safetensors(path / "model.safetensors", header, 64 + extra)
    expected = 8 + len(json.dumps(header).encode()) + 64
    got = checkpoint_problem(path)
    if extra >= 0:
        assert got is None
    else:
        assert got == f"{path / 'model.safetensors'} is truncated ({expected - 1} of {expected} bytes)"


def test_a_safetensors_header_cut_short_is_named(tmp_path):
    path = tmp_path / "checkpoint-1"
    path.mkdir()
    (path / "trainer_state.json").write_text("{}")
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 100) + b'{"w": ')
    assert checkpoint_problem(path) == f"{path / 'model.safetensors'} is truncated (14 bytes; its header is incomplete)"
    (path / "model.safetensors").write_bytes(b"\x01\x02")
    assert "its header is incomplete" in checkpoint_problem(path)
    _safetensors(path / "model.safetensors", {"__metadata__": {}}, 0)  # no tensors at all: nothing to be short of
    assert checkpoint_problem(path) is None


def test_checkpoint_step_reads_trainer_state(tmp_path):
    assert checkpoint_step(_checkpoint(tmp_path, 7)) == 7
    assert checkpoint_step(tmp_path / "missing") is None


def test_a_path_is_resumed_as_given_and_logged_on_the_main_process_only(tmp_path, caplog):
    path = _checkpoint(tmp_path, 6)
    with caplog.at_level(logging.INFO, logger="vlm_grpo.resume"):
        assert resolve_resume(tmp_path, str(path)) == str(path)
    assert caplog.messages == [f"Resuming from {path} (step 6)"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vlm_grpo.resume"):
        assert resolve_resume(tmp_path, str(path), is_main_process=False) == str(path)
        assert resolve_resume(tmp_path, True, is_main_process=False) == str(path)
    assert caplog.messages == []  # other ranks log at debug
    with caplog.at_level(logging.INFO, logger="vlm_grpo.resume"):
        assert resolve_resume(tmp_path / "new", "yes") is None
    assert caplog.messages == [f"--resume_from_checkpoint yes: no checkpoint in '{tmp_path / 'new'}' yet, starting "
                               "a fresh run"]  # fmt: skip


def test_a_folder_not_named_checkpoint_n_is_accepted_with_its_trainer_state(tmp_path):
    path = _checkpoint(tmp_path, 4)
    renamed = path.rename(tmp_path / "best")
    assert resolve_resume(tmp_path, str(renamed)) == str(renamed)


@pytest.mark.parametrize("value", [None, False, "false", "No", " none ", "0", "off", ""])
def test_every_spelling_of_no_is_a_fresh_run_and_refused_over_checkpoints(tmp_path, value):
    assert resolve_resume(tmp_path, value) is None
    _checkpoint(tmp_path, 1)
    with pytest.raises(ResumeError) as info:
        resolve_resume(tmp_path, value)
    assert str(info.value) == (
        f"output_dir '{tmp_path}' already holds 1 checkpoint(s) (newest: checkpoint-1) and no --resume_from_checkpoint "
        "was given. Choose one:\n"
        "  --resume_from_checkpoint true      continue from the newest complete checkpoint (also: latest)\n"
        "  --resume_from_checkpoint PATH      continue from a specific checkpoint folder\n"
        "  --overwrite_output_dir             start a fresh run there (removes the old checkpoints)\n"
        "  --output_dir OTHER_DIR             start a fresh run elsewhere"
    )


@pytest.mark.parametrize("value", [True, "true", "Latest", "YES", "1", "on"])
def test_every_spelling_of_yes_resumes_the_newest(tmp_path, value):
    _checkpoint(tmp_path, 1)
    newest = _checkpoint(tmp_path, 3)
    assert resolve_resume(tmp_path, value) == str(newest)


def test_overwrite_is_done_by_the_main_process_only_and_logged(tmp_path, caplog):
    _checkpoint(tmp_path, 2)
    assert resolve_resume(tmp_path, None, overwrite_output_dir=True, is_main_process=False) is None
    assert (tmp_path / "checkpoint-2").is_dir()  # other ranks leave the folders to the main process
    with caplog.at_level(logging.WARNING, logger="vlm_grpo.resume"):
        assert resolve_resume(tmp_path, None, overwrite_output_dir=True) is None
    assert caplog.messages == [f"--overwrite_output_dir: removing 1 old checkpoint(s) in {tmp_path}"]
    assert not (tmp_path / "checkpoint-2").exists()


def test_when_nothing_is_complete_every_problem_is_named(tmp_path):
    a, b = _checkpoint(tmp_path, 1, complete=False), _checkpoint(tmp_path, 2, complete=False)
    (a / "trainer_state.json").unlink()
    (b / "config.json").write_text("{")
    with pytest.raises(ResumeError) as info:
        resolve_resume(tmp_path, "true")
    assert (
        f"({b / 'config.json'} is not valid JSON (1 bytes; cut short by a kill?); {a / 'trainer_state.json'} is "
        "missing)" in str(info.value)
    )


def test_an_incomplete_path_with_nothing_complete_beside_it_says_start_fresh(tmp_path):
    path = _checkpoint(tmp_path, 2, complete=False)
    (path / "trainer_state.json").write_text("")
    with pytest.raises(ResumeError) as info:
        resolve_resume(tmp_path, str(path))
    assert str(info.value).endswith(
        "No complete checkpoint sits beside it; start a fresh run (--overwrite_output_dir)."
    ) and "this checkpoint is incomplete, probably written by a run that was killed while saving" in str(info.value)
    good = _checkpoint(tmp_path, 1)
    with pytest.raises(ResumeError) as info:
        resolve_resume(tmp_path, str(path))
    assert str(info.value).endswith(
        f"The newest complete checkpoint beside it is {good}: pass --resume_from_checkpoint {good} "
        "(or true for the newest complete one)."
    )


def test_a_single_file_checkpoint_with_an_index_beside_it_checks_both(tmp_path):
    path = _sharded(tmp_path, 2)
    save_file({"w": torch.zeros(8)}, path / "model.safetensors")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:-4])
    assert "model.safetensors is truncated" in checkpoint_problem(path)
    (path / "model.safetensors").write_bytes(data)
    (path / "model.safetensors.index.json").write_text('{"metadata": {}}')  # an index without a weight map
    assert checkpoint_problem(path) is None


def test_skips_and_resumes_are_logged_word_for_word(tmp_path, caplog):
    good = _checkpoint(tmp_path, 1)
    broken = _checkpoint(tmp_path, 2)
    (broken / "optimizer.pt").unlink()
    with caplog.at_level(logging.INFO, logger="vlm_grpo.resume"):
        resolve_resume(tmp_path, "true")
    assert caplog.messages == [
        f"Skipping incomplete checkpoint {broken}: {broken / 'optimizer.pt'} is missing",
        f"Resuming from {good} (step 1)",
    ]


def test_a_folder_of_another_name_is_a_checkpoint_when_it_has_trainer_state(tmp_path):
    renamed = _checkpoint(tmp_path, 4, complete=False).rename(tmp_path / "best")
    assert resolve_resume(tmp_path, str(renamed)) == str(renamed)
    (renamed / "trainer_state.json").unlink()
    with pytest.raises(ResumeError, match=r"has no trainer_state\.json; is it a checkpoint-N folder"):
        resolve_resume(tmp_path, str(renamed))
