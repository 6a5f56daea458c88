"""--resume_from_checkpoint semantics: never silently continue an old run, never resume a half-written one."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import save_file

from vlm_grpo.resume import (
    COMPLETE_MARKER,
    ResumeError,
    checkpoint_problem,
    list_checkpoints,
    mark_complete,
    resolve_resume,
)


def _checkpoint(root, step, complete=True):
    """A checkpoint folder shaped like transformers' (weights, optimizer, state), marked complete or not."""
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    save_file({"w": torch.arange(64, dtype=torch.float32)}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    torch.save({"state": {}}, path / "optimizer.pt")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if complete:
        mark_complete(path)
    return path


def test_fresh_run_in_empty_dir(tmp_path):
    assert resolve_resume(tmp_path / "new", None) is None
    assert resolve_resume(tmp_path, "false") is None


def test_resume_true_on_a_new_output_dir_starts_fresh_and_says_so(tmp_path, caplog):
    # VLM-R1 scripts pass --resume_from_checkpoint True on their first run too.
    with caplog.at_level(logging.INFO, logger="vlm_grpo.resume"):
        assert resolve_resume(tmp_path / "new", "True") is None
        assert resolve_resume(tmp_path, True) is None
    assert "no checkpoint in" in caplog.text and "starting a fresh run" in caplog.text


def test_existing_checkpoints_without_flag_are_refused_with_the_options(tmp_path):
    _checkpoint(tmp_path, 2)
    with pytest.raises(ResumeError) as info:
        resolve_resume(tmp_path, None)
    message = str(info.value)
    assert "already holds 1 checkpoint(s) (newest: checkpoint-2)" in message
    for option in ("--resume_from_checkpoint true", "--resume_from_checkpoint PATH", "--overwrite_output_dir"):
        assert option in message


def test_latest_is_by_step_number_not_name_and_is_logged(tmp_path, caplog):
    for step in (9, 10, 2):
        _checkpoint(tmp_path, step)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-9", "checkpoint-10"]
    with caplog.at_level(logging.INFO, logger="vlm_grpo.resume"):
        assert resolve_resume(tmp_path, "true").endswith("checkpoint-10")
        assert resolve_resume(tmp_path, "latest").endswith("checkpoint-10")
    assert f"Resuming from {tmp_path / 'checkpoint-10'} (step 10)" in caplog.text


def _empty_folder(path):
    for child in path.iterdir():
        child.unlink()


def _truncate(name, keep=0.5):
    def damage(path):
        data = (path / name).read_bytes()
        (path / name).write_bytes(data[: int(len(data) * keep)])

    return damage


def _remove(name):
    return lambda path: (path / name).unlink()


# (how a kill mid-save or a later accident leaves the newest checkpoint, whether the run wrote markers, the reason)
DAMAGE = {
    "empty folder": (_empty_folder, False, "is empty"),
    "0-byte config.json": (_truncate("config.json", 0), False, "config.json is not valid JSON"),
    "no trainer_state.json": (_remove("trainer_state.json"), False, "trainer_state.json is missing"),
    "half trainer_state.json": (_truncate("trainer_state.json"), False, "trainer_state.json is not valid JSON"),
    "truncated model.safetensors": (_truncate("model.safetensors"), False, "model.safetensors is truncated"),
    "empty optimizer.pt": (_truncate("optimizer.pt", 0), False, "optimizer.pt is empty"),
    "marked, then model truncated": (_truncate("model.safetensors", 0.9), True, "model.safetensors has"),
    "marked, then optimizer removed": (_remove("optimizer.pt"), True, "optimizer.pt is missing"),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_auto_resume_skips_a_broken_newest_checkpoint_and_names_it(kind, tmp_path, caplog):
    damage, marked, reason = DAMAGE[kind]
    good = _checkpoint(tmp_path, 2, complete=marked)  # unmarked: a folder of another tool, checked structurally
    broken = _checkpoint(tmp_path, 4, complete=marked)
    damage(broken)
    assert checkpoint_problem(good) is None
    assert reason in checkpoint_problem(broken)
    with caplog.at_level(logging.INFO, logger="vlm_grpo.resume"):
        assert resolve_resume(tmp_path, "true") == str(good)
    assert f"Skipping incomplete checkpoint {broken}" in caplog.text and reason in caplog.text
    assert f"Resuming from {good} (step 2)" in caplog.text

    # Asked for by path, the broken one is refused naming the broken file and the complete one beside it.
    with pytest.raises(ResumeError) as info:
        resolve_resume(tmp_path, str(broken))
    message = str(info.value)
    assert reason in message and f"newest complete checkpoint beside it is {good}" in message


def test_a_checkpoint_without_marker_from_other_tools_is_accepted_when_whole(tmp_path):
    legacy = _checkpoint(tmp_path, 3, complete=False)
    assert not (legacy / COMPLETE_MARKER).exists()
    assert resolve_resume(tmp_path, "true") == str(legacy)


def test_no_complete_checkpoint_at_all_is_an_error_not_a_fresh_run(tmp_path):
    _empty_folder(_checkpoint(tmp_path, 2, complete=False))
    with pytest.raises(ResumeError, match=r"none of the 1 checkpoint\(s\) .* is complete .*--overwrite_output_dir"):
        resolve_resume(tmp_path, "true")


def test_bad_requests_are_clear(tmp_path):
    with pytest.raises(ResumeError, match="is not a checkpoint folder"):
        resolve_resume(tmp_path, str(tmp_path / "nowhere"))
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("x")
    with pytest.raises(ResumeError, match=r"no trainer_state\.json"):
        resolve_resume(tmp_path, str(tmp_path / "plain"))


def test_overwrite_removes_old_checkpoints(tmp_path):
    _checkpoint(tmp_path, 2)
    assert resolve_resume(tmp_path, None, overwrite_output_dir=True) is None
    assert list_checkpoints(tmp_path) == []


def test_beside_marked_checkpoints_an_unmarked_one_is_an_unfinished_save(tmp_path, caplog):
    # Killed after every file but before the marker: its files look whole, but the save did not finish.
    good = _checkpoint(tmp_path, 2)
    unfinished = _checkpoint(tmp_path, 4, complete=False)
    assert "its save did not finish" in checkpoint_problem(unfinished)
    assert resolve_resume(tmp_path, "true") == str(good)


def _epoch_orders(epochs, seed=5, first=0, sampler=None):
    """Each epoch's index order from one sampler, ``set_epoch`` called before each (as the Trainer does)."""
    from trl.trainer.utils import RepeatSampler

    from vlm_grpo.trainer import EpochSeededSampler

    sampler = sampler or EpochSeededSampler(RepeatSampler(range(8), mini_repeat_count=2, batch_size=4, seed=seed))
    orders = []
    for epoch in range(first, epochs):
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return orders


def test_each_epoch_is_shuffled_anew_and_a_resumed_run_sees_the_uninterrupted_orders():
    from trl.trainer.utils import RepeatSampler

    uninterrupted = _epoch_orders(4)
    assert len({tuple(o) for o in uninterrupted}) == 4, "every epoch gets its own order"
    assert all(o[::2] == o[1::2] for o in uninterrupted)  # G=2 copies of a prompt stay side by side
    assert sorted(uninterrupted[1][::2]) == list(range(8))
    # epoch 0 is TRL's own order; a run resumed in epoch 2 (a fresh sampler) continues with epochs 2 and 3
    assert uninterrupted[0] == list(RepeatSampler(range(8), mini_repeat_count=2, batch_size=4, seed=5))
    assert _epoch_orders(4, first=2) == uninterrupted[2:]
    assert _epoch_orders(2, seed=6) != uninterrupted[:2]  # the seed matters
    # control: without the reseed (TRL's sampler alone) the resumed run's epoch 2 is not the uninterrupted one's
    from vlm_grpo.trainer import EpochSeededSampler

    class NoReseed(EpochSeededSampler):
        def set_epoch(self, epoch):
            pass

    def plain():
        return NoReseed(RepeatSampler(range(8), mini_repeat_count=2, batch_size=4, seed=5))

    assert _epoch_orders(4, first=2, sampler=plain()) != _epoch_orders(4, sampler=plain())[2:]
