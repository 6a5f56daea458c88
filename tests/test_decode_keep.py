"""keep_decode_graphs: the decode workspace (static cache, buffers, one step per attention window and, on a GPU,
its CUDA graph) and the fused weights kept from one generation call to the next.

CPU has no graphs, so these tests take the windowed path without them (as ``test_decode_windows`` does) and
check what a replayed graph depends on: the kept steps are the ones that run again (no new step, so no new
capture), the fused copy is refilled in place from the live weights (training changes them between calls), and
anything a graph bakes in that changes (a module's mode, a parameter's address, the batch's rows, a longer
decode) makes a new workspace. Tokens stay generate's throughout.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

import test_decode_speed
import test_group_sharing
from test_decode_speed import _decode, _tiny_qwen
from test_decode_windows import _windows_on
from test_group_sharing import _generate_both, make_trainer
from vlm_grpo.fastpath import decode, decode_fusion, decode_keep, decode_mlp
from vlm_grpo.utils import peft_base

pytestmark = pytest.mark.usefixtures("one_torch_thread")
rows_file = test_group_sharing.rows_file  # the fixture: two rows, one and two images


def _kept(model) -> decode._Workspace | None:
    return decode._KEPT.get(peft_base(model).get_decoder())


def _fused_pointers(model) -> list[int]:
    """Addresses of the kept fused copies of ``model``'s decoder."""
    plans = decode_fusion._PLANS[peft_base(model).get_decoder()]
    return [g.kept[0].data_ptr() for plan in plans.values() for g in plan[0] if g.kept is not None]


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_kept_steps_run_again_for_every_prompt_length_that_fits(compile, tiny_models, monkeypatch):
    """Prompts of 20 and 18 tokens need the same cache and windows: the second call makes no step (on a GPU: no
    capture) and reuses the workspace. A 31-token prompt needs a longer cache: a new workspace, kept from then on;
    a 29-token prompt passes through the same windows (no step made); a 20-token prompt fits its cache too, and
    makes only the steps of its own windows. Compiled, the kept steps recompile nothing."""
    from torch._dynamo.utils import counters

    seen = _windows_on(monkeypatch, window=4, bucket=8, spy_scores=not compile)
    if compile:
        monkeypatch.setattr(decode, "_compiled_forward", None)
        torch._dynamo.reset()
    model = _tiny_qwen(tiny_models)
    counters.clear()
    made, spaces, graphs = [], [], []
    for length in (20, 18, 31, 29, 20):
        ours, plain = _decode(model, length, compile=compile, keep=True)
        assert ours == plain, length
        assert len({t for row in ours for t in row}) > 2
        made.append(len(seen["masks"]))
        spaces.append(_kept(model))
        graphs.append(counters["stats"]["unique_graphs"])
    assert made[0] >= 2, made  # the first call crossed windows
    assert made[1] == made[0], made  # 18 tokens: the kept steps, none made
    assert spaces[1] is spaces[0] and spaces[2] is not spaces[0] and spaces[3] is spaces[4] is spaces[2]
    assert spaces[2].slots > spaces[0].slots
    assert made[3] == made[2], made  # 29 tokens: windows 32 and 36, as for 31
    assert made[4] == made[3] + made[0], made  # 20 tokens: windows 20 and 24, new in this workspace
    if compile:
        assert graphs[1] == graphs[0] and graphs[3] == graphs[2], graphs


def test_not_kept_makes_every_step_again(tiny_models, monkeypatch):
    """Control for the test above: keep=False makes new steps at every call and keeps nothing."""
    seen = _windows_on(monkeypatch, window=4, bucket=8)
    model = _tiny_qwen(tiny_models)
    _decode(model, 20, compile=False, keep=False)
    first = len(seen["masks"])
    ours, plain = _decode(model, 18, compile=False, keep=False)
    assert ours == plain and len(seen["masks"]) == 2 * first
    assert _kept(model) is None
    assert _fused_pointers(model) == []  # the fused copy is freed after each call


@pytest.mark.parametrize("refresh", [True, False], ids=["refilled", "control_stale_copy"])
def test_a_kept_fused_copy_is_refilled_from_the_live_weights(refresh, tiny_models, monkeypatch):
    """Between two calls the weights change in place, as an optimizer step changes them. The kept fused copy is
    refilled in the same storage (the address a kept graph reads), so the second call decodes with the new
    weights: generate's tokens. The control leaves the kept copy as it was and must decode the old model."""
    _windows_on(monkeypatch, window=4, bucket=8)
    model = _tiny_qwen(tiny_models)
    before, _ = _decode(model, 20, compile=False, keep=True)
    pointers = _fused_pointers(model)
    assert pointers
    if not refresh:
        build = decode_fusion._Group.build

        def stale(self, dtype=None, keep=False):
            if keep and self.kept is not None:
                self.weight, self.bias = self.kept  # the kept copy as the last call left it
            else:
                build(self, dtype, keep)

        monkeypatch.setattr(decode_fusion._Group, "build", stale)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "up_proj.weight", "gate_proj.weight")):
                p.add_(torch.randn(p.shape, generator=g) * p.std())
    after, plain = _decode(model, 20, compile=False, keep=True)
    assert _fused_pointers(model) == pointers  # the same storage, refilled
    assert plain != before  # the change moves generate's tokens
    assert (after == plain) == refresh


def test_a_call_not_kept_leaves_the_kept_state_alone_and_the_default_frees_it(tiny_models, monkeypatch):
    """keep=False between kept calls (another generation with other settings) neither uses nor frees what is
    kept: the next kept call reuses it. keep=None where it would not keep (here: no CUDA graph) frees it."""
    seen = _windows_on(monkeypatch, window=4, bucket=8)
    model = _tiny_qwen(tiny_models)
    _decode(model, 20, compile=False, keep=True)
    first, pointers, made = _kept(model), _fused_pointers(model), len(seen["masks"])
    ours, plain = _decode(model, 20, compile=False, keep=False)
    assert ours == plain and _kept(model) is first and _fused_pointers(model) == pointers
    assert len(seen["masks"]) == 2 * made  # the call not kept made steps of its own
    _decode(model, 20, compile=False, keep=True)
    assert _kept(model) is first and len(seen["masks"]) == 2 * made  # the kept steps again
    ours, plain = _decode(model, 20, compile=False, keep=None)
    assert ours == plain and _kept(model) is None and _fused_pointers(model) == []


def test_what_a_graph_bakes_in_makes_a_new_workspace(tiny_models, monkeypatch):
    """A kept workspace is used again only while its graphs would be right: a module's train / eval mode, a
    parameter moved to new memory (ZeRO-3 gathers, model.to), the MLP kernels' settings or another number of rows
    each make a new one."""
    _windows_on(monkeypatch, window=4, bucket=8)
    model = _tiny_qwen(tiny_models)
    _decode(model, 20, compile=False, keep=True)
    first = _kept(model)
    _decode(model, 20, compile=False, keep=True)
    assert _kept(model) is first

    model.train()
    ours, plain = _decode(model, 20, compile=False, keep=True)
    assert ours == plain and _kept(model) is not first  # the tiny model has no dropout: same tokens
    model.eval()
    _decode(model, 20, compile=False, keep=True)
    second = _kept(model)
    assert second is not first

    norm = peft_base(model).get_decoder().norm
    norm.weight.data = norm.weight.data.clone()  # same values, new address
    _decode(model, 20, compile=False, keep=True)
    third = _kept(model)
    assert third is not second

    monkeypatch.setattr(decode_mlp, "DOWN_SLICES", 1)  # a setting the MLP kernels' launches bake in
    _decode(model, 20, compile=False, keep=True)
    assert _kept(model) is not third
    third = _kept(model)

    monkeypatch.setattr(decode_keep, "pointers", lambda decoder, head: ())  # control: addresses not checked
    _decode(model, 20, compile=False, keep=True)
    fourth = _kept(model)
    norm.weight.data = norm.weight.data.clone()
    _decode(model, 20, compile=False, keep=True)
    assert _kept(model) is fourth


def test_the_trainer_keeps_the_workspace_between_generation_calls(tiny_models, rows_file, tmp_path, monkeypatch):
    """Through the trainer (keep_decode_graphs=True): a repeat batch replays the kept steps. Tokens stay
    generate's."""
    seen = _windows_on(monkeypatch, window=4, bucket=256)
    trainer = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path, max_completion_length=8,
                           keep_decode_graphs=True)  # fmt: skip
    trainer.generation_config.do_sample = False
    trainer.generation_config.min_new_tokens = trainer.generation_config.max_new_tokens
    trainer.generation_config.repetition_penalty = 5.0
    made, spaces = [], []
    for _ in range(2):
        ours, plain, used = _generate_both(trainer, monkeypatch)
        assert used == ["fast"] and ours == plain
        made.append(len(seen["masks"]))
        spaces.append(_kept(trainer.model))
    assert made[1] == made[0] >= 1 and spaces[1] is spaces[0] is not None  # the repeat made no step


def test_another_number_of_rows_makes_a_new_workspace(tiny_models, monkeypatch):
    """Dynamic sampling's top-ups or a smaller last batch decode another number of rows: a workspace of its own."""
    _windows_on(monkeypatch, window=4, bucket=8)
    model = _tiny_qwen(tiny_models)
    _decode(model, 20, compile=False, keep=True)
    first = _kept(model)
    monkeypatch.setattr(test_decode_speed, "G", 3)
    ours, plain = _decode(model, 20, compile=False, keep=True)
    assert ours == plain and len(ours) == 6
    assert _kept(model) is not first and _kept(model).tokens.size(0) == 6


def test_keep_by_default_takes_at_most_a_tenth_of_the_card(monkeypatch, caplog):
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * gib))
    cuda = torch.device("cuda", 0)
    assert decode_keep.keep_by_default(True, cuda, 5 * gib)
    assert not decode_keep.keep_by_default(False, cuda, 1)  # no graph: nothing worth keeping
    with caplog.at_level(logging.INFO, logger=decode_keep.logger.name):
        assert not decode_keep.keep_by_default(True, cuda, 9 * gib)
    assert "9.0 GiB" in caplog.text and "keep_decode_graphs=True" in caplog.text


def test_keep_is_refused_under_zero3_and_off_there_by_default():
    assert decode_keep.resolve_keep_decode_graphs(None, sharded=True) is False
    assert decode_keep.resolve_keep_decode_graphs(None, sharded=False) is None
    assert decode_keep.resolve_keep_decode_graphs(False, sharded=False) is False
    with pytest.raises(ValueError, match="keep_decode_graphs=True does not work with DeepSpeed ZeRO-3"):
        decode_keep.resolve_keep_decode_graphs(True, sharded=True)
