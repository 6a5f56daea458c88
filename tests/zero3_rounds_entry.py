"""torchrun entry: tool rollouts under DeepSpeed where the ranks run different numbers of tool rounds.

The first turn is scripted: on rank 0 every rollout calls ``zoom_in`` (one tool round follows), on rank 1 every rollout
answers at once (no round). Later turns are the model's own. Writes the rounds each rank generated and joined."""

import json
import os
import sys

from vlm_grpo.grpo_jsonl import main, parse_args
from vlm_grpo.recipe import end_distributed
from vlm_grpo.trainer import VLMGRPOTrainer

CALL = '<tool_call>\n{"name": "zoom_in", "arguments": {"bbox_2d": [4, 4, 40, 40], "image_index": 0}}\n</tool_call>'
ANSWER = "<answer>red</answer>"
original = VLMGRPOTrainer._generate_single_turn
rounds = []


def scripted(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    if num_generations > 1:  # the first turn (TRL asks later turns one row each)
        text = CALL if int(os.environ.get("RANK", 0)) == 0 else ANSWER
        ids = self._tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)
        return [list(ids) for _ in prompt_ids], None
    rounds.append(len(prompt_ids))
    return original(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images)


VLMGRPOTrainer._generate_single_turn = scripted  # test-only scripted first turn

if __name__ == "__main__":
    trainer = main(*parse_args(sys.argv[1:]))
    rank = int(os.environ.get("RANK", 0))
    out = trainer.args.output_dir
    logs = [e for e in trainer.state.log_history if "tools/calls_per_rollout" in e]
    with open(f"{out}/rounds{rank}.json", "w") as f:
        joined = trainer._round_sync.joined if trainer._round_sync is not None else None
        json.dump({"rounds": rounds, "joined": joined, "logs": logs, "steps": trainer.state.global_step}, f)
    end_distributed(synchronize=True)
