"""--resume_from_checkpoint semantics: never silently continue an old run."""

from __future__ import annotations

import json

import pytest

from vlm_grpo.resume import ResumeError, list_checkpoints, resolve_resume


def _checkpoint(root, step):
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return path


def test_fresh_run_in_empty_dir(tmp_path):
    assert resolve_resume(tmp_path / "new", None) is None
    assert resolve_resume(tmp_path, "false") is None


def test_existing_checkpoints_without_flag_are_refused_with_the_options(tmp_path):
    _checkpoint(tmp_path, 2)
    with pytest.raises(ResumeError) as info:
        resolve_resume(tmp_path, None)
    message = str(info.value)
    assert "already holds 1 checkpoint(s) (newest: checkpoint-2)" in message
    for option in ("--resume_from_checkpoint true", "--resume_from_checkpoint PATH", "--overwrite_output_dir"):
        assert option in message


def test_latest_is_by_step_number_not_name(tmp_path):
    for step in (9, 10, 2):
        _checkpoint(tmp_path, step)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-9", "checkpoint-10"]
    assert resolve_resume(tmp_path, "true").endswith("checkpoint-10")
    assert resolve_resume(tmp_path, "latest").endswith("checkpoint-10")


def test_explicit_path_wins_over_newer_ones(tmp_path):
    old = _checkpoint(tmp_path, 2)
    _checkpoint(tmp_path, 4)
    assert resolve_resume(tmp_path, str(old)) == str(old)


def test_bad_requests_are_clear(tmp_path):
    with pytest.raises(ResumeError, match="holds no checkpoint-"):
        resolve_resume(tmp_path, "latest")
    with pytest.raises(ResumeError, match="is not a checkpoint folder"):
        resolve_resume(tmp_path, str(tmp_path / "nowhere"))
    (tmp_path / "plain").mkdir()
    with pytest.raises(ResumeError, match=r"no trainer_state\.json"):
        resolve_resume(tmp_path, str(tmp_path / "plain"))


def test_overwrite_removes_old_checkpoints(tmp_path):
    _checkpoint(tmp_path, 2)
    assert resolve_resume(tmp_path, None, overwrite_output_dir=True) is None
    assert list_checkpoints(tmp_path) == []
