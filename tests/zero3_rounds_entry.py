"""torchrun entry: tool rollouts under DeepSpeed where the ranks run different numbers of tool rounds.

Each turn is generated (each rollout's KV cache held) and then, where scripted, replaced: every rollout calls
``zoom_in`` in its first turn, and on rank 0 in its second turn too; later turns are the model's own (a tiny random
model calls no tool). So rank 0 runs two tool rounds and rank 1 one (it answers after round 1). Writes what each
rank generated and joined, and the held-cache counters after each round.

``Z3_COMPARE=1``: rank 0 also generates its round through TRL's path (nothing held: every rank votes for TRL's path,
rank 1 joins it), with the same model, and writes both outputs. ``Z3_OLD_JOIN=1`` (control): a rank joins every round
with TRL's one-token generation, whichever path the others take."""

import json
import os
import sys

from vlm_grpo.grpo_jsonl import main, parse_args
from vlm_grpo.recipe import end_distributed
from vlm_grpo.trainer import VLMGRPOTrainer

CALL = '<tool_call>\n{"name": "zoom_in", "arguments": {"bbox_2d": [4, 4, 40, 40], "image_index": 0}}\n</tool_call>'
original = VLMGRPOTrainer._generate_single_turn
original_join = VLMGRPOTrainer._join_round
RANK = int(os.environ.get("RANK", 0))
record = {"rounds": [], "first_prompt_lengths": [], "histories": [], "held": [], "trl": [], "stats_after": []}
# held: each round's completions on the held path; trl: the same round through TRL's path (Z3_COMPARE)


def scripted(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    if num_generations > 1:  # the first turn (TRL asks later turns one row each): generated, then scripted
        original(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        record["first_prompt_lengths"] = [len(ids) for ids in prompt_ids]
        return [call(self) for _ in prompt_ids], None
    print(f"rank {RANK}: round starts", flush=True)
    record["rounds"].append(len(prompt_ids))
    record["histories"].append([len(ids) for ids in prompt_ids])
    out = original(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
    record["held"].append(out[0])
    stats = self._turn_cache.stats
    record["stats_after"].append([stats.prefill_tokens, stats.reused_tokens])
    if os.environ.get("Z3_COMPARE"):
        held, self._turn_cache = self._turn_cache, None  # nothing held: this rank votes for TRL's path
        try:
            record["trl"].append(original(self, prompt_ids, images, multimodal_fields, num_generations)[0])
        finally:
            self._turn_cache = held
    if RANK == 0 and len(record["rounds"]) == 1:  # rank 0's rollouts call the tool again
        return [call(self) for _ in prompt_ids], None
    return out


def call(self):
    return list(self._tokenizer.encode(CALL + "<|im_end|>", add_special_tokens=False))


def old_join(self, held):
    print(f"rank {RANK}: joining with TRL's one-token generation", flush=True)
    return original_join(self, False)


VLMGRPOTrainer._generate_single_turn = scripted  # test-only scripted first turn
if os.environ.get("Z3_OLD_JOIN"):
    VLMGRPOTrainer._join_round = old_join  # control: the joiner's collectives before the held path

if __name__ == "__main__":
    trainer = main(*parse_args(sys.argv[1:]))
    out = trainer.args.output_dir
    record["logs"] = [e for e in trainer.state.log_history if "tools/calls_per_rollout" in e]
    sync = trainer._round_sync
    record["joined"] = sync.joined if sync is not None else None
    record["held_rounds"] = sync.held_rounds if sync is not None else None
    record["steps"] = trainer.state.global_step
    with open(f"{out}/rounds{RANK}.json", "w") as f:
        json.dump(record, f)
    end_distributed(synchronize=True)
