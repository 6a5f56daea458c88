"""Advantage estimators (``--advantage_estimator``): each against numbers worked out by hand from its paper's
definition, through the trainer on both generation paths, and the loss of the speed path at parity with TRL's
per-row pass on the same batch."""

from __future__ import annotations

import json
import math

import pytest
import torch
from PIL import Image
from trl import GRPOTrainer

from vlm_grpo.advantages import reinforce_plus_plus_advantages, remax_advantages, rloo_advantages
from vlm_grpo.configs import VLMGRPOConfig
from vlm_grpo.data import prepare_rows, read_rows, to_datasets
from vlm_grpo.data.deferred import decode_pending
from vlm_grpo.modules import get_vlm_module
from vlm_grpo.trainer import VLMGRPOTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")
NAN = float("nan")
G = 3


def test_rloo_is_the_reward_minus_the_mean_of_the_other_samples():
    # group 1: baselines 1/3, 2/3, 2/3, 1/3; group 2: (1+2)/2, (3+2)/2, (3+1)/2, and an unscored sample
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 2.0, NAN])
    expected = [2 / 3, -2 / 3, -2 / 3, 2 / 3, 1.5, -1.5, 0.0, 0.0]
    torch.testing.assert_close(rloo_advantages(rewards, 4), torch.tensor(expected))


def test_rloo_of_a_constant_group_is_zero_and_a_lone_scored_sample_gets_zero():
    rewards = torch.tensor([2.0, 2.0, 2.0, 5.0, NAN, NAN])
    torch.testing.assert_close(rloo_advantages(rewards, 3), torch.zeros(6))


def test_reinforce_plus_plus_whitens_over_completion_tokens_of_the_batch():
    # tokens: 1,1 | 0 | 2 -> mean 4/4 = 1; biased var (0+0+1+1)/4 = 0.5, unbiased x 4/3 = 2/3
    rewards = torch.tensor([1.0, 0.0, 2.0, NAN])
    lengths = torch.tensor([2, 1, 1, 5])
    std = math.sqrt(2 / 3)
    expected = torch.tensor([0.0, -1 / std, 1 / std, 0.0])
    torch.testing.assert_close(reinforce_plus_plus_advantages(rewards, lengths), expected)
    # no group baseline: the same rewards in another grouping give the same advantages
    torch.testing.assert_close(reinforce_plus_plus_advantages(rewards[[2, 1, 0, 3]], lengths[[2, 1, 0, 3]]),
                               expected[[2, 1, 0, 3]])  # fmt: skip


def test_length_weighting_matters():
    """Negative control for the token weighting: equal lengths give the per-sequence z-score, unequal ones do not."""
    rewards = torch.tensor([1.0, 0.0, 2.0])
    equal = reinforce_plus_plus_advantages(rewards, torch.tensor([3, 3, 3]))
    unequal = reinforce_plus_plus_advantages(rewards, torch.tensor([6, 1, 1]))
    z = (rewards - rewards.mean()) / torch.sqrt(((rewards - 1.0) ** 2).sum() * 3 / (9 - 1))
    torch.testing.assert_close(equal, z)
    assert not torch.allclose(unequal, equal)


def test_remax_is_the_reward_minus_the_greedy_completions_reward():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, NAN, 1.0])
    baselines = torch.tensor([0.5, 0.5, 0.5, 1.0, 1.0, NAN])  # one greedy reward per group of 3, repeated
    torch.testing.assert_close(remax_advantages(rewards, baselines), torch.tensor([0.5, -0.5, 0.0, 1.0, 0.0, 0.0]))


@pytest.mark.parametrize("name", ["gae", "ppo"])
def test_estimators_it_cannot_run_are_refused(name):
    with pytest.raises(ValueError, match=f"advantage_estimator {name}"):
        VLMGRPOConfig(output_dir="unused", advantage_estimator=name, report_to="none")


def _reward(completions, **kwargs):
    return [float(len(str(c)) % 4) + 0.5 * str(c).count("e") for c in completions]


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("adv")
    Image.new("RGB", (64, 48), (200, 30, 30)).save(root / "a.png")
    Image.new("RGB", (56, 90), (30, 30, 200)).save(root / "b.png")
    rows = [
        {"image": "a.png", "conversations": [{"from": "human", "value": "<image>Red?"}, {"from": "gpt", "value": "1"}]},
        {
            "image": "b.png",
            "conversations": [
                {"from": "human", "value": "Describe <image> in a few short words, please."},
                {"from": "gpt", "value": "2"},
            ],
        },
    ]
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_trainer(model_dir, rows_file, tmp_path, **overrides):
    module = get_vlm_module(str(model_dir))
    processor = module.load_processor(str(model_dir))
    model = module.load_model(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    rows, bad = read_rows([str(rows_file)], task_type="raw")
    dataset, _ = to_datasets(prepare_rows(rows, bad, module, processor), module)
    settings = dict(per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=6, report_to="none",
                    seed=3, gradient_checkpointing=False)  # fmt: skip
    args = VLMGRPOConfig(output_dir=str(tmp_path / "out"), **{**settings, **overrides})
    return VLMGRPOTrainer(
        model=model, reward_funcs=[_reward], args=args, vlm_module=module, processing_class=processor,
        train_dataset=dataset,
    )  # fmt: skip


def expected_advantages(name, rewards, batch):
    if name == "remax":
        return None  # checked against the recorded greedy pass in its own test
    if name == "rloo":
        return rloo_advantages(rewards, G)
    return reinforce_plus_plus_advantages(rewards, batch["completion_mask"].sum(1))


@pytest.mark.parametrize("name", ["rloo", "reinforce_plus_plus"])
@pytest.mark.parametrize("speed", [True, False], ids=["speed_path", "trl_path"])
def test_the_trainer_hands_the_loss_the_estimators_advantages(name, speed, tiny_models, rows_file, tmp_path):
    trainer = make_trainer(
        tiny_models["qwen2_5_vl"], rows_file, tmp_path, advantage_estimator=name, share_prompt=speed,
        share_prefill=speed,
    )  # fmt: skip
    trainer.model.train()
    batch = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    rewards = trainer._gathered_rewards[:, 0]
    assert rewards.unique().numel() > 1, "the rewards do not vary: the test shows nothing"
    torch.testing.assert_close(batch["advantages"], expected_advantages(name, rewards, batch))
    # negative control: GRPO's advantages (what TRL computed) differ
    grpo = (rewards.view(-1, G) - rewards.view(-1, G).mean(1, keepdim=True)) / (
        rewards.view(-1, G).std(1, keepdim=True) + 1e-4
    )
    assert not torch.allclose(batch["advantages"], grpo.reshape(-1), atol=1e-3)


@pytest.mark.parametrize("name", ["rloo", "reinforce_plus_plus", "remax"])
def test_the_speed_path_loss_matches_the_per_row_loss(name, tiny_models, rows_file, tmp_path):
    trainer = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path, advantage_estimator=name)
    trainer.model.train()
    batch = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    assert batch["advantages"].abs().sum() > 0
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train() for the loss's scaling

    def loss_and_grads(method):
        trainer.model.zero_grad(set_to_none=True)
        original = VLMGRPOTrainer._get_per_token_logps_and_entropies
        VLMGRPOTrainer._get_per_token_logps_and_entropies = method
        try:
            loss = trainer._compute_loss(trainer.model, batch)
        finally:
            VLMGRPOTrainer._get_per_token_logps_and_entropies = original
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in trainer.model.parameters() if p.grad is not None]

    fast_loss, fast = loss_and_grads(VLMGRPOTrainer._get_per_token_logps_and_entropies)
    slow_loss, slow = loss_and_grads(GRPOTrainer._get_per_token_logps_and_entropies)
    torch.testing.assert_close(fast_loss, slow_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["rloo", "reinforce_plus_plus", "remax"])
def test_two_steps_train_through_the_speed_path(name, tiny_models, rows_file, tmp_path):
    trainer = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path, advantage_estimator=name, max_steps=2,
                           learning_rate=1e-3, logging_steps=1, save_strategy="no")  # fmt: skip
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert trainer.state.global_step == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    assert all(math.isfinite(e["loss"]) for e in trainer.state.log_history if "loss" in e)


class Recorder:
    """A reward that records each call's completions (texts) and scores them by their text."""

    def __init__(self):
        self.calls: list[list[str]] = []
        self.__name__ = "recorded"

    def __call__(self, completions, completion_ids, **kwargs):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        # a reward reading the token ids gets one list of ints per completion
        assert len(completion_ids) == len(texts) and all(isinstance(i, int) for ids in completion_ids for i in ids)
        self.calls.append(texts)
        return _reward(texts)


@pytest.mark.parametrize("speed", [True, False], ids=["speed_path", "trl_path"])
def test_remax_baseline_is_the_reward_of_each_prompts_greedy_completion(speed, tiny_models, rows_file, tmp_path):
    trainer = make_trainer(
        tiny_models["qwen2_5_vl"], rows_file, tmp_path, advantage_estimator="remax", share_prompt=speed,
        share_prefill=speed, temperature=1.5,
    )  # fmt: skip
    recorder = Recorder()
    trainer.reward_funcs = [recorder]
    trainer.model.train()
    prompts, generate = [], trainer._generate
    trainer._generate = lambda batch_prompts, *a, **k: prompts.append(batch_prompts) or generate(batch_prompts, *a, **k)
    batch_inputs = decode_pending(next(iter(trainer.get_train_dataloader())), trainer._pending_transform)
    batch = trainer._generate_and_score_completions(batch_inputs)
    greedy, sampled = recorder.calls
    # the greedy completion answers the same prompt, image included, as its group's samples
    assert any(part.get("image") is not None for part in prompts[1][0][0]["content"]), "no image: shows nothing"
    assert prompts[0] == prompts[1][::G]
    assert len(greedy) == 2 and len(sampled) == 2 * G  # one greedy completion per prompt (group)
    assert trainer.generation_config.do_sample  # sampling is back on for the samples
    assert len(set(sampled)) > 2, "the samples did not vary: the test shows nothing"
    baselines = torch.tensor(_reward(greedy)).repeat_interleave(G)
    torch.testing.assert_close(batch["advantages"], torch.tensor(_reward(sampled)) - baselines)
    # greedy: the same completions again; and the greedy pass left no trace in the logged metrics
    assert (
        trainer._metrics["train"]["completions/mean_length"]
        and len(trainer._metrics["train"]["completions/mean_length"]) == 1
    )
    recorder.calls.clear()
    trainer._remax_baselines(batch_inputs)
    assert recorder.calls == [greedy]


def test_remax_needs_whole_groups_per_process():
    """Two processes with 2 rows each and groups of 4: a group would be split (TRL allows it: 4 rows in all)."""
    from types import SimpleNamespace

    from vlm_grpo.advantages import AdvantageEstimatorMixin

    args = SimpleNamespace(advantage_estimator="remax", use_vllm=False, per_device_train_batch_size=2,
                           steps_per_generation=1)  # fmt: skip
    with pytest.raises(ValueError, match="multiple of num_generations"):
        AdvantageEstimatorMixin._check_advantage_estimator(SimpleNamespace(args=args, num_generations=4))
    args.per_device_train_batch_size = 4
    AdvantageEstimatorMixin._check_advantage_estimator(SimpleNamespace(args=args, num_generations=4))
    args.use_vllm = True
    with pytest.raises(ValueError, match="not vLLM"):
        AdvantageEstimatorMixin._check_advantage_estimator(SimpleNamespace(args=args, num_generations=4))


def test_the_private_trl_names_it_overrides_still_exist():
    from vlm_grpo.advantages import PRIVATE_NAMES
    from vlm_grpo.fastpath.contract import check

    assert [problem for entry in PRIVATE_NAMES if (problem := check(entry))] == []
