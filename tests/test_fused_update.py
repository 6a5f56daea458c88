"""The fused update pass (``update_chunk_tokens``) computes the step TRL's micro-batches compute.

Two runs of the same two optimizer steps on a tiny Qwen2.5-VL (float32, plain SGD), one with each micro-batch a
forward + backward of its own (TRL's), one fused: the gradients at every optimizer step and every logged number
(loss, entropy, clip ratios, grad norm, ...) must agree, for each loss type. Rows are TRL's own: shuffled, prompts
with one, two or no images, completions of different lengths; the second step is off-policy (ratios != 1). Controls
move a row into the wrong micro-batch (its loss weighted by another micro-batch's normaliser) and drop a row from a
chunk: the comparison must fail for each.
"""

from __future__ import annotations

import json
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import TrainerCallback
from trl.trainer.utils import split_pixel_values_by_grid, unsplit_pixel_values_by_grid

import vlm_grpo.fastpath.fused_update as fused
from test_group_sharing import make_trainer
from test_multiturn_sharing import scripted_turns
from test_trl_options import _ragged
from vlm_grpo.configs import VLMGRPOConfig
from vlm_grpo.fastpath.fused_update import ForwardCall, merge_calls, plan_chunks, split_to
from vlm_grpo.trainer import VLMGRPOTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GA = 4  # micro-batches per optimizer step
ROWS = 2  # rows per micro-batch (EasyR1's micro-batches are 1-4 rows)
BIG = 1 << 20  # a budget every window fits in one forward


def write_rows(root, text_only: bool):
    """Eight prompts (a generation batch of 2 x 8 rows, num_generations=2): one, two and (``text_only``) no
    images."""
    Image.new("RGB", (64, 48), (200, 30, 30)).save(root / "a.png")
    Image.new("RGB", (56, 90), (30, 30, 200)).save(root / "b.png")

    def row(image, question):
        turns = [{"from": "human", "value": question}, {"from": "gpt", "value": "1"}]
        return {"image": image, "conversations": turns} if image else {"conversations": turns}

    rows = [
        row("a.png", "<image>Red?"),
        row(["a.png", "b.png"], "Compare <image> with <image> and tell which one is larger, please."),
        row("b.png", "How many shapes are in <image>?"),
        row(None if text_only else "a.png", "Count to three."),
        row("b.png", "<image>Blue or red, and why do you think so?"),
        row("a.png", "Describe <image>."),
        row(["b.png", "a.png"], "<image><image>Which is wider?"),
        row(None if text_only else "b.png", "Name a prime number larger than ten."),
    ]
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    return write_rows(tmp_path_factory.mktemp("fused"), text_only=True)


@pytest.fixture(scope="module")
def image_rows_file(tmp_path_factory):
    """Every prompt with images: TRL's per-row pass cannot run a chunk of text-only rows next to image rows."""
    return write_rows(tmp_path_factory.mktemp("fused_images"), text_only=False)


class Grads(TrainerCallback):
    """Every parameter's gradient just before each optimizer step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


class Forwards:
    """Counts the model's forwards with gradients (the update pass's)."""

    def __init__(self, model) -> None:
        self.count = 0
        model.register_forward_pre_hook(self)

    def __call__(self, *_: Any) -> None:
        self.count += torch.is_grad_enabled()


def run(tiny_models, rows_file, tmp_path, budget, setup=None, **overrides):
    """Two optimizer steps on one generation (num_iterations=2: the second is off-policy); ``setup(trainer)`` runs
    before training."""
    args = {
        "max_steps": 2,
        "learning_rate": 0.02,
        "optim": "sgd",
        "logging_steps": 1,
        "max_completion_length": 8,
        "num_generations": 2,
        "per_device_train_batch_size": ROWS,
        "gradient_accumulation_steps": GA,
        "num_iterations": 2,
        "update_chunk_tokens": budget,
        **overrides,
    }
    trainer = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path, **args)
    _ragged(trainer)
    trainer.grads = Grads()
    trainer.add_callback(trainer.grads)
    trainer.forwards = Forwards(trainer.model)
    if setup is not None:
        setup(trainer)
    trainer.train()
    return trainer


def step_logs(trainer) -> list[dict]:
    return [e for e in trainer.state.log_history if "grad_norm" in e]


def assert_same_step(fast, plain, tol=1e-5) -> None:
    assert len(fast.grads.steps) == len(plain.grads.steps) == 2
    for ours, theirs in zip(fast.grads.steps, plain.grads.steps, strict=True):
        assert ours.keys() == theirs.keys()
        for name, g in theirs.items():
            torch.testing.assert_close(ours[name], g, rtol=1e-4, atol=tol, msg=name)
    fast_logs, plain_logs = step_logs(fast), step_logs(plain)
    assert len(fast_logs) == len(plain_logs) == 2
    for ours, theirs in zip(fast_logs, plain_logs, strict=True):
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            if "time" in key:
                continue
            assert ours[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (key, ours[key], value)


@pytest.fixture(scope="module")
def reference(tiny_models, rows_file, tmp_path_factory):
    """TRL's micro-batches, per loss type (built once per module)."""
    cache: dict[str, Any] = {}

    def get(variant: str, **overrides):
        if variant not in cache:
            cache[variant] = run(tiny_models, rows_file, tmp_path_factory.mktemp(variant), None, **overrides)
        return cache[variant]

    return get


LOSS_TYPES = {
    "grpo": {"loss_type": "grpo"},
    "bnpo": {"loss_type": "bnpo"},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "dapo": {"loss_type": "dapo"},
    "cispo": {"loss_type": "cispo"},
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    "sapo": {"loss_type": "sapo"},
    "luspo": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "vespo": {"loss_type": "vespo"},
}


@pytest.mark.parametrize("variant", list(LOSS_TYPES))
def test_fused_step_equals_trls_micro_batches(variant, tiny_models, rows_file, tmp_path, reference):
    plain = reference(variant, **LOSS_TYPES[variant])
    fast = run(tiny_models, rows_file, tmp_path, BIG, **LOSS_TYPES[variant])
    assert_same_step(fast, plain)
    # The update ran GA - 1 micro-batches in one forward and the last one alone, per optimizer step.
    assert fast.fused_update.last_forwards == 1
    assert plain.forwards.count - fast.forwards.count == 2 * (GA - 2), (plain.forwards.count, fast.forwards.count)
    assert all(e["grad_norm"] > 0 for e in step_logs(fast))


@pytest.mark.parametrize(
    "options",
    [
        {"beta": 0.05, "entropy_coef": 0.01},  # the reference model's KL term; the entropy bonus
        {"top_entropy_quantile": 0.5, "share_prompt": False},  # a mask by each micro-batch's entropies; TRL's pass
        {"gradient_checkpointing": True},
        {"steps_per_generation": 2 * GA, "num_iterations": 1},  # two optimizer steps' windows in one buffer
        # The coefficient TRL updates at the optimizer step (sync_gradients) from the whole window's entropy.
        {"use_adaptive_entropy": True, "entropy_coef": 0.01, "entropy_target": 10.0},
    ],
    ids=[
        "kl_entropy_bonus",
        "entropy_mask_per_row_pass",
        "gradient_checkpointing",
        "two_windows_per_generation",
        "adaptive_entropy",
    ],
)
def test_fused_step_with_options(options, tiny_models, rows_file, image_rows_file, tmp_path):
    rows_file = rows_file if options.get("share_prompt", True) else image_rows_file
    plain = run(tiny_models, rows_file, tmp_path / "plain", None, loss_type="bnpo", **options)
    fast = run(tiny_models, rows_file, tmp_path / "fast", BIG, loss_type="bnpo", **options)
    assert_same_step(fast, plain)
    if options.get("use_adaptive_entropy"):  # the option acted: the coefficient moved at the first step
        assert [e["entropy_coef"] for e in step_logs(fast)] == pytest.approx([0.015, 0.02])


def test_fused_step_with_lora(tiny_models, rows_file, tmp_path):
    plain = run(tiny_models, rows_file, tmp_path / "plain", None, loss_type="grpo", lora=True)
    fast = run(tiny_models, rows_file, tmp_path / "fast", BIG, loss_type="grpo", lora=True)
    assert any("lora_" in n for n in fast.grads.steps[0])
    assert_same_step(fast, plain)


def test_fused_step_with_tool_rollouts(tiny_models, image_rows_file, tmp_path):
    """Multi-turn zoom-in rollouts (scripted turns): tool replies and tool images in the completions, masked out of
    the loss by TRL's ``tool_mask``."""
    tools = {
        "trainer_kwargs": {"tools": ["zoom_in"], "tool_kwargs": {"zoom_in": {"size": 56}}},
        "max_completion_length": 600,
        "max_tool_calling_iterations": 3,
    }
    with mock.patch.object(VLMGRPOTrainer, "_generate_single_turn", scripted_turns("qwen2_5_vl")):
        plain = run(tiny_models, image_rows_file, tmp_path / "plain", None, loss_type="bnpo", **tools)
        fast = run(tiny_models, image_rows_file, tmp_path / "fast", BIG, loss_type="bnpo", **tools)
    assert step_logs(fast)[0]["tools/call_frequency"] > 0, step_logs(fast)[0]
    assert fast.fused_update.last_forwards == 1
    assert_same_step(fast, plain)


def test_budget_of_one_token_runs_each_micro_batch_alone(tiny_models, rows_file, tmp_path, reference):
    plain = reference("bnpo", loss_type="bnpo")
    fast = run(tiny_models, rows_file, tmp_path, 1, loss_type="bnpo")
    assert fast.fused_update.last_forwards == GA - 1
    assert fast.forwards.count == plain.forwards.count
    assert_same_step(fast, plain)


# ----------------------------------------------------------------------------- controls
def take_rows(batch: dict[str, Any], rows: list[int]) -> dict[str, Any]:
    """The micro-batch of ``batch``'s ``rows`` (images included), built with TRL's per-row pixel split."""
    split = split_pixel_values_by_grid(batch)
    n = split["prompt_ids"].size(0)
    out = {}
    for key, value in split.items():
        if isinstance(value, list) and len(value) == n:
            out[key] = [value[i] for i in rows]
        elif isinstance(value, torch.Tensor) and value.dim() > 0 and value.size(0) == n:
            out[key] = value[rows]
        else:
            out[key] = value
    return unsplit_pixel_values_by_grid(out)


def concat(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two micro-batches as one (same completion width after padding)."""
    width = max(a["completion_ids"].size(1), b["completion_ids"].size(1))
    p_width = max(a["prompt_ids"].size(1), b["prompt_ids"].size(1))
    sa, sb = split_pixel_values_by_grid(a), split_pixel_values_by_grid(b)
    out = {}
    for key, va in sa.items():
        vb = sb[key]
        if isinstance(va, list):
            out[key] = va + vb
        elif not isinstance(va, torch.Tensor) or va.dim() == 0:
            out[key] = va
        elif va.dim() == 2 and (va.size(1), vb.size(1)) == (a["prompt_ids"].size(1), b["prompt_ids"].size(1)):
            out[key] = torch.cat([F.pad(v, (p_width - v.size(1), 0)) for v in (va, vb)])
        elif va.dim() == 2 and (va.size(1), vb.size(1)) == (a["completion_ids"].size(1), b["completion_ids"].size(1)):
            out[key] = torch.cat([F.pad(v, (0, width - v.size(1))) for v in (va, vb)])
        elif va.dim() == 2 and va.size(1) == a["prompt_ids"].size(1) + a["completion_ids"].size(1):  # per token
            parts = [(v[:, : m["prompt_ids"].size(1)], v[:, m["prompt_ids"].size(1) :]) for v, m in ((va, a), (vb, b))]
            out[key] = torch.cat(
                [
                    torch.cat([F.pad(head, (p_width - head.size(1), 0)), F.pad(tail, (0, width - tail.size(1)))], 1)
                    for head, tail in parts
                ]
            )
        else:
            out[key] = torch.cat([va, vb])
    return unsplit_pixel_values_by_grid(out)


def _broken_window(change):
    real = fused.run_window

    def run_window(trainer, model, micro_batches, loss_fn, budget):
        advantages = [mb["advantages"] for mb in micro_batches]
        window = real(trainer, model, change(list(micro_batches)), loss_fn, budget)
        window.advantages = advantages  # the hand-over check stays quiet: only the numbers may tell
        return window

    return mock.patch.object(fused, "run_window", run_window)


def _row_moved(mbs):
    """Micro-batch 0's last row counted in micro-batch 1: its loss weighted by micro-batch 1's normaliser."""
    n = mbs[0]["prompt_ids"].size(0)
    moved = take_rows(mbs[0], [n - 1])
    return [take_rows(mbs[0], list(range(n - 1))), concat(moved, mbs[1]), *mbs[2:]]


def _row_dropped(mbs):
    n = mbs[1]["prompt_ids"].size(0)
    return [mbs[0], take_rows(mbs[1], list(range(n - 1))), *mbs[2:]]


@pytest.mark.parametrize("change", [_row_moved, _row_dropped], ids=["wrong_normaliser", "dropped_row"])
def test_controls_fail(change, tiny_models, rows_file, tmp_path, reference):
    plain = reference("bnpo", loss_type="bnpo")
    with _broken_window(change):
        broken = run(tiny_models, rows_file, tmp_path, BIG, loss_type="bnpo")
    with pytest.raises(AssertionError):
        assert_same_step(broken, plain)


# ----------------------------------------------------------------------------- the plan
def call(rows: int, prompt: int, completion: int) -> ForwardCall:
    ids = torch.ones(rows, prompt + completion, dtype=torch.long)
    return ForwardCall(ids, ids.clone(), completion, {})


def test_plan_keeps_chunks_within_the_budget():
    calls = [call(2, 10, 5), call(2, 8, 7), call(4, 3, 2)]
    # The rows' own tokens (the packed pass): 30 + 30 + 20.
    assert plan_chunks(calls, 60) == [[0, 1], [2]]  # at the budget: one forward
    assert plan_chunks(calls, 59) == [[0], [1, 2]]  # a token under it: the first alone
    assert plan_chunks(calls, 80) == [[0, 1, 2]]
    assert plan_chunks(calls, 79) == [[0, 1], [2]]
    # TRL's padded pass: rows x (longest prompt + longest completion); the first two: 4 x (10 + 7).
    assert plan_chunks(calls, 68, padded=True) == [[0, 1], [2]]
    assert plan_chunks(calls, 67, padded=True) == [[0], [1], [2]]  # then 6 x (8 + 7) = 90: over it too
    assert plan_chunks(calls, 8 * 17, padded=True) == [[0, 1, 2]]
    assert plan_chunks(calls, 8 * 17 - 1, padded=True) == [[0, 1], [2]]
    assert plan_chunks([call(4, 100, 100)], 10) == [[0]]  # over the budget alone: a forward of its own
    assert split_to([[0, 1, 2], [3]], 3) == [[0], [1, 2], [3]]
    with pytest.raises(ValueError, match="cannot cut"):
        split_to([[0], [1]], 3)


def test_merge_pads_prompts_left_and_completions_right():
    a = ForwardCall(torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 1, 1, 1]]), 1, {"num_images": [1]})
    b = ForwardCall(torch.tensor([[5, 6, 7]]), torch.tensor([[1, 1, 1]]), 2, {"num_images": [0]})
    m = merge_calls([a, b], pad_id=0)
    assert m.logits_to_keep == 2
    assert m.input_ids.tolist() == [[1, 2, 3, 4, 0], [0, 0, 5, 6, 7]]
    assert m.attention_mask.tolist() == [[1, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert m.mm == {"num_images": [1, 0]}


def test_config_refuses_a_budget_under_one(tmp_path):
    with pytest.raises(ValueError, match="update_chunk_tokens=0"):
        VLMGRPOConfig(output_dir=str(tmp_path), update_chunk_tokens=0)
    assert VLMGRPOConfig(output_dir=str(tmp_path), update_chunk_tokens=1).update_chunk_tokens == 1


def test_train_window_compares_micro_batches_with_the_fused_update(tmp_path, monkeypatch):
    """benchmarks/micro/train_window.py --micro_batch: both ways timed on the same micro-batches, the fused one with
    fewer forwards and fewer torch ops per window (what a GPU launches)."""
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("_train_window", bench / "micro" / "train_window.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "_train_window", module)
    spec.loader.exec_module(module)
    monkeypatch.chdir(tmp_path)
    result = module.main(
        ["--preset", "tiny", "--device", "cpu", "--repeats", "1", "--warmup", "0", "--num_generations", "2",
         "--prompts_per_step", "4", "--micro_batch", "2", "--completion_length", "6", "--trainer",
         "ours:compile_layers=false", "--update_chunk_tokens", "100000"]
    )  # fmt: skip
    assert result["micro_batches"] == 4 and result["rows"] == 8
    counts = result["per_window"]
    assert counts["micro"]["forwards"] == 4 and counts["fused"]["forwards"] == 2  # three fused, the last alone
    assert counts["fused"]["leaf_ops"] < counts["micro"]["leaf_ops"]
    assert all(len(t) == 1 and t[0] > 0 for t in result["times_s"].values())


@pytest.mark.slow
def test_ddp_fused_step_all_reduces_once_and_equals_trls(tiny_models, tmp_path):
    """2 ranks (gloo): each rank's plan needs its own number of forwards (its rows differ), the ranks run the same
    number; DDP all-reduces only in the optimizer step's last micro-step (no_sync before), as with TRL's
    micro-batches; gradients and logs equal TRL's on every rank."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
        "--master_port", str(port), str(tests / "fused_dist_entry.py"), str(tiny_models["qwen2_5_vl"]),
        str(tmp_path), "85",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{tests.parent / 'src'}{os.pathsep}{tests}", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tests)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["fused"]["planned"] != ranks[1]["fused"]["planned"], "the ranks' own plans should differ"
    for rank, info in enumerate(ranks):
        plain, fast = info["plain"], info["fused"]
        assert plain["world"] == fast["world"] == 2
        assert plain["allreduce_steps"] == fast["allreduce_steps"] and set(fast["allreduce_steps"]) == {3, 7}
        assert fast["last_forwards"] == max(r["fused"]["planned"] for r in ranks)  # the ranks agreed
        for ours, theirs in zip(fast["logs"], plain["logs"], strict=True):
            for key in ("loss", "grad_norm", "entropy"):
                assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), (rank, key)
        for ours, theirs in zip(
            *(torch.load(tmp_path / f"{n}_grads{rank}.pt") for n in ("fused", "plain")), strict=True
        ):
            for name, g in theirs.items():
                torch.testing.assert_close(ours[name], g, rtol=1e-4, atol=1e-5, msg=name)


def _stub(**changes):
    """What fused_update_reason reads of a trainer: a run that can fuse, with ``changes``."""
    from types import SimpleNamespace

    args = {"gradient_accumulation_steps": 4, "steps_per_generation": 8, "n_gpu": 1, "optim": "adamw_torch"}
    args.update({k: v for k, v in changes.items() if k in args})
    own = {"is_deepspeed_enabled": False, "is_fsdp_enabled": False, "aux_loss_enabled": False}
    own.update({k: v for k, v in changes.items() if k in own})
    return SimpleNamespace(args=SimpleNamespace(update_chunk_tokens=64, **args), **own)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"gradient_accumulation_steps": 1, "steps_per_generation": 1}, "nothing to fuse"),
        ({"steps_per_generation": 6}, "steps_per_generation=6 is not a multiple of gradient_accumulation_steps=4"),
        ({"is_deepspeed_enabled": True}, "DeepSpeed"),
        ({"is_fsdp_enabled": True}, "FSDP"),
        ({"n_gpu": 2}, "DataParallel"),
        ({"aux_loss_enabled": True}, "router's auxiliary loss"),
        ({"optim": "adalomo"}, "LOMO"),
    ],
)
def test_what_cannot_be_fused_runs_trls_steps_with_one_info_line(changes, reason, caplog):
    with caplog.at_level("INFO", logger="vlm_grpo.fastpath.fused_update"):
        update = fused.FusedUpdate(_stub(**changes))
    assert not update.enabled
    assert [r.getMessage() for r in caplog.records] == [
        f"update_chunk_tokens: the update pass runs TRL's micro-batches one by one: {update.reason}"
    ]
    assert reason in update.reason
    trainer = _stub(**changes)
    trainer.model = mock.Mock(training=True)
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    assert update.loss(trainer, None, {}, None, None) is None  # TRL's compute_loss runs
    assert fused.FusedUpdate(_stub()).enabled  # the control: the same run without the change fuses
