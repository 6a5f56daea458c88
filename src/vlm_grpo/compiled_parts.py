"""``torch.compile`` for the norms and MLPs of every layer (``compile_norms_and_mlps``).

Once a GRPO group is computed once, the training passes are short and launch-bound: a profile of the
3B preset's loss forward + backward shows the GPU busy for well under half of the window, with ~20,000
kernels. Many are small elementwise ones: a Qwen RMSNorm is eight (fp32 cast, square, mean, rsqrt,
products, casts), the gated MLP adds its activation and product, and each runs again in the backward and
in gradient-checkpoint recomputation. Inductor fuses each norm and each MLP into a few kernels.

Whole decoder layers are not compiled: transformers checkpoints inside the layer's ``forward`` and the
packed attention kernels break graphs, which a checkpointed region does not allow. Norms and MLPs hold
no attention and compile whole. Dynamo keys its cache on code, so every layer's norm shares one graph per
input kind (training, no-grad; a size change recompiles once with that size dynamic).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vlm_grpo.trainer_common import model_base

logger = logging.getLogger(__name__)


def _is_part(name: str, module: torch.nn.Module) -> bool:
    cls = type(module).__name__
    if cls.endswith("RMSNorm"):
        return True
    # Mixture-of-experts blocks route tokens data-dependently: not one graph.
    return name.rpartition(".")[2] == "mlp" and not any(k in cls.lower() for k in ("moe", "sparse", "expert"))


def compile_norms_and_mlps(model: Any) -> int:
    """Compile the RMSNorm and (dense) MLP modules of ``model`` (wrappers allowed) in place; returns how many.

    ``Module.compile`` keeps parameter names and ``state_dict`` unchanged, so checkpoints and LoRA adapters
    save as before.
    """
    parts = [m for name, m in model_base(model).named_modules() if _is_part(name, m)]
    for module in parts:
        module.compile()
    logger.info("compile_norms_and_mlps: %d modules go through torch.compile", len(parts))
    return len(parts)
