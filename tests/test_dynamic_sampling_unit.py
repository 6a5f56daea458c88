"""Dynamic sampling's round loop on a stand-in for TRL's generation (no model): which rows reach the loss,
how many tokens the loss is normalised by (tool-output tokens excluded), NaN rewards, refills and metrics."""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from vlm_grpo.dynamic_sampling import DynamicSamplingMixin, keep_groups

G = 2
NAN = float("nan")


class StandInTRL:
    """``_generate_and_score_completions`` as TRL lays it out: one row per input; the i-th row's rewards
    (``row["rewards"][i % G]``: a prompt's G completions score differently) gathered into ``_gathered_rewards``
    (as ``_calculate_rewards`` gathers them and the advantage mixin keeps them); ``completion_mask`` ones over
    ``row["length"]`` tokens, ``tool_mask`` zeros over ``row["tool"]`` of them."""

    def __init__(self, dataset, max_rounds=4, seed=0):
        self.args = SimpleNamespace(
            dynamic_sampling=True, max_sampling_rounds=max_rounds, filter_key=None, filter_low=0.01,
            filter_high=0.99, seed=seed, per_device_train_batch_size=4, steps_per_generation=1, should_save=True,
        )  # fmt: skip
        self.model = SimpleNamespace(training=True)
        self.num_generations = G
        self.accelerator = SimpleNamespace(
            process_index=0, num_processes=1, device=torch.device("cpu"), gather=lambda t: t.reshape(-1)
        )
        self.reward_weights = torch.tensor([1.0, 0.5])
        self.reward_func_names = ["acc", "fmt"]
        self.reward_funcs = [lambda **_: None, lambda **_: None]  # plain TRL-style rewards (no dicts)
        self._tokenizer = SimpleNamespace(pad_token_id=0)
        self._metrics = {"train": defaultdict(list)}
        self.train_dataset = dataset
        self.rounds: list[list[str]] = []
        self.state = SimpleNamespace(global_step=0)
        self.trl_calls: list[tuple] = []

    def _get_output_dir(self, trial):
        return self.args.output_dir if trial is None else os.path.join(self.args.output_dir, f"run-{trial}")

    def _save_checkpoint(self, model, trial):  # TRL writes the checkpoint folder
        self.trl_calls.append(("save", model, trial))
        os.makedirs(os.path.join(self._get_output_dir(trial), f"checkpoint-{self.state.global_step}"))

    def _load_optimizer_and_scheduler(self, checkpoint):
        self.trl_calls.append(("load", checkpoint))

    def _generate_and_score_completions(self, inputs):
        if len(self.rounds) >= 50:  # a round loop that ignores max_sampling_rounds: fail, don't hang
            raise AssertionError("runaway generation rounds")
        self.rounds.append([row["name"] for row in inputs])
        width = max(row["length"] for row in inputs)
        mask = torch.tensor([[1] * r["length"] + [0] * (width - r["length"]) for r in inputs])
        tool = torch.ones_like(mask)
        for i, row in enumerate(inputs):
            tool[i, 1 : 1 + row["tool"]] = 0  # tool output inside the completion: not the model's tokens
        scores = [row["rewards"][i % G] for i, row in enumerate(inputs)]
        self._gathered_rewards = torch.tensor(scores, dtype=torch.float32)
        ids = torch.tensor([[row["id"]] * width for row in inputs])
        return {
            "prompt_ids": torch.tensor([[row["id"], row["id"]] for row in inputs]),
            "prompt_mask": torch.ones(len(inputs), 2, dtype=torch.long),
            "completion_ids": ids * mask,
            "completion_mask": mask,
            "tool_mask": tool,
            "advantages": torch.arange(len(inputs), dtype=torch.float32),
            "num_items_in_batch": mask.sum(),
        }


class Trainer(DynamicSamplingMixin, StandInTRL):
    pass


def rows(name, rewards, length=4, tool=1, id=1):
    """One prompt's G rows (``rewards``: one [acc, fmt] per row)."""
    return [{"name": name, "rewards": rewards, "length": length, "tool": tool, "id": id}] * G


VARIED = [[1.0, 0.0], [0.0, 0.0]]
FURTHER = [{"name": f"more{i}", "rewards": VARIED, "length": 3, "tool": 2, "id": 10 + i} for i in range(4)]


def test_nan_rewards_count_as_no_signal():
    """A row no reward applied to (all NaN) is left out of the spread: with one scored row the group is flat;
    a NaN in one reward only is skipped in the weighted sum."""
    rewards = torch.tensor([[NAN, NAN], [1, 0], [NAN, 1], [1, 1], [1, NAN], [0, 0], [0, 0], [0, 0]])
    names = ["acc", "fmt"]
    # weighted sums (weights 1, 0.5): (nan, 1) (0.5, 1.5) (1, 0) (0, 0)
    assert keep_groups(rewards, torch.tensor([1.0, 0.5]), 2, names).tolist() == [False, True, True, False]
    # EasyR1's filter: a NaN is left out of the group mean; acc means 1, 1, 0.5, 0
    assert keep_groups(rewards, torch.tensor([1.0, 0.5]), 2, names, "acc").tolist() == [False, False, True, False]
    # on the weighted sum (weights 1, 1): means 1 (the unscored row left out, not counted as 0), 1.5, 0.5, 0
    assert keep_groups(rewards, torch.tensor([1.0, 1.0]), 2, names, "overall", 0.4, 0.6).tolist() == [
        False, False, True, False,
    ]  # fmt: skip


def test_flat_and_nan_groups_are_dropped_and_refilled_and_the_loss_counts_model_tokens_only():
    trainer = Trainer(FURTHER)
    batch = rows("flat", [[1.0, 1.0], [1.0, 1.0]], id=2) + rows("nan", [[NAN, NAN], [1.0, 0.0]], id=3)
    out = trainer._generate_and_score_completions(batch)
    assert len(trainer.rounds) == 2 and trainer.rounds[0] == ["flat", "flat", "nan", "nan"]
    kept_ids = out["prompt_ids"][:, 0].tolist()
    assert 2 not in kept_ids and 3 not in kept_ids and len(kept_ids) == 4
    assert all(i >= 10 for i in kept_ids)
    # loss normalisation: completion tokens that are the model's own (tool output excluded), kept rows only
    assert int(out["num_items_in_batch"]) == int((out["completion_mask"] * out["tool_mask"]).sum()) == 4 * (3 - 2)
    metrics = dict(trainer._metrics["train"])
    assert metrics == {
        "dynamic_sampling/kept_groups": [2.0],
        "dynamic_sampling/dropped_groups": [2.0],
        "dynamic_sampling/rounds": [2.0],
        "dynamic_sampling/filled_groups": [0.0],
    }


def test_a_kept_group_keeps_its_rows_tokens_and_advantages_in_order():
    trainer = Trainer(FURTHER)
    batch = rows("a", VARIED, length=5, tool=2, id=4) + rows("b", VARIED, length=2, tool=0, id=5)
    out = trainer._generate_and_score_completions(batch)
    assert trainer.rounds == [["a", "a", "b", "b"]]  # nothing dropped: no further round
    assert out["prompt_ids"][:, 0].tolist() == [4, 4, 5, 5]
    assert out["advantages"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert out["completion_mask"].sum(1).tolist() == [5, 5, 2, 2]
    assert int(out["num_items_in_batch"]) == 2 * (5 - 2) + 2 * 2
    assert trainer._metrics["train"]["dynamic_sampling/kept_groups"] == [2.0]


def test_when_rounds_run_out_the_newest_dropped_groups_fill_in_and_it_is_logged(caplog):
    flat = [{"name": "flat", "rewards": [[1.0, 0.0]] * G, "length": 2, "tool": 0, "id": 9}] * 4
    trainer = Trainer(flat, max_rounds=2)
    batch = rows("x", [[1.0, 1.0], [1.0, 1.0]], id=7) + rows("y", VARIED, id=8)
    with caplog.at_level(logging.WARNING, logger="vlm_grpo.dynamic_sampling"):
        out = trainer._generate_and_score_completions(batch)
    assert len(trainer.rounds) == 2
    assert out["prompt_ids"][:, 0].tolist() == [8, 8, 9, 9]  # the kept group, then the last dropped one
    assert "1 group(s) still missing after max_sampling_rounds=2" in caplog.text
    metrics = trainer._metrics["train"]
    assert metrics["dynamic_sampling/filled_groups"] == [1.0] and metrics["dynamic_sampling/kept_groups"] == [1.0]
    assert metrics["dynamic_sampling/dropped_groups"] == [3.0]


def test_outside_training_or_when_off_it_is_trls_pass_unchanged():
    trainer = Trainer(FURTHER)
    batch = rows("flat", [[1.0, 1.0], [1.0, 1.0]], id=2) * 2
    trainer.model.training = False
    assert trainer._generate_and_score_completions(batch)["prompt_ids"].shape[0] == 4
    trainer.model.training, trainer.args.dynamic_sampling = True, False
    assert trainer._generate_and_score_completions(batch)["prompt_ids"][:, 0].tolist() == [2, 2, 2, 2]
    assert len(trainer.rounds) == 2 and not trainer._metrics["train"]


def test_further_prompts_follow_a_seeded_stream_split_over_ranks():
    trainer = Trainer(list(range(10)))
    first = trainer._further_prompts(4)
    assert len(first) == 4 and first[0] == first[1] and first[2] == first[3]  # G copies side by side
    assert trainer._ds_cursor == 2
    second = trainer._further_prompts(4)
    again = Trainer(list(range(10)))
    assert again._further_prompts(8) == first + second  # one stream, however it is drawn
    permutation = torch.randperm(10, generator=torch.Generator().manual_seed(1)).tolist()
    assert [x for x in first + second][::G] == permutation[:4]  # seed + 1 + epoch of the second pass
    two = [Trainer(list(range(10))) for _ in range(2)]
    for rank, t in enumerate(two):
        t.accelerator = SimpleNamespace(process_index=rank, num_processes=2, device=torch.device("cpu"))
    assert two[0]._further_prompts(4)[::G] + two[1]._further_prompts(4)[::G] == permutation[:4]
    wrapped = Trainer(list(range(3)))
    wrapped._ds_cursor = 2  # the stream crosses into its next pass, reshuffled with the next seed
    nxt = torch.randperm(3, generator=torch.Generator().manual_seed(2)).tolist()
    assert wrapped._further_prompts(4)[::G] == [torch.randperm(3, generator=torch.Generator().manual_seed(1))
                                               .tolist()[2], nxt[0]]  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"per_device_train_batch_size": 3}, "must be a multiple of num_generations"),
        ({"filter_key": "nope"}, "filter_key 'nope' is not a reward of this run"),
        ({"filter_key": "acc", "filter_low": 0.5, "filter_high": 0.5}, "filter_low (0.5) must be below"),
        ({"max_sampling_rounds": 0}, "max_sampling_rounds must be at least 1"),
    ],
)
def test_bad_settings_are_refused_before_training(change, message):
    trainer = Trainer(FURTHER)
    vars(trainer.args).update(change)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        trainer._check_dynamic_sampling()
    trainer.args.dynamic_sampling = False
    trainer._check_dynamic_sampling()  # off: nothing to check


def test_merge_pads_every_completion_field_with_its_own_value_and_refuses_what_it_cannot_merge():
    from vlm_grpo.dynamic_sampling import merge_batches

    def part(prompt, completion, **extra):
        rows = len(prompt)
        return {
            "prompt_ids": torch.tensor(prompt),
            "prompt_mask": torch.ones(rows, len(prompt[0]), dtype=torch.long),
            "completion_ids": torch.tensor(completion),
            "completion_mask": torch.ones(rows, len(completion[0]), dtype=torch.long),
            "old_per_token_logps": torch.full((rows, len(completion[0])), -1.0),
            "tool_mask": torch.zeros(rows, len(completion[0]), dtype=torch.long),
            "token_type_ids": torch.full((rows, len(prompt[0]) + len(completion[0])), 2),
            "advantages": torch.ones(rows),
            "num_items_in_batch": torch.tensor(99),
            **extra,
        }

    a = part([[1]], [[5, 6, 7]], num_tiles=[3])
    b = part([[2, 3]], [[8]])  # wider prompt, shorter completion, no tiles
    merged = merge_batches([a, b], pad_token_id=9)
    assert "num_items_in_batch" not in merged
    assert merged["prompt_ids"].tolist() == [[9, 1], [2, 3]]
    assert merged["completion_ids"].tolist() == [[5, 6, 7], [8, 9, 9]]
    assert merged["old_per_token_logps"].tolist() == [[-1.0, -1.0, -1.0], [-1.0, 0.0, 0.0]]
    assert merged["tool_mask"].tolist() == [[0, 0, 0], [0, 1, 1]]  # padding counts as the model's (masked anyway)
    # prompt part padded left, completion part right, each with 0
    assert merged["token_type_ids"].tolist() == [[0, 2, 2, 2, 2], [2, 2, 2, 0, 0]]
    assert merged["num_tiles"] == [3, 0]
    with pytest.raises(ValueError, match="field 'tool_mask' is missing in some generation rounds"):
        merge_batches([a, {k: v for k, v in b.items() if k != "tool_mask"}], pad_token_id=9)
    with pytest.raises(ValueError, match="cannot merge generation output field 'odd' across rounds"):
        merge_batches([{**a, "odd": "x"}, {**b, "odd": "y"}], pad_token_id=9)


class Rank1Of2TRL(StandInTRL):
    """Rank 1 of 2: the gathered rewards hold rank 0's rows (all varied) first, then this rank's."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self._gathered_rewards = torch.cat([torch.tensor([[1.0, 0.0], [0.0, 0.0]] * 2), self._gathered_rewards])
        return out


class Rank1Of2(DynamicSamplingMixin, Rank1Of2TRL):
    pass


def test_each_rank_filters_its_own_rows_of_the_gathered_rewards():
    """Rank 1 reads rows [4, 8) of the gathered rewards: its flat group is dropped, its varied one kept."""
    trainer = Rank1Of2(FURTHER)
    trainer.accelerator = SimpleNamespace(
        process_index=1, num_processes=2, device=torch.device("cpu"), gather=lambda t: torch.cat([t.reshape(-1)] * 2)
    )
    mine = rows("mine_flat", [[1.0, 1.0], [1.0, 1.0]], id=2) + rows("mine_varied", VARIED, id=3)
    ids = trainer._generate_and_score_completions(mine)["prompt_ids"][:, 0].tolist()
    assert 2 not in ids and ids[:2] == [3, 3]


def test_the_filter_key_and_bounds_reach_the_group_filter():
    """EasyR1's filter: groups whose mean 'acc' lies outside (low, high) are dropped."""
    trainer = Trainer(FURTHER, max_rounds=1)
    vars(trainer.args).update(filter_key="acc", filter_low=0.2, filter_high=0.8)
    half = [[1.0, 0.0], [0.0, 0.0]]  # acc mean 0.5: kept
    all_right = [[1.0, 0.0], [1.0, 1.0]]  # acc mean 1.0: dropped (its total still varies)
    out = trainer._generate_and_score_completions(rows("half", half, id=4) + rows("right", all_right, id=5))
    assert out["prompt_ids"][:, 0].tolist() == [4, 4, 5, 5]  # one round only: the dropped group fills in
    assert trainer._metrics["train"]["dynamic_sampling/kept_groups"] == [1.0]
    vars(trainer.args).update(filter_low=0.6)  # now 0.5 is out too
    trainer._generate_and_score_completions(rows("half", half, id=4) + rows("right", all_right, id=5))
    assert trainer._metrics["train"]["dynamic_sampling/kept_groups"][-1] == 0.0


def test_limits_of_the_settings_just_under_and_at_their_bounds():
    trainer = Trainer(FURTHER)
    vars(trainer.args).update(max_sampling_rounds=1, per_device_train_batch_size=1, steps_per_generation=2)
    trainer._check_dynamic_sampling()  # 1 round and 1 x 2 rows per rank (G = 2) are fine
    vars(trainer.args).update(filter_key=None, filter_low=0.9, filter_high=0.1)
    trainer._check_dynamic_sampling()  # bounds matter only with a filter_key
    vars(trainer.args).update(filter_key="overall")
    with pytest.raises(ValueError, match=r"filter_low \(0\.9\) must be below filter_high \(0\.1\)"):
        trainer._check_dynamic_sampling()
    vars(trainer.args).update(filter_key="fmt", filter_low=0.1, filter_high=0.9)
    trainer._check_dynamic_sampling()
    trainer.train_dataset = iter(FURTHER)  # an iterable dataset cannot be drawn from by index
    with pytest.raises(ValueError, match=r"^dynamic_sampling needs a map-style training dataset"):
        trainer._check_dynamic_sampling()
    trainer.train_dataset = SimpleNamespace(__getitem__=None)
    with pytest.raises(ValueError, match="map-style"):
        trainer._check_dynamic_sampling()


def test_the_further_prompt_stream_moves_on_with_every_draw():
    trainer = Trainer(list(range(10)))
    draws = [trainer._further_prompts(2)[0] for _ in range(4)]
    assert trainer._ds_cursor == 4
    permutation = torch.randperm(10, generator=torch.Generator().manual_seed(1)).tolist()
    assert draws == permutation[:4]


def test_the_group_filter_at_its_limits():
    """A spread of 1e-6 is no spread; EasyR1's bounds are exclusive; rewards are weighted, not divided."""
    names = ["acc", "fmt"]
    tiny = torch.tensor([[1e-6, 0.0], [0.0, 0.0], [2e-6, 0.0], [0.0, 0.0]])
    assert keep_groups(tiny, torch.tensor([1.0, 1.0]), 2, names).tolist() == [False, True]
    weighted = torch.tensor([[1.0, 0.0], [0.0, 2.0]])  # 1 x 1 == 0.5 x 2: flat once weighted
    assert keep_groups(weighted, torch.tensor([1.0, 0.5]), 2, names).tolist() == [False]
    at = torch.tensor([[0.5, 0.0], [0.5, 0.0], [0.25, 0.0], [0.75, 0.0]])  # acc means 0.5 and 0.5
    assert keep_groups(at, torch.tensor([1.0, 1.0]), 2, names, "acc", 0.5, 0.9).tolist() == [False, False]
    assert keep_groups(at, torch.tensor([1.0, 1.0]), 2, names, "acc", 0.1, 0.5).tolist() == [False, False]
    assert keep_groups(at, torch.tensor([1.0, 1.0]), 2, names, "acc", 0.49, 0.51).tolist() == [True, True]


def test_merge_joins_per_row_images_and_fills_rounds_without_them():
    from vlm_grpo.dynamic_sampling import merge_batches

    def part(prompt_width, images):
        rows = len(images) if images is not None else 2
        out = {
            "prompt_ids": torch.ones(rows, prompt_width, dtype=torch.long),
            "prompt_mask": torch.ones(rows, prompt_width, dtype=torch.long),
            "completion_ids": torch.ones(rows, 2, dtype=torch.long),
            "completion_mask": torch.ones(rows, 2, dtype=torch.long),
            "mm_token_type_ids": torch.ones(rows, prompt_width + 2, dtype=torch.long),
            "advantages": torch.zeros(rows),
        }
        if images is not None:
            out["pixel_values"] = [torch.full((n, 3), float(n)) for n in images]
            out["image_grid_thw"] = [torch.tensor([[1, 1, n]]) for n in images]
            out["num_images"] = [1] * rows
        else:
            del out["mm_token_type_ids"]  # a text-only round has none
        return out

    merged = merge_batches([part(3, [4, 2]), part(2, None), part(1, [1, 5])], pad_token_id=0)
    assert [p.shape for p in merged["pixel_values"]] == [(4, 3), (2, 3), (0, 3), (0, 3), (1, 3), (5, 3)]
    assert [g.shape[0] for g in merged["image_grid_thw"]] == [1, 1, 0, 0, 1, 1]
    assert merged["num_images"] == [1, 1, 0, 0, 1, 1]
    assert merged["mm_token_type_ids"].shape == (6, 3 + 2)
    assert merged["mm_token_type_ids"][2:4].sum() == 0  # the text-only round: zeros over prompt and completion
    assert merged["mm_token_type_ids"][4].tolist() == [0, 0, 1, 1, 1]  # prompt padded left, completion as is
    assert merged["prompt_mask"].sum(1).tolist() == [3, 3, 2, 2, 1, 1]
    assert next(iter(merged)) == "prompt_ids"


class Rank0Of2TRL(StandInTRL):
    """Rank 0 of 2: this rank's rows first in the gathered rewards, then rank 1's (all flat)."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self._gathered_rewards = torch.cat([self._gathered_rewards, torch.tensor([[1.0, 1.0]] * 4)])
        return out


class Rank0Of2(DynamicSamplingMixin, Rank0Of2TRL):
    pass


def test_rank_0_reads_only_its_own_rows(caplog):
    trainer = Rank0Of2(FURTHER)
    trainer.accelerator = SimpleNamespace(
        process_index=0, num_processes=2, device=torch.device("cpu"), gather=lambda t: torch.cat([t.reshape(-1)] * 2)
    )
    ids = trainer._generate_and_score_completions(rows("a", VARIED, id=2) + rows("b", VARIED, id=3))
    assert ids["prompt_ids"][:, 0].tolist() == [2, 2, 3, 3]
    plain = Trainer(FURTHER)  # dynamic_sampling off: every row passes, nothing is logged
    plain.args.dynamic_sampling = False
    plain._check_dynamic_sampling()
    out = plain._generate_and_score_completions(rows("flat", [[1.0, 1.0]] * 2, id=2) * 2)
    assert out["prompt_ids"][:, 0].tolist() == [2, 2, 2, 2] and not plain._metrics["train"]


def test_the_refill_warning_says_what_to_do(caplog):
    flat = [{"name": "flat", "rewards": [[1.0, 0.0]] * G, "length": 2, "tool": 0, "id": 9}] * 4
    trainer = Trainer(flat, max_rounds=1)
    with caplog.at_level(logging.WARNING, logger="vlm_grpo.dynamic_sampling"):
        trainer._generate_and_score_completions(rows("x", [[1.0, 1.0]] * 2, id=7) * 2)
    assert caplog.messages == [
        "dynamic_sampling: 2 group(s) still missing after max_sampling_rounds=1; filled with dropped groups "
        "(zero advantage, no policy-gradient signal). Raise max_sampling_rounds or check the rewards."
    ]


class DictRewardTRL(StandInTRL):
    """A batch reward ("fmt") returning EasyR1's dicts keeps those of its latest call in ``last_outputs``
    (``row["outs"][i % G]``); the plain reward ("acc") is a bare function without them."""

    def __init__(self, dataset, **kwargs):
        super().__init__(dataset, **kwargs)
        self.reward_funcs = [lambda **_: None, SimpleNamespace(kind="batch", last_outputs=[])]

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.reward_funcs[1].last_outputs = [row["outs"][i % G] for i, row in enumerate(inputs)]
        return out


class DictReward(DynamicSamplingMixin, DictRewardTRL):
    pass


def dict_rows(name, accuracy, id, length):
    """One prompt's G rows whose dicts carry ``accuracy`` (None: that row's dict lacks the key)."""
    outs = [{"overall": float(i), **({} if a is None else {"accuracy": a})} for i, a in enumerate(accuracy)]
    return [{"name": name, "rewards": VARIED, "outs": outs, "length": length, "tool": 0, "id": id}] * G


def test_filter_key_on_a_key_of_a_rewards_dicts_keeps_the_right_groups_with_their_own_rows():
    """EasyR1's ``filter_key: accuracy``: the group mean of the dicts' ``accuracy`` (a row without it left out,
    not counted as 0) must lie in (low, high); every column of a kept row stays that row's."""
    trainer = DictReward(FURTHER, max_rounds=1)
    vars(trainer.args).update(filter_key="accuracy", filter_low=0.3, filter_high=0.8)
    batch = (
        dict_rows("right", [1.0, 1.0], id=5, length=4)  # mean 1: dropped, though its total reward varies
        + dict_rows("half", [1.0, 0.0], id=4, length=5)  # mean 0.5: kept
        + dict_rows("wrong", [0.0, 0.0], id=7, length=1)  # mean 0: dropped
        + dict_rows("gap", [0.5, None], id=6, length=2)  # mean 0.5 over the row that has it (0.25 if as 0)
    )
    out = trainer._generate_and_score_completions(batch)
    # kept groups first, then the dropped ones fill in (one round only); rows keep their advantages and tokens
    assert out["prompt_ids"][:, 0].tolist() == [4, 4, 6, 6, 5, 5, 7, 7]
    assert out["advantages"].tolist() == [2.0, 3.0, 6.0, 7.0, 0.0, 1.0, 4.0, 5.0]
    assert out["completion_mask"].sum(1).tolist() == [5, 5, 2, 2, 4, 4, 1, 1]
    assert (out["completion_ids"][:, 0] == out["prompt_ids"][:, 0]).all()
    assert int(out["num_items_in_batch"]) == 2 * (5 + 2 + 4 + 1)
    metrics = trainer._metrics["train"]
    assert metrics["dynamic_sampling/kept_groups"] == [2.0] and metrics["dynamic_sampling/dropped_groups"] == [2.0]
    assert metrics["dynamic_sampling/filled_groups"] == [2.0]


def test_filter_key_finds_its_reward_and_says_what_it_saw_when_it_cannot():
    trainer = DictReward(FURTHER)
    acc = SimpleNamespace(last_outputs=[{"accuracy": 1.0, "acc/strict": 0.0}, {"accuracy": 0.0, "acc/strict": 1.0}])
    fmt = SimpleNamespace(last_outputs=[{"accuracy": 0.25, "score/x": 3.0}, {"accuracy": 0.75}])
    trainer.reward_funcs = [acc, fmt]

    def column(key, rows=2):
        trainer.args.filter_key = key
        return trainer._filter_column(rows)

    def message(key, rows=2):
        with pytest.raises(ValueError) as raised:
            column(key, rows)
        return str(raised.value)

    assert column("acc") is None and column("overall") is None and column("reward") is None
    assert column("fmt/accuracy").tolist() == [0.25, 0.75] and column("acc/accuracy").tolist() == [1.0, 0.0]
    assert column("acc/acc/strict").tolist() == [0.0, 1.0]  # reward "acc", key "acc/strict"
    literal = column("score/x")  # "score" is no reward's name: the whole key is the dicts' key
    assert literal[0] == 3.0 and literal[1].isnan() and literal.dtype == torch.float32  # missing in a row: NaN
    keys = "acc/acc/strict, acc/accuracy, fmt/accuracy, fmt/score/x"
    assert message("accuracy") == (
        f"filter_key 'accuracy': several rewards return it; write it as reward/key (rewards: acc, fmt; keys their "
        f"dicts returned: {keys}; or reward / overall for the weighted sum)"
    )
    assert message("acuracy") == (
        f"filter_key 'acuracy': no reward returned it (rewards: acc, fmt; keys their dicts returned: {keys}; "
        "or reward / overall for the weighted sum)"
    )
    acc.last_outputs = [{"accuracy": 1.0}] * 3  # left from a call on other rows (3): not this batch's
    assert column("accuracy").tolist() == [0.25, 0.75]
    trainer.reward_funcs = [lambda **_: None, SimpleNamespace(last_outputs=[{}, {}])]  # no dicts at all
    assert message("accuracy").startswith("filter_key 'accuracy': no reward returned it (rewards: acc, fmt; keys")
    assert message("accuracy").endswith("returned: none; or reward / overall for the weighted sum)")


def test_filter_key_on_a_dict_key_is_accepted_only_when_a_reward_returns_dicts():
    trainer = DictReward(FURTHER)
    trainer.args.filter_key = "accuracy"
    trainer._check_dynamic_sampling()  # "fmt" is a batch reward: its dicts may carry it
    trainer.reward_funcs = [lambda **_: None, SimpleNamespace(kind="trl")]
    with pytest.raises(ValueError) as raised:
        trainer._check_dynamic_sampling()
    assert str(raised.value) == (
        "filter_key 'accuracy' is not a reward of this run: use one of ['acc', 'fmt'] or reward / overall "
        "(the weighted sum), or a key of the dict a batch reward returns"
    )


def test_the_group_filter_runs_where_the_rewards_live():
    """TRL keeps ``reward_weights`` on the CPU and the gathered rewards on the accelerator (here: meta)."""
    keep = keep_groups(torch.zeros(4, 2, device="meta"), torch.tensor([1.0, 0.5]), G, ["acc", "fmt"])
    assert keep.device.type == "meta" and keep.shape == (2,)


def test_merge_keeps_each_rows_vision_features_and_pads_text_only_rounds_to_their_own_shape():
    from vlm_grpo.dynamic_sampling import merge_batches
    from vlm_grpo.fastpath.vision_reuse import FEATURES_KEY

    def part(rows, prompt, completion, mm=True, features=None):
        out = {
            "prompt_ids": torch.ones(rows, prompt, dtype=torch.long),
            "prompt_mask": torch.ones(rows, prompt, dtype=torch.long),
            "completion_ids": torch.ones(rows, completion, dtype=torch.long),
            "completion_mask": torch.ones(rows, completion, dtype=torch.long),
            "advantages": torch.zeros(rows),
        }
        if mm:
            out["mm_token_type_ids"] = torch.ones(rows, prompt + completion, dtype=torch.long)
        if features is not None:
            out[FEATURES_KEY] = features
        return out

    a, b = object(), object()
    merged = merge_batches([part(2, 3, 2, features=[a, b]), part(3, 1, 4, mm=False)], pad_token_id=0)
    assert merged[FEATURES_KEY] == [a, b, None, None, None]  # the text-only round's rows: encoded by that pass
    assert merged["mm_token_type_ids"].tolist() == [[1, 1, 1, 1, 1, 0, 0]] * 2 + [[0] * 7] * 3
    merged = merge_batches([part(2, 2, 1, mm=False), part(2, 2, 2, features=[b, a])], pad_token_id=0)
    assert merged[FEATURES_KEY] == [None, None, b, a]


def test_the_further_prompt_position_is_saved_with_each_checkpoint_and_restored_on_resume(tmp_path):
    trainer = Trainer(list(range(10)))
    trainer.args.output_dir = str(tmp_path)
    trainer._further_prompts(6)  # 3 groups drawn
    trainer.state.global_step = 7
    model = object()
    trainer._save_checkpoint(model, None)
    trainer._save_checkpoint(model, "t1")  # a hyper-parameter search trial has its own folder
    assert trainer.trl_calls == [("save", model, None), ("save", model, "t1")]
    for folder in (tmp_path / "checkpoint-7", tmp_path / "run-t1" / "checkpoint-7"):
        assert json.loads((folder / "dynamic_sampling.json").read_text()) == {"cursor": 3}
    resumed = Trainer(list(range(10)))
    resumed._load_optimizer_and_scheduler(str(tmp_path / "checkpoint-7"))
    assert resumed.trl_calls == [("load", str(tmp_path / "checkpoint-7"))] and resumed._ds_cursor == 3
    assert resumed._further_prompts(2) == Trainer(list(range(10)))._further_prompts(8)[6:]  # the stream goes on
    for checkpoint in (None, str(tmp_path / "run-t1")):  # no checkpoint, or one without the file
        fresh = Trainer(list(range(10)))
        fresh._load_optimizer_and_scheduler(checkpoint)
        assert fresh._ds_cursor == 0 and fresh.trl_calls == [("load", checkpoint)]
    off = Trainer(list(range(10)))  # a run without dynamic_sampling ignores the file
    off.args.dynamic_sampling = False
    off._load_optimizer_and_scheduler(str(tmp_path / "checkpoint-7"))
    assert off._ds_cursor == 0
    for change in ({"dynamic_sampling": False}, {"should_save": False}):  # off, or not the saving process
        other = Trainer(list(range(10)))
        vars(other.args).update(output_dir=str(tmp_path / str(change)), **change)
        other._save_checkpoint(model, None)
        assert os.listdir(tmp_path / str(change) / "checkpoint-0") == []
