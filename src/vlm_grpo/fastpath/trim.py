"""Cut a training micro-batch's completions to its own longest one (``trim_completion_padding``).

TRL pads every completion of a generation batch to the batch's longest and cuts the batch into micro-batches that
keep that width. When rows end at different lengths (real rollouts: a mean of a few hundred tokens, a tail to the
maximum), a micro-batch of a few rows runs the policy forward and backward over the batch's longest completion,
mostly padding. The columns past the micro-batch's last completion token hold no token of any row (their
``completion_mask`` is 0 in every row), and a causal model's outputs at the kept positions do not depend on them,
so dropping them from every per-token tensor of the micro-batch leaves every masked sum, hence the loss, its
gradients and the logged metrics, as they were.

Only the per-token tensors TRL builds are cut (:data:`PER_TOKEN`, and :data:`WHOLE_SEQUENCE` over prompt + completion);
a micro-batch carrying another tensor of either width (a subclass's or a plugin's) is left whole, with one info line.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

# TRL's per-token entries of a prepared micro-batch (rows x completion width).
PER_TOKEN = frozenset(
    {
        "completion_ids",
        "completion_mask",
        "old_per_token_logps",
        "ref_per_token_logps",
        "sampling_per_token_logps",
        "importance_sampling_ratio",
        "tool_mask",
        "advantages",  # (rows,) in GRPO; (rows, width) where a subclass gives per-token advantages
    }
)
# TRL's per-token entries over the whole sequence (rows x prompt + completion width): the prompt's, then zeros.
WHOLE_SEQUENCE = frozenset({"token_type_ids", "mm_token_type_ids"})
_logged: set[str] = set()


def trim_completion_padding(inputs: dict[str, Any]) -> dict[str, Any]:
    """``inputs`` with every per-token tensor cut to the last column where some row has a completion token."""
    mask = inputs.get("completion_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.size(1) == 0:
        return inputs
    rows, width = mask.shape
    prompt = inputs["prompt_ids"].size(1) if isinstance(inputs.get("prompt_ids"), torch.Tensor) else None
    widths = {"completion": width, "sequence": None if prompt is None else prompt + width}

    def span(value: Any) -> str | None:
        """Which width a tensor has (rows x ...), if one of the two."""
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.size(0) != rows:
            return None
        return next((name for name, w in widths.items() if value.size(1) == w), None)

    known = PER_TOKEN | WHOLE_SEQUENCE
    unknown = sorted(k for k, v in inputs.items() if k not in known and not k.startswith("prompt") and span(v))
    if unknown:
        reason = ", ".join(unknown)
        if reason not in _logged:
            _logged.add(reason)
            logger.info("trim_completion_padding: %s has the completions' width; micro-batches are not cut", reason)
        return inputs
    used = mask.any(dim=0)
    keep = int(used.nonzero().max()) + 1 if bool(used.any()) else 1
    if keep == width:
        return inputs
    out = dict(inputs)
    for key in known:
        value = inputs.get(key)
        kind = span(value)
        if key in PER_TOKEN and kind == "completion":
            out[key] = value[:, :keep]
        elif key in WHOLE_SEQUENCE and kind == "sequence":
            out[key] = value[:, : prompt + keep]
    return out
