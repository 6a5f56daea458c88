"""Qwen3-VL-MoE adapter (Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B).

Processor, vision tower, deepstack mergers, 3-D rope and the 0-1000 box frame are Qwen3-VL's, so the
Qwen3-VL adapter applies unchanged. The language model's MLPs are sparse: a router (``mlp.gate``, a plain
weight, no ``nn.Linear``) picks ``num_experts_per_tok`` experts per token, and the experts' weights are 3-D
parameters (``mlp.experts.gate_up_proj`` / ``down_proj``), not linear layers. LoRA therefore targets the
attention projections by default; layers listed in ``mlp_only_layers`` keep a dense MLP whose
``gate_proj``/``up_proj``/``down_proj`` are targeted too. Routing is per token, so the packed log-prob
pass and fast decode route every token as TRL's path does.
"""

from __future__ import annotations

from typing import ClassVar

from vlm_grpo.modules.qwen3_vl import Qwen3VLModule


class Qwen3VLMoeModule(Qwen3VLModule):
    """Qwen3-VL-MoE: Qwen3-VL with sparse-MoE decoder layers."""

    name: ClassVar[str] = "qwen3_vl_moe"
