"""Several processes on CPU: DDP over gloo, DeepSpeed ZeRO-2 and ZeRO-3 (torchrun, 2 ranks).

The two-rank runs of this file share ONE torchrun launch (``matrix_dist_entry.py`` runs them in turn in one process
group): the ``runs`` fixture launches the runs the selected tests need; each test reads what its runs left.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Hashable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForImageTextToText

from e2e_utils import base_args, make_dataset, original_params
from test_dynamic_sampling import ds_args
from test_dynamic_sampling import make_data as dynamic_sampling_data
from vlm_grpo.resume import COMPLETE_MARKER, checkpoint_problem

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(script: str, args: list[str], nproc: int) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
        str(REPO / "tests" / script), *args,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)


def torchrun(argv: list[str], nproc: int = 2) -> None:
    """One training run of ``argv`` under torchrun (``dist_entry.py``)."""
    result = _launch("dist_entry.py", argv, nproc)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def torchrun_runs(argvs: dict[Hashable, list[str]], root: Path) -> tuple[dict[Hashable, Path], int, str]:
    """Several training runs, in the dict's order, in ONE 2-process launch (``matrix_dist_entry.py``): each run's
    output folder (its ``--output_dir``), the launch's return code and the end of its log. A run that failed leaves
    ``error<rank>.txt`` in its folder (``ran`` reports it)."""
    outs = {name: Path(argv[argv.index("--output_dir") + 1]) for name, argv in argvs.items()}
    plan = [{"out": str(outs[name]), "argv": argv} for name, argv in argvs.items()]
    (root / "plan.json").write_text(json.dumps(plan))
    result = _launch("matrix_dist_entry.py", [str(root / "plan.json")], 2)
    return outs, result.returncode, result.stdout[-4000:] + result.stderr[-4000:]


def ran(runs: tuple[dict[Hashable, Path], int, str], name: Hashable) -> Path:
    """The output folder of the planned run ``name``, after checking that it finished on both ranks (and that the
    launch ended cleanly where no run failed)."""
    outs, returncode, log = runs
    out = outs[name]
    assert not (out / "error0.txt").exists(), f"{name}: {(out / 'error0.txt').read_text()[-3000:]}"
    assert (out / "rank1.json").is_file(), f"{name} did not finish (rc {returncode}): {log}"
    failed = [o for o in outs.values() if any(o.glob("error*.txt"))]
    assert returncode == 0 or failed, f"the launch failed (rc {returncode}) after every run finished: {log}"
    return out


SHARING_OFF = ["--share_prompt", "false", "--share_prefill", "false"]
COMPILED = ["--compile_layers", "true", "--gradient_checkpointing", "true"]
SAVE = ["--save_strategy", "steps", "--save_steps", "2"]


def _zero(stage: str) -> list[str]:
    return ["--deepspeed", str(REPO / "local_scripts" / f"{stage}.json"), *SAVE]


# The runs each test reads (by test name, and by its ``stage`` parameter where it has one).
NEEDS = {
    "test_ddp_two_ranks_train_together_and_agree": {None: ("ddp", "ddp_plain")},
    "test_ddp_with_text_only_and_image_batches_on_different_ranks": {None: ("mixed",)},
    "test_deepspeed_trains_saves_and_reloads": {"zero2": ("zero2",), "zero3": ("zero3", "zero3_plain")},
    "test_two_nodes_on_loopback_train_like_one_node_with_two_processes": {None: ("one_node",)},
    "test_zero3_ranks_reuse_image_features_together": {None: ("zero3_reuse", "zero3_reuse_off")},
    "test_two_gloo_ranks_agree_on_the_filtered_batch": {None: ("dynamic_sampling",)},
    "test_two_gloo_ranks_whiten_reinforce_plus_plus_over_both_and_share_remax_baselines": {
        None: ("reinforce_plus_plus", "remax")
    },
}
# A frozen tower, a text-only batch on one rank, old-log-prob and reference passes, two micro-batches a generation.
REUSE = ["--freeze_vision_modules", "true", "--steps_per_generation", "2", "--beta", "0.04", "--max_steps", "4"]


ESTIMATORS = ("reinforce_plus_plus", "remax")


def _estimator_args(name: str, model_dir: Path, data: Path, plugin: Path, root: Path) -> list[str]:
    """A run of the advantage estimator ``name`` on the text-shaped reward alone, logging its rollouts."""
    argv = base_args(model_dir, data, plugin, root / name)
    i = argv.index("--reward_funcs")
    argv[i + 1 : i + 3] = [f"{plugin}:text_shape"]
    return [*argv, "--advantage_estimator", name, "--rollout_log", str(root / name / "rollouts.jsonl")]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("dist_data"))


@pytest.fixture(scope="module")
def runs(request, tiny_models, dataset, tmp_path_factory):
    """The selected tests' two-rank runs, DDP ones first (DeepSpeed's ZeRO-3 state must not reach a DDP run), in
    ONE launch: ``name -> output folder``, the launch's return code, the end of its log."""
    root = tmp_path_factory.mktemp("dist_runs")
    data, plugin = dataset
    model_dir = tiny_models["qwen2_5_vl"]
    mixed_data, mixed_plugin = make_dataset(root / "mixed_data", kinds=("single", "text"), n=4)
    ds_data, ds_plugin = dynamic_sampling_data(root / "dynamic_sampling_data")
    single_data, single_plugin = make_dataset(root / "single_data", kinds=("single",))
    argvs = {
        # group sharing on (the default), with the opt-in compiled decoder layers under gradient checkpointing
        "ddp": [*base_args(model_dir, data, plugin, root / "ddp"), *COMPILED],
        "ddp_plain": [*base_args(model_dir, data, plugin, root / "ddp_plain"), *SHARING_OFF],
        "mixed": [*base_args(model_dir, mixed_data, mixed_plugin, root / "mixed"), "--max_steps", "3"],
        "one_node": base_args(model_dir, data, plugin, root / "one_node"),
        "dynamic_sampling": [
            *ds_args(model_dir, ds_data, ds_plugin, root / "dynamic_sampling"),
            "--rollout_log", str(root / "dynamic_sampling" / "rollouts.jsonl"),
        ],
        **{name: _estimator_args(name, model_dir, single_data, single_plugin, root) for name in ESTIMATORS},
        "zero2": [*base_args(model_dir, data, plugin, root / "zero2"), *_zero("zero2"), *COMPILED],
        "zero3": [*base_args(model_dir, data, plugin, root / "zero3"), *_zero("zero3")],  # refuses compiled layers
        "zero3_plain": [*base_args(model_dir, data, plugin, root / "zero3_plain"), *_zero("zero3"), *SHARING_OFF],
        "zero3_reuse": [*base_args(model_dir, mixed_data, mixed_plugin, root / "zero3_reuse"), *_zero("zero3"), *REUSE],
        "zero3_reuse_off": [
            *base_args(model_dir, mixed_data, mixed_plugin, root / "zero3_reuse_off"), *_zero("zero3"), *REUSE,
            "--reuse_vision_features", "false",
        ],
    }  # fmt: skip
    needed = set()
    for item in request.session.items:
        if getattr(item, "module", None) is request.module:
            stage = item.callspec.params.get("stage") if hasattr(item, "callspec") else None
            needed.update(NEEDS.get(item.originalname, {}).get(stage, ()))
    return torchrun_runs({name: argv for name, argv in argvs.items() if name in needed}, root)


def test_ddp_two_ranks_train_together_and_agree(tiny_models, runs):
    out = ran(runs, "ddp")  # group sharing on, compiled decoder layers under gradient checkpointing
    for rank in (0, 1):
        info = json.loads((out / f"rank{rank}.json").read_text())
        assert info == {"world_size": 2, "step": 2}, info  # a real 2-process group, not two solo runs
    rank0, rank1 = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    before = original_params(tiny_models["qwen2_5_vl"])
    assert any(not torch.equal(before[k], rank0[k]) for k in before)

    # The same run with TRL's per-row passes gives the same losses.
    plain = ran(runs, "ddp_plain")
    shared_losses = json.loads((out / "losses0.json").read_text())
    plain_losses = json.loads((plain / "losses0.json").read_text())
    assert len(shared_losses) == 2 and all(step[1] > 0 for step in shared_losses)  # non-zero gradients
    for shared_step, plain_step in zip(shared_losses, plain_losses, strict=True):  # loss, grad_norm, entropy
        assert shared_step == pytest.approx(plain_step, rel=1e-4, abs=1e-6)


def test_ddp_with_text_only_and_image_batches_on_different_ranks(runs):
    """One rank's batch is text-only while the other's has images: TRL's image gather for the
    completions table deadlocked here; multi-process runs turn it off."""
    out = ran(runs, "mixed")
    assert json.loads((out / "rank1.json").read_text()) == {"world_size": 2, "step": 3}


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_trains_saves_and_reloads(stage, tiny_models, runs):
    model_dir = tiny_models["qwen2_5_vl"]
    out = ran(runs, stage)  # ZeRO-2 with compiled layers (ZeRO-3 refuses them), a checkpoint at step 2
    assert json.loads((out / "rank1.json").read_text()) == {"world_size": 2, "step": 2}
    assert (out / "checkpoint-2").is_dir()
    # marked complete after both ranks wrote their DeepSpeed shards: what --resume_from_checkpoint true picks
    assert (out / "checkpoint-2" / COMPLETE_MARKER).is_file() and checkpoint_problem(out / "checkpoint-2") is None
    assert any(p.name.startswith("global_step") for p in (out / "checkpoint-2").iterdir())
    model, info = AutoModelForImageTextToText.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    before = original_params(model_dir)
    after = dict(model.named_parameters())
    changed = [k for k in before if not torch.equal(before[k], after[k].detach())]
    assert changed, "the saved model equals the initial one"
    if stage == "zero3":  # every optimisation on under ZeRO-3 gives the per-row losses
        expected = json.loads((ran(runs, "zero3_plain") / "losses0.json").read_text())
        for shared_step, plain_step in zip(json.loads((out / "losses0.json").read_text()), expected, strict=True):
            assert shared_step == pytest.approx(plain_step, rel=1e-4, abs=1e-6)


def test_zero3_ranks_reuse_image_features_together(runs):
    """Under ZeRO-3 a rank that skipped the tower while another encoded would leave their parameter gathers
    unpaired: the ranks decide each pass together (and skip the dummy image together), and train as without reuse."""
    out, plain = ran(runs, "zero3_reuse"), ran(runs, "zero3_reuse_off")
    vision = [json.loads((out / f"vision{rank}.json").read_text()) for rank in (0, 1)]
    assert vision[0]["reused"] == vision[1]["reused"] > 0, vision  # the same passes reused on both ranks
    assert json.loads((plain / "vision0.json").read_text())["reused"] == 0
    reused = json.loads((out / "losses0.json").read_text())
    for step, plain_step in zip(reused, json.loads((plain / "losses0.json").read_text()), strict=True):
        assert step == pytest.approx(plain_step, rel=1e-4, abs=1e-6)


def _script_torchrun_args(**env: str) -> list[str]:
    """The torchrun flags run_scripts/_common.sh builds from NPROC / NNODES / NODE_RANK / MASTER_* / RDZV_*."""
    clean = {k: v for k, v in os.environ.items() if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "RDZV_ENDPOINT")}
    result = subprocess.run(
        ["bash", "-c", "source run_scripts/_common.sh && torchrun_args"],
        cwd=REPO, env={**clean, "PYTHON": sys.executable, **env}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_the_run_scripts_place_nodes_and_rendezvous():
    assert _script_torchrun_args() == [
        "--nproc_per_node", "1", "--nnodes", "1", "--node_rank", "0", "--master_addr", "127.0.0.1",
        "--master_port", "29500",
    ]  # fmt: skip
    assert _script_torchrun_args(RDZV_ENDPOINT="head:29400", NNODES="4", NPROC="8") == [
        "--nproc_per_node", "8", "--nnodes", "4", "--rdzv_backend", "c10d", "--rdzv_endpoint", "head:29400",
        "--rdzv_id", "vlm-grpo",
    ]  # fmt: skip


def test_two_nodes_on_loopback_train_like_one_node_with_two_processes(tiny_models, dataset, runs, tmp_path):
    """Two torchrun launchers (--nnodes 2, one process each, gloo over loopback), placed by the run scripts'
    own flags: both nodes end with the same weights, equal to a one-node run of two processes."""
    data, plugin = dataset
    model_dir = tiny_models["qwen2_5_vl"]
    one_node = ran(runs, "one_node")

    two_nodes = tmp_path / "two_nodes"
    port = str(_free_port())
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
    launchers = []
    for node in ("0", "1"):
        flags = _script_torchrun_args(NNODES="2", NODE_RANK=node, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        cmd = [sys.executable, "-m", "torch.distributed.run", *flags, str(REPO / "tests" / "dist_entry.py")]
        cmd += base_args(model_dir, data, plugin, two_nodes)
        launchers.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for launcher in launchers:
        output, _ = launcher.communicate(timeout=600)
        assert launcher.returncode == 0, output[-4000:]

    for rank in (0, 1):
        assert json.loads((two_nodes / f"rank{rank}.json").read_text()) == {"world_size": 2, "step": 2}
    node0, node1 = torch.load(two_nodes / "rank0.pt"), torch.load(two_nodes / "rank1.pt")
    single = torch.load(one_node / "rank0.pt")
    assert all(torch.equal(node0[k], node1[k]) for k in node0)
    assert all(torch.equal(node0[k], single[k]) for k in node0)
    before = original_params(model_dir)
    assert any(not torch.equal(before[k], node0[k]) for k in before)  # it trained


def test_two_gloo_ranks_agree_on_the_filtered_batch(runs):
    """Dynamic sampling (``test_dynamic_sampling.py``) on 2 ranks: the same groups dropped and kept on both."""
    out = ran(runs, "dynamic_sampling")
    for rank in (0, 1):
        assert json.loads((out / f"rank{rank}.json").read_text()) == {"world_size": 2, "step": 2}
    rank0, rank1 = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    history = [e for e in json.loads((out / "history0.json").read_text()) if "dynamic_sampling/rounds" in e]
    assert len(history) == 2
    assert sum(e["dynamic_sampling/dropped_groups"] for e in history) > 0  # half the prompts are constant
    assert all(e["dynamic_sampling/kept_groups"] >= 4 and e["dynamic_sampling/filled_groups"] == 0 for e in history)
    # one rollout log per rank; a constant-reward group has zero advantage in every round it was generated
    for name in ("rollouts.jsonl", "rollouts.rank1.jsonl"):
        records = [json.loads(line) for line in (out / name).read_text().splitlines()]
        assert {r["step"] for r in records} == {1, 2} and {r["rank"] for r in records} == {name.count("rank1")}
        assert all(r["advantage"] == 0 for r in records if "Zebra" in r["prompt"])
        assert any(r["advantage"] != 0 for r in records if "Zebra" not in r["prompt"])
    other = [e for e in json.loads((out / "history1.json").read_text()) if "dynamic_sampling/rounds" in e]
    keys = [k for k in history[0] if k.startswith("dynamic_sampling/")]
    assert [[e[k] for k in keys] for e in history] == [[e[k] for k in keys] for e in other]


def _rollouts(out, step):
    records = []
    for name in ("rollouts.jsonl", "rollouts.rank1.jsonl"):
        records += [json.loads(line) for line in (out / name).read_text().splitlines()]
    return [r for r in records if r["step"] == step]


def test_two_gloo_ranks_whiten_reinforce_plus_plus_over_both_and_share_remax_baselines(runs):
    """The advantage estimators (``test_advantages.py``) on 2 ranks: REINFORCE++ whitens over both ranks' rows,
    ReMax's greedy baseline is each group's own."""
    for name in ESTIMATORS:
        out = ran(runs, name)
        rank0, rank1 = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
        assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)  # the ranks trained together
        for step in (1, 2):
            records = _rollouts(out, step)
            assert {r["rank"] for r in records} == {0, 1} and len(records) == 8
            if name == "reinforce_plus_plus":
                # one affine map reward -> advantage for the rows of both ranks: whitened together
                lo, hi = min(records, key=lambda r: r["reward"]), max(records, key=lambda r: r["reward"])
                assert hi["reward"] > lo["reward"], "the rewards do not vary: the test shows nothing"
                scale = (hi["advantage"] - lo["advantage"]) / (hi["reward"] - lo["reward"])
                assert scale > 0
                for r in records:
                    assert r["advantage"] == pytest.approx(
                        lo["advantage"] + scale * (r["reward"] - lo["reward"]), abs=1e-5
                    )
                # negative control: not whitened per rank (each rank's own advantages do not sum to 0)
                assert any(abs(sum(r["advantage"] for r in records if r["rank"] == k)) > 1e-3 for k in (0, 1))
            else:  # one greedy baseline per group: advantage differences are reward differences
                for rank in (0, 1):
                    group = [r for r in records if r["rank"] == rank and r["group"] == 0]
                    for r in group:
                        assert r["advantage"] - group[0]["advantage"] == pytest.approx(
                            r["reward"] - group[0]["reward"], abs=1e-5
                        )
