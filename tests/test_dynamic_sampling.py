"""DAPO dynamic sampling: groups with constant rewards never reach the loss, the batch is refilled from
further prompts, the loss is the kept groups' own, and resume continues the further-prompt stream."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import trl
from PIL import Image

from e2e_utils import base_args
from vlm_grpo.dynamic_sampling import keep_groups, merge_batches
from vlm_grpo.grpo_jsonl import main, parse_args
from vlm_grpo.resume import mark_complete

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Constant on "Zebra" prompts (all right: zero spread); elsewhere a function of the text (distinct texts differ).
PLUGIN = """
import zlib

from vlm_grpo.rewards import completion_text


def flat_or_varied(completions, question, **kwargs):
    texts = [completion_text(c) for c in completions]
    return [1.0 if "Zebra" in q else float(zlib.crc32(t.encode())) / 2**32 for q, t in zip(question, texts)]
"""


def test_the_private_trl_names_it_overrides_still_exist():
    from vlm_grpo.dynamic_sampling import PRIVATE_NAMES
    from vlm_grpo.fastpath.contract import check

    assert [problem for entry in PRIVATE_NAMES if (problem := check(entry))] == []


def test_keep_groups_by_spread_and_by_bounds():
    nan = float("nan")
    rewards = torch.tensor(
        [[1, 0], [1, 0], [1, 0], [0, 0], [0, 1], [1, 1], [nan, nan], [nan, nan], [0.5, nan], [0.5, 0.5]]
    ).float()  # 5 groups of 2, two reward functions
    weights = torch.tensor([1.0, 1.0])
    names = ["acc", "fmt"]
    # weighted sums per group: (1,1) (1,0) (1,2) (nan,nan) (0.5,1.0)
    assert keep_groups(rewards, weights, 2, names).tolist() == [False, True, True, False, True]
    # EasyR1 filter: group mean of 'acc' strictly inside (0.01, 0.99): (1,1)->1 (1,0)->.5 (0,1)->.5 nan .5
    assert keep_groups(rewards, weights, 2, names, "acc", 0.01, 0.99).tolist() == [False, True, True, False, True]
    assert keep_groups(rewards, weights, 2, names, "overall", 0.6, 2.0).tolist() == [True, False, True, False, True]


def test_merge_repads_prompts_left_completions_right_and_joins_images():
    a = {
        "prompt_ids": torch.tensor([[5, 6]]),
        "prompt_mask": torch.tensor([[1, 1]]),
        "completion_ids": torch.tensor([[7, 8, 9]]),
        "completion_mask": torch.tensor([[1, 1, 1]]),
        "advantages": torch.tensor([0.5]),
        "mm_token_type_ids": torch.tensor([[1, 0, 0, 0, 0]]),
        "pixel_values": [torch.ones(4, 3)],
        "image_grid_thw": [torch.tensor([[1, 2, 2]])],
        "num_images": [1],
    }
    b = {  # a text-only round: no image fields at all
        "prompt_ids": torch.tensor([[1, 2, 3]]),
        "prompt_mask": torch.tensor([[1, 1, 1]]),
        "completion_ids": torch.tensor([[4]]),
        "completion_mask": torch.tensor([[1]]),
        "advantages": torch.tensor([-0.5]),
    }
    merged = merge_batches([a, b], pad_token_id=0)
    assert merged["prompt_ids"].tolist() == [[0, 5, 6], [1, 2, 3]]
    assert merged["prompt_mask"].tolist() == [[0, 1, 1], [1, 1, 1]]
    assert merged["completion_ids"].tolist() == [[7, 8, 9], [4, 0, 0]]
    assert merged["completion_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert merged["mm_token_type_ids"].tolist() == [[0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]
    assert merged["advantages"].tolist() == [0.5, -0.5]
    assert merged["num_images"] == [1, 0]
    assert [p.shape[0] for p in merged["pixel_values"]] == [4, 0]
    assert [g.shape[0] for g in merged["image_grid_thw"]] == [1, 0]
    assert next(iter(merged)) == "prompt_ids"  # TRL sizes the batch by the first field


def make_data(root: Path, flat: int = 3, varied: int = 3) -> tuple[Path, Path]:
    (root / "images").mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (56, 56), (200, 40, 40)).save(root / "images" / "a.png")
    rows = [{"problem": f"<image>Zebra question {i}?", "answer": "1", "images": ["a.png"]} for i in range(flat)]
    rows += [{"problem": f"<image>What is shown {i}?", "answer": "2", "images": ["a.png"]} for i in range(varied)]
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plugin = root / "ds_rewards.py"
    plugin.write_text(PLUGIN)
    return data, plugin


def ds_args(model: Path, data: Path, plugin: Path, out: Path, steps: int = 2) -> list[str]:
    argv = base_args(model, data, plugin, out, steps=steps)
    i = argv.index("--reward_funcs")
    argv[i + 1 : i + 3] = [f"{plugin}:flat_or_varied"]
    argv[argv.index("--per_device_train_batch_size") + 1] = "8"  # 2 groups of 4 per step
    return [*argv, "--dynamic_sampling", "true", "--max_sampling_rounds", "6", "--loss_type", "dapo"]


def test_constant_groups_never_reach_the_loss_and_the_loss_is_the_kept_groups_own(tiny_models, tmp_path, monkeypatch):
    data, plugin = make_data(tmp_path)
    rounds: list[dict] = []  # every round of TRL's generation and scoring, before any filtering
    merged: list[dict] = []  # what the trainer hands on towards the loss
    original = trl.GRPOTrainer._generate_and_score_completions

    def record_round(self, inputs):
        out = original(self, inputs)
        rounds.append({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in out.items()})
        return out

    import vlm_grpo.trainer as recipe  # the recipe imports the trainer class when it runs

    class Recording(recipe.VLMGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            merged.append(out)
            return out

    monkeypatch.setattr(trl.GRPOTrainer, "_generate_and_score_completions", record_round)
    monkeypatch.setattr(recipe, "VLMGRPOTrainer", Recording)
    trainer = main(*parse_args(ds_args(tiny_models["qwen2_5_vl"], data, plugin, tmp_path / "out")))
    assert trainer.state.global_step == 2
    tok = trainer.processing_class.tokenizer

    def is_flat(batch: dict, row: int) -> bool:
        return "Zebra" in tok.decode(batch["prompt_ids"][row][batch["prompt_mask"][row].bool()])

    # Nothing from a constant-reward prompt in what trains; every batch full (2 groups of 4).
    for batch in merged:
        assert batch["prompt_ids"].shape[0] == 8
        assert not any(is_flat(batch, r) for r in range(8))
    flat_rounds = sum(is_flat(r, 0) or is_flat(r, 4) for r in rounds)
    assert flat_rounds > 0, "the data never produced a constant group: the test shows nothing"
    logged = [e for e in trainer.state.log_history if "dynamic_sampling/kept_groups" in e]
    assert len(logged) == 2
    dropped = sum(e["dynamic_sampling/dropped_groups"] for e in logged)
    assert dropped == sum(is_flat(r, 0) + is_flat(r, 4) for r in rounds)
    assert all(e["dynamic_sampling/filled_groups"] == 0 for e in logged)
    assert sum(e["dynamic_sampling/rounds"] for e in logged) == len(rounds)

    # The loss of the first merged batch equals the loss of its kept groups taken straight from the rounds:
    # gradients of the merged batch == sum of the per-group gradients normalised by the kept tokens.
    first_step_rounds = rounds[: int(logged[0]["dynamic_sampling/rounds"])]
    kept_groups = [(r, g) for r in first_step_rounds for g in (0, 1) if not is_flat(r, 4 * g)][
        :2
    ]  # the first two groups with varied rewards, in the order they were generated
    n_tokens = sum(int(r["completion_mask"][4 * g : 4 * g + 4].sum()) for r, g in kept_groups)
    assert int(merged[0]["num_items_in_batch"]) == n_tokens

    model = trainer.model
    params = [p for p in model.parameters() if p.requires_grad]

    def grads(batch: dict) -> list[torch.Tensor]:
        model.zero_grad()
        trainer._compute_loss(model, batch).backward()
        return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]

    expected = [torch.zeros_like(p) for p in params]
    for r, g in kept_groups:
        part = group_slice(r, 4 * g, 4)
        part["num_items_in_batch"] = torch.tensor(n_tokens)
        expected = [e + x for e, x in zip(expected, grads(part), strict=True)]
    got = grads(merged[0])
    assert sum(float(e.abs().sum()) for e in expected) > 0
    for e, x in zip(expected, got, strict=True):
        torch.testing.assert_close(x, e, rtol=1e-4, atol=1e-7)


def group_slice(batch: dict, start: int, size: int) -> dict:
    """Rows [start, start+size) of one TRL generation output (one image per row here)."""
    rows = slice(start, start + size)
    out = {}
    per_image = batch["image_grid_thw"].prod(-1).tolist()
    offset = sum(per_image[:start])
    for key, value in batch.items():
        if key == "pixel_values":
            out[key] = value[offset : offset + sum(per_image[rows])]
        elif key == "num_images":
            out[key] = value[rows]
        elif isinstance(value, torch.Tensor) and value.ndim >= 1:
            out[key] = value[rows]
        else:
            out[key] = value
    # left padding the group alone does not need
    keep = out["prompt_mask"].any(dim=0)
    for key in ("prompt_ids", "prompt_mask"):
        out[key] = out[key][:, keep]
    if "mm_token_type_ids" in out:
        width = batch["prompt_ids"].shape[1]
        out["mm_token_type_ids"] = torch.cat(
            [out["mm_token_type_ids"][:, :width][:, keep], out["mm_token_type_ids"][:, width:]], 1
        )
    return out


def test_resume_continues_the_further_prompt_stream(tiny_models, tmp_path):
    data, plugin = make_data(tmp_path)
    model = tiny_models["qwen2_5_vl"]
    save = ["--save_strategy", "steps", "--save_steps", "2"]
    full = main(*parse_args(ds_args(model, data, plugin, tmp_path / "full", steps=4) + save))
    state = json.loads((tmp_path / "full" / "checkpoint-2" / "dynamic_sampling.json").read_text())
    assert state["cursor"] > 0  # the first two steps drew further prompts
    # written before the completion marker (listed in it): a kill between the two cannot leave a "complete"
    # checkpoint whose resume restarts the further-prompt stream
    marker = json.loads((tmp_path / "full" / "checkpoint-2" / "checkpoint_complete.json").read_text())
    assert "dynamic_sampling.json" in marker["files"]

    def resumed(name: str, keep_state: bool):
        out = tmp_path / name
        shutil.copytree(tmp_path / "full" / "checkpoint-2", out / "checkpoint-2")
        if not keep_state:  # a checkpoint without the position (marked again, as one whole without it)
            (out / "checkpoint-2" / "dynamic_sampling.json").unlink()
            mark_complete(out / "checkpoint-2")
        argv = ds_args(model, data, plugin, out, steps=4) + save + ["--resume_from_checkpoint", "true"]
        return dict(main(*parse_args(argv)).model.named_parameters())

    expected = dict(full.model.named_parameters())
    same = resumed("resumed", keep_state=True)
    for name, param in same.items():
        torch.testing.assert_close(param, expected[name], rtol=0, atol=0, msg=f"{name} differs after resume")
    # control: without the saved position the further prompts differ, and so do the weights
    other = resumed("restarted_stream", keep_state=False)
    assert any(not torch.equal(other[n], expected[n]) for n in expected)


def test_gradient_accumulation_fills_every_micro_batch_from_kept_groups(tiny_models, tmp_path, monkeypatch):
    data, plugin = make_data(tmp_path)
    import vlm_grpo.trainer as recipe  # the recipe imports the trainer class when it runs

    seen: list[dict] = []

    class Recording(recipe.VLMGRPOTrainer):
        def _compute_loss(self, model, inputs):
            seen.append(inputs)
            return super()._compute_loss(model, inputs)

    monkeypatch.setattr(recipe, "VLMGRPOTrainer", Recording)
    argv = ds_args(tiny_models["qwen2_5_vl"], data, plugin, tmp_path / "out")
    argv[argv.index("--per_device_train_batch_size") + 1] = "4"
    trainer = main(*parse_args([*argv, "--gradient_accumulation_steps", "2"]))
    assert trainer.state.global_step == 2 and len(seen) == 4  # 2 steps x 2 micro-batches of 4 rows
    tok = trainer.processing_class.tokenizer
    for batch in seen:
        assert batch["prompt_ids"].shape[0] == 4
        texts = [
            tok.decode(ids[mask.bool()]) for ids, mask in zip(batch["prompt_ids"], batch["prompt_mask"], strict=True)
        ]
        assert not any("Zebra" in t for t in texts)


def test_when_rounds_run_out_dropped_groups_fill_the_batch_and_it_is_logged(tiny_models, tmp_path, caplog):
    data, plugin = make_data(tmp_path, flat=3, varied=0)  # every group constant: nothing can be kept
    argv = ds_args(tiny_models["qwen2_5_vl"], data, plugin, tmp_path / "out", steps=1)
    argv[argv.index("--max_sampling_rounds") + 1] = "2"
    with caplog.at_level("WARNING", logger="vlm_grpo.dynamic_sampling"):
        trainer = main(*parse_args(argv))
    assert trainer.state.global_step == 1
    (entry,) = [e for e in trainer.state.log_history if "dynamic_sampling/rounds" in e]
    assert entry["dynamic_sampling/rounds"] == 2 and entry["dynamic_sampling/kept_groups"] == 0
    assert entry["dynamic_sampling/dropped_groups"] == 4 and entry["dynamic_sampling/filled_groups"] == 2
    assert "2 group(s) still missing after max_sampling_rounds=2" in caplog.text
