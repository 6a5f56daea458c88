"""Tool-loop rounds kept paired across ranks where generating is a collective (DeepSpeed ZeRO-3, FSDP).

Under ZeRO-3 every generation call gathers the partitioned parameters, and ``generate`` steps in ``synced_gpus``
mode (one all-reduce per token, until every rank is done); FSDP gathers its units likewise. TRL's tool loop runs as
many rounds as the rank's own rollouts need, so a rank whose rollouts all answered leaves the loop (and goes on to the
log-prob passes) while another rank gathers for its next round: the ranks' collectives part ways and the run aborts
(gloo: a connection reset or a size mismatch) or hangs (NCCL).

:class:`RoundSync` keeps them paired without touching TRL's loop. Before each round's generation a rank votes that it
generates and whether its rollouts can continue their held KV caches (:mod:`vlm_grpo.fastpath.turn_cache`); one
all-reduce sums the votes, so every rank learns the same two things: whether anyone generates, and whether everyone
can take the held path. A rank whose loop has ended keeps voting "not generating" and, while any rank generates,
joins that round with exactly the collectives the generating ranks make:

- held path (every rank can take it): the parameters are gathered once (``ds3_gather_for_generation``, as TRL's
  ``unwrap_model_for_generation``), the new tokens are prefilled into the held caches (one forward of the whole
  model) and decoding runs locally; the joiner enters the same gather and runs one forward of a single pad token
  (DeepSpeed's start-of-forward hook, which the gather leaves in place, broadcasts at each forward of the whole
  model; without the joiner's forward the ranks hang, ``tests/test_zero3_tool_rounds.py``);
- TRL's path (some rank cannot): ``generate`` with its ``synced_gpus`` steps; the joiner generates one token for a
  one-token prompt (the same gather, the same steps until the others are done).

When no rank generates, all leave together. A run where generating is local to the rank (one process, DDP,
ZeRO-1/2, vLLM) has no collectives to pair and builds no :class:`RoundSync`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vlm_grpo.utils import is_zero3


class RoundSync:
    """The votes of one process; ``reduce`` sums a two-element tensor over the ranks (``accelerator.reduce``)."""

    def __init__(self, reduce: Callable[[torch.Tensor], torch.Tensor], device: torch.device | str = "cpu") -> None:
        self.reduce = reduce
        self.device = device
        #: Rounds of other ranks this process joined without a round of its own (tests and logs read it).
        self.joined = 0
        #: Rounds (its own or joined) that took the held path on every rank.
        self.held_rounds = 0

    def vote(self, generating: bool, held: bool = False) -> tuple[int, bool]:
        """How many ranks generate in this round (this one included when ``generating``), and whether every rank
        takes the held path (``held``: this rank can; a rank that does not generate never stands in the way)."""
        flag = torch.tensor([int(generating), int(generating and not held)], dtype=torch.long, device=self.device)
        generating_ranks, blocked = (int(x) for x in self.reduce(flag).tolist())
        all_held = generating_ranks > 0 and blocked == 0
        self.held_rounds += all_held
        return generating_ranks, all_held

    def drain(self, join: Callable[[bool], Any]) -> int:
        """After this rank's loop: join the other ranks' rounds until no rank generates. ``join(held)`` makes the
        collectives of one round (``held``: the held path's gather; else a generation whose output is dropped).
        Returns the rounds joined."""
        joined = 0
        while True:
            generating_ranks, held = self.vote(False)
            if not generating_ranks:
                break
            join(held)
            joined += 1
        self.joined += joined
        return joined


def round_sync_for(trainer: Any) -> RoundSync | None:
    """A :class:`RoundSync` where the trainer's tool-loop generations are collectives (several processes under
    ZeRO-3 or FSDP, generating with ``transformers``), else None."""
    accelerator = trainer.accelerator
    if accelerator.num_processes <= 1 or trainer.use_vllm or trainer.use_transformers_continuous_batching:
        return None
    if not (is_zero3(accelerator) or trainer.is_fsdp_enabled):
        return None
    return RoundSync(lambda flag: accelerator.reduce(flag, reduction="sum"), accelerator.device)
