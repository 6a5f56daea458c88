"""Tool-loop rounds kept paired across ranks where generating is a collective (DeepSpeed ZeRO-3, FSDP).

Under ZeRO-3 every generation call gathers the partitioned parameters and ``generate`` steps in ``synced_gpus``
mode (one all-reduce per token, until every rank is done); FSDP gathers its units likewise. TRL's tool loop runs as
many rounds as the rank's own rollouts need, so a rank whose rollouts all answered leaves the loop (and goes on to the
log-prob passes) while another rank gathers for its next round: the ranks' collectives part ways and the run aborts
(gloo: a connection reset or a size mismatch) or hangs (NCCL).

:class:`RoundSync` keeps them paired without touching TRL's loop: before each round's generation a rank votes that it
generates (an all-reduce of 1); a rank whose loop has ended keeps voting 0, and while any rank votes 1 it joins that
round with a one-token generation of its own (the same gather, the same ``synced_gpus`` steps until the others are
done). When every rank votes 0, all leave together. A run where generating is local to the rank (one process, DDP,
ZeRO-1/2, vLLM) has no collectives to pair and builds no :class:`RoundSync`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vlm_grpo.utils import is_zero3


class RoundSync:
    """The votes of one process; ``reduce`` sums a one-element tensor over the ranks (``accelerator.reduce``)."""

    def __init__(self, reduce: Callable[[torch.Tensor], torch.Tensor], device: torch.device | str = "cpu") -> None:
        self.reduce = reduce
        self.device = device
        #: Rounds of other ranks this process joined without a round of its own (tests and logs read it).
        self.joined = 0

    def vote(self, generating: bool) -> int:
        """How many ranks generate in this round (this one included when ``generating``)."""
        flag = torch.tensor([1 if generating else 0], dtype=torch.long, device=self.device)
        return int(self.reduce(flag).item())

    def drain(self, join: Callable[[], Any]) -> int:
        """After this rank's loop: join the other ranks' rounds (``join``: one generation call whose output is
        dropped) until no rank generates. Returns the rounds joined."""
        joined = 0
        while self.vote(False):
            join()
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
