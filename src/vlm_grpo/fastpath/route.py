"""Which generations may take the shared prefill: the rest go through TRL's own path, whole.

``share_prefill`` / ``fast_decode`` reproduce ``generate``'s greedy search and sampling (its logits processors,
EOS handling and positions). Anything else TRL can ask of ``generate`` (beam search, stop strings, ``max_time``,
outputs beyond token ids, a static cache, a ``generate`` that a user or a test wrapped or patched) must not be
half-honoured: a prefill shared for G rows cannot feed a beam search of G x beams rows, and a decode loop that
never calls ``generate`` would skip a wrapper silently. Such a generation goes through TRL's path from the start,
and the reason is logged once.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
from typing import Any

from vlm_grpo.fastpath.decode import has_local_layers
from vlm_grpo.utils import is_zero3, peft_base

logger = logging.getLogger(__name__)

_logged: set[str] = set()


@functools.cache
def _stock_dirs() -> tuple[str, ...]:
    """Folders of the packages whose ``generate`` (and its decorators) we know: transformers, PEFT, torch."""
    import torch
    import transformers

    dirs = [transformers.__file__, torch.__file__]
    try:
        import peft

        dirs.append(peft.__file__)
    except ImportError:
        pass
    return tuple(os.path.dirname(os.path.abspath(d)) + os.sep for d in dirs)


def patched_generate(model: Any) -> str | None:
    """Why ``model.generate`` is not the stock one (patched on the instance or class, wrapped, overridden)."""
    stock = _stock_dirs()
    for obj in dict.fromkeys([model, peft_base(model)]):
        name = type(obj).__name__
        if "generate" in vars(obj):
            return f"{name}.generate is patched on the model instance"
        fn = getattr(type(obj), "generate", None)
        while fn is not None:
            fn = getattr(fn, "__func__", fn)
            code = getattr(fn, "__code__", None)
            if code is None or not os.path.abspath(code.co_filename).startswith(stock):
                where = code.co_filename if code is not None else type(fn).__name__
                return f"{name}.generate is wrapped or replaced ({where})"
            fn = getattr(fn, "__wrapped__", None)
    return None


def unhonoured_generation_option(model: Any, generation_config: Any) -> str | None:
    """The generation option fast decoding / the shared prefill cannot honour, or None.

    Judged on the configuration ``generate`` would use (the model's defaults merged in).
    """
    from transformers.generation.configuration_utils import GenerationMode

    gc, _ = peft_base(model)._prepare_generation_config(copy.deepcopy(generation_config))
    mode = gc.get_generation_mode()
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        return f"generation mode {mode.value} (num_beams={gc.num_beams})"
    if (gc.num_return_sequences or 1) > 1:
        return f"num_return_sequences={gc.num_return_sequences}"
    if gc.stop_strings:
        return f"stop_strings={gc.stop_strings!r}"
    if gc.max_time is not None:
        return f"max_time={gc.max_time}"
    if gc.return_dict_in_generate or gc.output_scores or gc.output_logits:
        return "generate outputs beyond token ids (return_dict_in_generate / output_scores / output_logits)"
    if gc.cache_implementation not in (None, "dynamic"):
        return f"cache_implementation={gc.cache_implementation!r} (generate sizes and compiles its own cache)"
    return None


def trl_generation_reason(
    trainer: Any, own_history: bool = False, token_type_ids: bool = False, paired: bool = False
) -> str | None:
    """Why this generation goes through TRL's ``_generate_single_turn`` rather than the shared prefill; None: share.

    ``own_history``: every row continues its own conversation (the turns of TRL's tool loop after a tool
    result). Ranks may then be in different turns: under ZeRO-3 with several processes these generations take the
    held-cache path only in a ``paired`` round (the ranks vote on its path, :mod:`vlm_grpo.tools.rounds`), and only
    with ``ds3_gather_for_generation`` (the parameters gathered once, the forward passes then local to the rank).
    ``token_type_ids``: the model marks images with ``token_type_ids`` (not Qwen's ``mm_token_type_ids``), which the
    prefill does not build. Logs the reason once per process (at info) unless the user turned ``share_prefill`` off.
    """
    if not trainer.args.share_prefill:
        return "share_prefill is off"
    reason = None
    if trainer.use_vllm:
        reason = "vLLM generates"
    elif trainer.use_transformers_continuous_batching:
        reason = "transformers continuous batching generates"
    elif token_type_ids:
        reason = "tool images for a model that takes token_type_ids"
    elif own_history and is_zero3(trainer.accelerator) and not trainer.args.ds3_gather_for_generation:
        reason = "tool-loop turns under ZeRO-3 without ds3_gather_for_generation (every forward gathers per module)"
    elif own_history and is_zero3(trainer.accelerator) and trainer.accelerator.num_processes > 1 and not paired:
        reason = "tool-loop turns under ZeRO-3 outside a tool round the ranks vote on (ranks may be in other turns)"
    elif trainer.is_fsdp_enabled:
        reason = "FSDP"
    else:
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        reason = patched_generate(model) or unhonoured_generation_option(model, trainer.generation_config)
        if reason is None and has_local_layers(model):
            reason = "sliding-window or hybrid attention layers (the shared prefill's cache is global)"
    if reason is not None and reason not in _logged:
        _logged.add(reason)
        logger.info("share_prefill/fast_decode cannot honour %s: generation goes through TRL's generate", reason)
    return reason
