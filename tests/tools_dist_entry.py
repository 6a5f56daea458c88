"""torchrun entry for the distributed tool test: a scripted first turn (a python tool call), then training."""

import json
import os
import sys

import torch

from vlm_grpo.grpo_jsonl import main, parse_args
from vlm_grpo.recipe import end_distributed
from vlm_grpo.trainer import VLMGRPOTrainer

CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "display(image.crop((0, 0, 24, 24)))"}}\n</tool_call>'
original = VLMGRPOTrainer._generate_single_turn


def scripted(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    if num_generations == 1:  # after the tool result: the model's own tokens
        return original(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
    ids = self._tokenizer.encode(CALL + "<|im_end|>", add_special_tokens=False)
    return [list(ids) for _ in prompt_ids], None


VLMGRPOTrainer._generate_single_turn = scripted  # test-only scripted policy

if __name__ == "__main__":
    trainer = main(*parse_args(sys.argv[1:]))
    rank = int(os.environ.get("RANK", 0))
    out = trainer.args.output_dir
    torch.save({n: p.detach().cpu().clone() for n, p in trainer.model.named_parameters()}, f"{out}/rank{rank}.pt")
    logs = [e for e in trainer.state.log_history if "tools/calls_per_rollout" in e]
    with open(f"{out}/tools{rank}.json", "w") as f:
        json.dump({"world_size": trainer.args.world_size, "logs": logs}, f)
    end_distributed(synchronize=True)  # as the command line ends a run that ended normally
