"""Advantage estimators without a model: limits of each formula just under and over, and the trainer hook on a
stand-in ``GRPOTrainer`` (rows of process 1 of 2, two weighted rewards, tool-result tokens), against numbers worked
out by hand from each estimator's definition (docs/concepts/advantage-estimators.md)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from trl import GRPOTrainer

from vlm_grpo.advantages import (
    AdvantageEstimatorMixin,
    check_estimator,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)

NAN = float("nan")


def test_an_unknown_estimator_names_the_ones_to_use():
    with pytest.raises(ValueError) as error:
        check_estimator("ppo")
    assert str(error.value) == "advantage_estimator ppo: unknown; use one of grpo, rloo, reinforce_plus_plus, remax"
    with pytest.raises(ValueError, match=r"^advantage_estimator gae: GAE needs a value model"):
        check_estimator("gae")


def test_rloo_with_two_samples_per_prompt_is_their_difference():
    # G = 2: each sample's baseline is the other sample's reward; an unscored partner leaves no baseline (0)
    rewards = torch.tensor([1.0, 0.0, 3.0, NAN, 2.0, 2.0])
    torch.testing.assert_close(rloo_advantages(rewards, 2), torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0, 0.0]))


def test_rloo_with_two_scored_samples_of_three():
    rewards = torch.tensor([4.0, NAN, 1.0])
    torch.testing.assert_close(rloo_advantages(rewards, 3), torch.tensor([3.0, 0.0, -3.0]))


def test_reinforce_plus_plus_needs_two_tokens():
    """One scored token has no unbiased variance: 0, not NaN. Two tokens: ``(r - 0.5) / sqrt(0.5)``."""
    one = reinforce_plus_plus_advantages(torch.tensor([3.0, NAN]), torch.tensor([1, 4]))
    torch.testing.assert_close(one, torch.zeros(2))
    two = reinforce_plus_plus_advantages(torch.tensor([1.0, 0.0]), torch.tensor([1, 1]))
    torch.testing.assert_close(two, torch.tensor([0.5, -0.5]) / math.sqrt(0.5))


def test_reinforce_plus_plus_of_equal_rewards_is_zero_not_nan():
    advantages = reinforce_plus_plus_advantages(torch.tensor([2.0, 2.0, 2.0]), torch.tensor([2, 3, 1]))
    torch.testing.assert_close(advantages, torch.zeros(3))


class FakeAccelerator:
    """Process ``process_index`` of two; ``gather`` puts the other process's tensor beside the local one."""

    def __init__(self, process_index: int, other: torch.Tensor):
        self.process_index, self.other = process_index, other

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [self.other, tensor] if self.process_index == 1 else [tensor, self.other]
        return torch.cat(parts)


class FakeGRPO:
    """What the mixin reads of TRL's ``GRPOTrainer``: the rewards it gathers, and its output."""

    def __init__(self, output: dict, rewards: torch.Tensor):
        self.output, self.rewards = output, rewards

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        self.forwarded = (inputs, prompts, completions, completion_ids_list)
        return self.rewards

    def _generate_and_score_completions(self, inputs):
        self.inputs = inputs
        self._calculate_rewards(inputs, None, None, None)
        return dict(self.output)


class Trainer(AdvantageEstimatorMixin, FakeGRPO):
    def __init__(self, estimator: str, training: bool = True, tool_mask: torch.Tensor | None = None):
        # gathered rows of both processes (G = 2): two rewards weighted 2 and 0.5 -> 1, 0 | 3, 1
        rewards = torch.tensor([[0.5, 0.0], [0.0, 0.0], [1.0, 2.0], [NAN, 2.0]])
        output = {
            "completion_ids": torch.ones(2, 3, dtype=torch.long),  # this process's two rows, 3 columns
            "completion_mask": torch.tensor([[1, 1, 1], [1, 0, 0]]),  # 3 and 1 tokens
            "advantages": torch.tensor([7.0, 8.0]),  # what TRL computed
        }
        if tool_mask is not None:
            output["tool_mask"] = tool_mask
        super().__init__(output, rewards)
        self.args = SimpleNamespace(advantage_estimator=estimator)
        self.model = SimpleNamespace(training=training)
        self.num_generations = 2
        self.reward_weights = torch.tensor([2.0, 0.5])
        self.accelerator = FakeAccelerator(1, other=torch.tensor([1, 1]))  # process 0's rows: one token each
        self.greedy_passes = 0

    def _remax_baselines(self, inputs):
        self.greedy_passes += 1
        self.greedy_inputs = inputs
        return torch.tensor([0.5, 0.5])


def test_the_weighted_reward_sums_the_scored_rewards_times_their_weights():
    trainer = Trainer("rloo")
    rewards = torch.tensor([[1.0, 4.0], [NAN, 2.0], [NAN, NAN], [3.0, NAN]])
    torch.testing.assert_close(trainer._weighted(rewards), torch.tensor([4.0, 1.0, NAN, 6.0]), equal_nan=True)


def test_rloo_advantages_of_this_process_rows():
    trainer = Trainer("rloo")
    out = trainer._generate_and_score_completions([])
    torch.testing.assert_close(out["advantages"], torch.tensor([2.0, -2.0]))  # group 3, 1
    assert trainer.greedy_passes == 0  # no greedy generation for an estimator that does not use it


def test_remax_advantages_of_this_process_rows():
    trainer, inputs = Trainer("remax"), [{"prompt": "rows of this process"}]
    out = trainer._generate_and_score_completions(inputs)
    torch.testing.assert_close(out["advantages"], torch.tensor([2.5, 0.5]))
    assert trainer.greedy_passes == 1
    assert trainer.greedy_inputs is inputs and trainer.inputs is inputs  # both passes get this process's rows


@pytest.mark.parametrize("tools", [False, True], ids=["no_tools", "tool_results"])
def test_reinforce_plus_plus_weighs_the_model_tokens_of_all_processes(tools):
    """Tokens: process 0 carries 1 | 0, this process 3,3,3 | 1 -> mean 11/6, unbiased var 53/30; a tool-result
    token (``tool_mask`` 0) is not the model's: 1 | 0 | 3,3 | 1 -> mean 8/5, unbiased var 9/5."""
    tool_mask = torch.tensor([[1, 0, 1], [1, 1, 1]]) if tools else None
    out = Trainer("reinforce_plus_plus", tool_mask=tool_mask)._generate_and_score_completions([])
    mean, var = (8 / 5, 9 / 5) if tools else (11 / 6, 53 / 30)
    torch.testing.assert_close(out["advantages"], (torch.tensor([3.0, 1.0]) - mean) / math.sqrt(var))


def test_grpo_keeps_trls_advantages():
    trainer = Trainer("grpo")
    torch.testing.assert_close(trainer._generate_and_score_completions([])["advantages"], torch.tensor([7.0, 8.0]))
    assert trainer.greedy_passes == 0


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus", "remax"])
def test_evaluation_keeps_trls_advantages_and_generates_no_greedy_completion(estimator):
    trainer = Trainer(estimator, training=False)
    torch.testing.assert_close(trainer._generate_and_score_completions([])["advantages"], torch.tensor([7.0, 8.0]))
    assert trainer.greedy_passes == 0


def test_the_rewards_trl_gathered_are_kept():
    trainer = Trainer("grpo")
    trainer._generate_and_score_completions([])
    assert trainer._gathered_rewards is trainer.rewards


def _check(per_device_train_batch_size, steps_per_generation, num_generations, use_vllm=False):
    args = SimpleNamespace(advantage_estimator="remax", use_vllm=use_vllm, steps_per_generation=steps_per_generation,
                           per_device_train_batch_size=per_device_train_batch_size)  # fmt: skip
    AdvantageEstimatorMixin._check_advantage_estimator(SimpleNamespace(args=args, num_generations=num_generations))


def test_remax_counts_whole_groups_over_the_generation_batch():
    """2 rows a step x 2 steps per generation hold a group of 4; 2 x 3 = 6 rows do not."""
    _check(2, 2, 4)
    with pytest.raises(ValueError) as error:
        _check(2, 3, 4)
    assert str(error.value) == (
        "advantage_estimator remax generates one greedy completion per group on the process holding it: "
        "per_device_train_batch_size x steps_per_generation must be a multiple of num_generations"
    )
    with pytest.raises(ValueError) as error:
        _check(4, 1, 4, use_vllm=True)
    assert str(error.value) == "advantage_estimator remax needs greedy generation in the training process, not vLLM"


class Stop(Exception):
    """Ends the greedy pass once its prompts are seen."""


class Greedy(AdvantageEstimatorMixin):
    """What ``_remax_baselines`` reads of the trainer (process 1 of 2, groups of 2), with a ``_generate`` that
    records the prompts it gets and leaves traces in the metrics, as TRL's does."""

    def __init__(self, stop: bool = True):
        self.stop, self.num_generations = stop, 2
        self.generation_config = SimpleNamespace(do_sample=True)
        self.state = SimpleNamespace(num_input_tokens_seen=5)
        self._metrics, self._pending_metrics, self._pending_extra_logs = {"train": {}}, {}, {"texts": []}
        self.reward_weights = torch.tensor([1.0])
        self.accelerator = SimpleNamespace(process_index=1)
        self.prompts: list = []

    def _generate(self, prompts):
        assert not self.generation_config.do_sample
        self.prompts.append(prompts)
        self._metrics["train"]["completions/mean_length"] = [3.0]
        self.state.num_input_tokens_seen += 10
        self._pending_metrics["reward"] = [1.0]
        self._pending_extra_logs["texts"].append("greedy")
        if self.stop:
            raise Stop
        completion_ids = [[7] * (i + 1) for i in range(len(prompts))]
        return None, completion_ids, None, [f"greedy {i}" for i in range(len(prompts))], None, {}


def test_remax_baselines_are_this_process_greedy_rewards_once_per_group(monkeypatch):
    """TRL's ``_calculate_rewards`` scores the greedy completions (their token ids too) and gathers both
    processes' scores: process 0's 9, 8 | this process's 1, 2, one per group of 2 rows."""
    seen = []

    def rewards(self, inputs, prompts, completions, completion_ids_list):
        seen.append((self, inputs, prompts, completions, completion_ids_list))
        return torch.tensor([[9.0], [8.0], [1.0], [2.0]])

    monkeypatch.setattr(GRPOTrainer, "_calculate_rewards", rewards)
    trainer = Greedy(stop=False)
    rows = [{"prompt": [{"role": "user", "content": f"Q{i // 2}"}]} for i in range(4)]
    torch.testing.assert_close(trainer._remax_baselines(rows), torch.tensor([1.0, 1.0, 2.0, 2.0]))
    assert trainer.prompts == [[[{"role": "user", "content": "Q0"}], [{"role": "user", "content": "Q1"}]]]
    assert seen == [(trainer, [rows[0], rows[2]], trainer.prompts[0], ["greedy 0", "greedy 1"], [[7], [7, 7]])]
    # the greedy pass left no trace in what is logged, and sampling is back on
    assert trainer._metrics == {"train": {}} and trainer._pending_metrics == {}
    assert trainer._pending_extra_logs == {"texts": []} and trainer.state.num_input_tokens_seen == 5
    assert trainer.generation_config.do_sample


def test_the_rewards_are_computed_by_trl_from_everything_it_hands():
    """The reward functions get the completions' token ids too (``completion_ids``) and TRL's gathered rewards."""
    trainer = Trainer("rloo")
    assert trainer._calculate_rewards(["row"], ["prompt"], ["text"], [[4, 5]]) is trainer.rewards
    assert trainer.forwarded == (["row"], ["prompt"], ["text"], [[4, 5]])
    assert trainer._gathered_rewards is trainer.rewards


@pytest.mark.parametrize("column", ["image", "images"])
def test_remax_greedy_prompts_carry_each_image_column(column):
    """TRL's ``image`` column (one image or None per row) and this project's ``images`` list (possibly empty):
    each group's greedy prompt gets its image in the placeholder, as TRL lays out the samples' prompts; a row without
    an image gets none; the rows' own prompts stay as they were."""
    image = Image.new("RGB", (8, 6), (1, 2, 3))
    with_image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Red?"}]}]
    given, none = (image, None) if column == "image" else ([image], [])
    rows = [{"prompt": with_image, column: given}] * 2 + [
        {"prompt": [{"role": "user", "content": "Hi"}], column: none}
    ] * 2
    trainer = Greedy()
    with pytest.raises(Stop):
        trainer._remax_baselines(rows)
    assert trainer.prompts == [
        [
            [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Red?"}]}],
            [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        ]
    ]
    assert rows[0]["prompt"] == [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Red?"}]}]
    assert trainer.generation_config.do_sample and trainer.state.num_input_tokens_seen == 5  # restored


def test_remax_greedy_prompts_without_images():
    rows = [{"prompt": [{"role": "user", "content": "Hi"}]}] * 2
    trainer = Greedy()
    with pytest.raises(Stop):
        trainer._remax_baselines(rows)
    assert trainer.prompts == [[[{"role": "user", "content": "Hi"}]]]
