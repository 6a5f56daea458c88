"""Decode the G samples of shared-prefill generation from a static cache, one CUDA graph per call.

HF ``generate`` with a dynamic cache launches every kernel of every layer from Python for each new
token: at 3B on an H100 that is ~30 ms per token for a batch of 16, over 10x the memory-bandwidth
floor. Every decode step has the same shapes once the cache is static, so the step (decoder + LM
head) is captured once per call into a CUDA graph and replayed. Token selection stays HF's own:
the logits processors ``generate`` would build (temperature, top-k/p, min-p, repetition penalty,
suppressed tokens, ``min_new_tokens``), the same softmax / multinomial / argmax and EOS handling,
so sampling follows the same distribution and greedy tokens equal ``generate``'s (tested on CPU,
where the same loop runs without the graph).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
from typing import Any

import torch

from vlm_grpo.fastpath.block_attention import as_sdpa
from vlm_grpo.fastpath.decode_attention import decode_attention
from vlm_grpo.fastpath.decode_fusion import fused_projections
from vlm_grpo.fastpath.fallback import EagerOnFailure
from vlm_grpo.utils import peft_base

logger = logging.getLogger(__name__)

_ATTENTION = ("sdpa", "eager")
_CHECK_EVERY = 8  # decode steps between host checks for "every row has ended"
# Static cache lengths are rounded up to a multiple of this. Prompt lengths change every step; an unseen
# cache length would otherwise cost a new compilation of the decode step (tens of seconds at 3B on an
# H100), and a repeated length costs nothing. The extra slots are masked out: tokens are unchanged.
CACHE_BUCKET = 256


def unsupported_reason(model: Any) -> str | None:
    """Why this model must decode with ``generate`` (after the shared prefill) instead; None if it need not."""
    base = peft_base(model)
    text_config = base.config.get_text_config(decoder=True)
    attn = as_sdpa(getattr(text_config, "_attn_implementation", None))
    if attn not in _ATTENTION:
        return f"attention implementation {attn!r} (fast decode supports {', '.join(_ATTENTION)})"
    if any(t != "full_attention" for t in getattr(text_config, "layer_types", None) or ["full_attention"]):
        return "sliding-window or hybrid attention layers"
    # Generation options (beam search, stop strings, ...) never reach this point: see vlm_grpo.fastpath.route.
    return None


def cache_kwarg(model: Any, cache: Any) -> dict[str, Any]:
    """transformers renamed ``past_key_values`` to ``cache`` (5.2x); pass whichever this version takes."""
    base = peft_base(model)  # PEFT hides the signature
    return {"cache": cache} if "cache" in inspect.signature(base.forward).parameters else {"past_key_values": cache}


def _decode_forward(decoder: Any, head: Any, tokens, positions, mask, cache_kw: dict[str, Any]) -> torch.Tensor:
    out = decoder(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True, **cache_kw)
    return head(out.last_hidden_state[:, -1, :])


def cache_length(needed: int, bucket: int | None = None) -> int:
    """The static cache length for ``needed`` slots: the next multiple of ``bucket`` (default
    ``CACHE_BUCKET``), so that nearby prompt lengths share one cache shape, hence one compiled decode step."""
    bucket = bucket or CACHE_BUCKET
    return -(-needed // bucket) * bucket


_compiled_forward: Any = None


def _compiled() -> Any:
    """One compiled step per process: dynamo caches by code object, so later generation calls (new caches)
    reuse it. The first cache length compiles static kernels; the first call in another bucket recompiles
    once with the length dynamic, which then serves every later bucket (measured on an H100, 3B: static
    kernels were not measurably faster, and a static compilation per bucket costs 13-48 s each)."""
    global _compiled_forward
    if _compiled_forward is None:
        _compiled_forward = torch.compile(_decode_forward)
    return _compiled_forward


class _Step:
    """Static input buffers + a static cache; ``__call__`` runs (or replays) one decode step.

    ``compile``: the step goes through ``torch.compile`` (inductor fuses the ~700 small elementwise and
    norm kernels a decoder step launches), and the CUDA graph then captures the compiled kernels. If
    compilation fails, the step warns once and runs eagerly.
    """

    def __init__(
        self, decoder: Any, head: Any, cache: Any, tokens, positions, mask, use_graph: bool, compile: bool = False
    ) -> None:
        self.decoder, self.head, self.cache = decoder, head, cache
        self.tokens, self.positions, self.mask = tokens, positions, mask
        self._cache_kwarg = cache_kwarg(decoder, cache)
        failed = "compile_decode: compiling the decode step failed"
        self._fn = EagerOnFailure(_compiled(), _decode_forward, logger, failed) if compile else _decode_forward
        self.graph = None
        self.logits: torch.Tensor | None = None
        if use_graph:
            self._capture()

    @property
    def compiled(self) -> bool:
        return isinstance(self._fn, EagerOnFailure) and self._fn.compiled

    def _forward(self) -> torch.Tensor:
        with decode_attention(self.decoder.config):  # grouped K/V not copied per query head (sdpa)
            return self._fn(self.decoder, self.head, self.tokens, self.positions, self.mask, self._cache_kwarg)

    def _capture(self) -> None:
        # Warm-up on a side stream (compilation, lazy cuBLAS / kernel selection), then capture. Both write
        # into the cache and advance its length; the caller loads the prompt's KV and resets the length after.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._forward()

    def __call__(self) -> torch.Tensor:
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        return self.logits


def _prepared_generation_config(base: Any, generation_config: Any, prompt_len: int, device) -> Any:
    """The generation config ``generate`` would use: model defaults merged, special tokens as tensors."""
    gc, _ = base._prepare_generation_config(copy.deepcopy(generation_config))
    if gc.max_new_tokens is not None:
        gc.max_length = prompt_len + gc.max_new_tokens
    base._prepare_special_tokens(gc, True, device=device)
    return gc


def _default_generator(device: torch.device) -> torch.Generator | None:
    """The generator ``torch.multinomial`` draws from on ``device`` (the one generate samples with)."""
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator if device.type == "cpu" else None


def fast_decode(
    model: Any,
    prefill_cache: Any,
    index: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    next_positions: torch.Tensor,
    generation_config: Any,
    use_graph: bool,
    compile: bool = False,
    fuse: bool = True,
) -> torch.Tensor:
    """Tokens generated after ``input_ids`` (rows expanded by ``index``); their last token is not in the cache.

    ``prefill_cache`` holds the KV of ``input_ids[:, :-1]`` for the unique prompts; ``index[k]`` is the
    unique prompt of row k. ``next_positions`` are the rotary positions of each unique prompt's last
    token: ``(U,)`` for 1-D models, ``(3, U)`` for mrope. Returns ``(rows, steps)`` token ids, pad after
    EOS, like ``generate(...)[:, prompt_len:]``. ``fuse``: q|k|v and gate|up run as one GEMM each
    (:mod:`vlm_grpo.fastpath.decode_fusion`).
    """
    decoder = peft_base(model).get_decoder()
    with fused_projections(decoder) if fuse else contextlib.nullcontext():
        return _fast_decode(
            model, prefill_cache, index, input_ids, attention_mask, next_positions, generation_config,
            use_graph, compile,
        )  # fmt: skip


def _fast_decode(
    model: Any, prefill_cache: Any, index, input_ids, attention_mask, next_positions, generation_config: Any,
    use_graph: bool, compile: bool,
) -> torch.Tensor:  # fmt: skip
    from transformers import LogitsProcessorList, StaticCache

    base = peft_base(model)
    decoder, head = base.get_decoder(), base.get_output_embeddings()
    device = input_ids.device
    rows, prompt_len = input_ids.shape
    gc = _prepared_generation_config(base, generation_config, prompt_len, device)
    steps = gc.max_length - prompt_len
    processors = base._get_logits_processor(
        generation_config=gc, input_ids_seq_length=prompt_len, encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(), device=device, model_kwargs={},
    )  # fmt: skip

    # Static cache of the expanded batch: the prompt's KV plus room for every decode step, rounded up to a
    # bucket (the slots past prefix + steps stay masked).
    prefix = prompt_len - 1
    size = cache_length(prefix + steps)
    layers = prefill_cache.layers
    cache = StaticCache(config=base.config, max_cache_len=size)
    kv_dtype = layers[0].keys.dtype
    cache.early_initialization(
        rows, [layer.keys.size(1) for layer in layers], [layer.keys.size(-1) for layer in layers], kv_dtype, device
    )
    attn = as_sdpa(base.config.get_text_config(decoder=True)._attn_implementation)
    if attn == "sdpa":
        mask = torch.ones(rows, 1, 1, size, dtype=torch.bool, device=device)
        attend, blocked = True, False
    else:  # eager adds the mask to the scores
        mask = torch.zeros(rows, 1, 1, size, dtype=kv_dtype, device=device)
        attend, blocked = 0.0, torch.finfo(kv_dtype).min
    tokens = input_ids[:, -1:].clone()
    positions = next_positions[..., index].clone().unsqueeze(-1)  # (rows, 1) or (3, rows, 1)
    step = _Step(decoder, head, cache, tokens, positions, mask, use_graph, compile)

    # Load the prompt (the warm-up and capture above wrote into the cache and advanced it).
    for layer, src in zip(cache.layers, layers, strict=True):
        layer.keys[:, :, :prefix].copy_(src.keys[index])
        layer.values[:, :, :prefix].copy_(src.values[index])
        layer.cumulative_length.fill_(prefix)
    mask.fill_(blocked)
    mask[:, 0, 0, :prefix].masked_fill_(attention_mask[:, :prefix].bool(), attend)
    del prefill_cache, layers

    pad = gc._pad_token_tensor
    eos = gc._eos_token_tensor
    unfinished = torch.ones(rows, dtype=torch.long, device=device)
    # Steps produced while some row was unfinished: the output length generate would return. Counted on
    # the device so the host checks for "all finished" only every _CHECK_EVERY tokens, not once per token.
    produced = torch.zeros((), dtype=torch.long, device=device)
    generated = torch.cat([input_ids, input_ids.new_zeros(rows, steps)], dim=-1)
    # generate draws once per token it returns; this loop may run up to _CHECK_EVERY - 1 steps past the end.
    # The sampler's state before each draw since the last check is kept, to hand back what generate leaves.
    rng = _default_generator(device) if gc.do_sample else None
    states: dict[int, torch.Tensor] = {}
    t = -1
    for t in range(steps):
        mask[:, 0, 0, prefix + t] = attend  # the token fed now attends to itself
        logits = step().to(copy=True, dtype=torch.float32)
        scores = processors(generated[:, : prompt_len + t], logits)
        if gc.do_sample:
            if rng is not None:
                states[t] = rng.get_state()  # host-side (CPU state, or CUDA seed + offset): no device sync
            next_tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        else:
            next_tokens = torch.argmax(scores, dim=-1)
        if eos is not None:
            produced += unfinished.any()
            next_tokens = next_tokens * unfinished + pad * (1 - unfinished)
            unfinished = unfinished & ~torch.isin(next_tokens, eos)
        generated[:, prompt_len + t] = next_tokens
        if eos is not None and (t + 1) % _CHECK_EVERY == 0:
            if not bool(unfinished.any()):
                break
            states.clear()  # some row goes on: the output is longer than t + 1 tokens
        tokens.copy_(next_tokens[:, None])
        positions.add_(1)
    length = int(produced) if eos is not None else steps
    if rng is not None and length < t + 1:
        rng.set_state(states[length])  # the sampler as generate leaves it: later draws (next step, next batch) agree
    del step, cache
    return generated[:, prompt_len : prompt_len + length]
