"""Decode the G samples of shared-prefill generation from a static cache, one CUDA graph per attention window.

HF ``generate`` with a dynamic cache launches every kernel of every layer from Python for each new token: at 3B on
an H100 that is ~30 ms per token for a batch of 16, over 10x the memory-bandwidth floor. Every decode step has the
same shapes once the cache is static, so the step (decoder + LM head) is captured into a CUDA graph and replayed.
Token selection stays HF's own: the logits processors ``generate`` would build (temperature, top-k/p, min-p,
repetition penalty, suppressed tokens, ``min_new_tokens``), the same softmax / multinomial / argmax and EOS
handling, so sampling follows the same distribution and greedy tokens equal ``generate``'s (tested on CPU, where the
same loop runs without the graph). Where the processors read only the scores, that selection is part of the captured
step, so a token is one replay (:mod:`vlm_grpo.fastpath.decode_select`).

Attention windows (sdpa models under the graph): the static cache has room for the whole completion, but
step t only attends over the prompt and the t tokens written so far. Reading every slot costs ~1.2 ms of a
~5 ms token at 1024 completion tokens (H100, 3B). The decode is split into windows of ``ATTENTION_WINDOW``
slots: each window has its own step and graph, sharing the input buffers, the cache and the mask storage
(its mask is a prefix view), and attention reads only that prefix of the cache
(:func:`vlm_grpo.fastpath.decode_attention.decode_sdpa`). A window is captured when the loop first reaches
it; its warm-up passes write into the live cache mid-decode, so :func:`cache_restored` puts back what they
wrote. Eager attention keeps one window over the whole cache (transformers' eager path adds the mask to
scores over every slot).

Finished rows leave the batch (:mod:`vlm_grpo.fastpath.decode_compact`): at the host's checks for "every row ended"
(every ``_CHECK_EVERY`` tokens), once the live rows fit half the batch or less, they move to the front of the
workspace and the loop goes on over a narrower width, with steps (graphs) made per width and window. Tokens are
unchanged; a narrowed selection draws its noise for the whole batch, each row taking its own.

With ``SIZED_CACHE`` (off by default) the cache is sized to the rows' real lengths where the workspace is not kept:
windowed, it starts with the first window's slots and moves into larger storage when the longest running row reaches
the next window; after a compaction it moves into storage for the live rows only (unless it is exported).

Kept graphs (``keep_decode_graphs``): capturing costs two warm-up passes and the capture, ~0.04-0.08 s per call
at 3B on an H100. A kept :class:`_Workspace` (cache, buffers, mask, the steps and their graphs) and the kept fused
copy serve the next call: it loads its prompt into the same buffers and replays. It is used only while nothing a
graph bakes in has changed (the key: rows, dtypes, settings, module modes; the addresses of every tensor of the
model it reads) and its cache is long enough; otherwise the call makes a new one.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vlm_grpo.fastpath import decode_attention as attention_module
from vlm_grpo.fastpath import decode_compact as compaction
from vlm_grpo.fastpath import decode_keep, decode_mlp, row_ends, startup
from vlm_grpo.fastpath.block_attention import as_sdpa
from vlm_grpo.fastpath.decode_attention import SHARED_KWARG, decode_attention
from vlm_grpo.fastpath.decode_autocast import AutocastState
from vlm_grpo.fastpath.decode_autocast import without_cast_cache as _autocast
from vlm_grpo.fastpath.decode_cache import cache_restored, decode_cache, nbytes, resize, slots_dynamic
from vlm_grpo.fastpath.decode_fusion import fused_nbytes, fused_projections, release_kept, stand_in
from vlm_grpo.fastpath.decode_select import (
    InStep,
    Selection,
    default_generator,
    in_graph_blocker,
    prepared_generation_config,
    signature,
)
from vlm_grpo.fastpath.fallback import EagerOnFailure
from vlm_grpo.utils import peft_base, warn_once

logger = logging.getLogger(__name__)

_ATTENTION = ("sdpa", "eager")
_CHECK_EVERY = 8  # decode steps between host checks for "every row has ended"
# Static cache lengths are rounded up to a multiple of this: an unseen full-size cache length would cost a new
# compilation of the decode step (tens of seconds at 3B on an H100). The extra slots are masked out.
CACHE_BUCKET = 256
# Attention windows (sdpa under a CUDA graph): step t reads the smallest multiple of this many cache slots that
# holds its prompt + t + 1 tokens (capped at the cache length). One graph per window; 0: the whole cache.
ATTENTION_WINDOW = 256
# Tests: the windowed path (a step per window, warm-ups under cache_restored) without CUDA graphs too, on CPU.
_WINDOWS_WITHOUT_GRAPH = False
# Token selection (processors, sampling, EOS bookkeeping) inside the step's graph where its processors allow it
# (vlm_grpo.fastpath.decode_select); False: after each replay, eagerly (benchmarks compare the two).
SELECT_IN_GRAPH = True
_SELECT_IN_STEP_WITHOUT_GRAPH = False  # tests: the selection inside the step without a CUDA graph too, on CPU
# The decode cache sized to the rows' lengths where the workspace is not kept (a kept one's graphs replay on its
# addresses): it holds the current window's slots (and the spare one), grows into new storage as the longest row
# reaches the next window, and after a compaction keeps the live rows only (unless exported). Off: prompt +
# max_completion slots per row from the start (``bench_grpo.py --trainers ours:sized_cache=true`` compares).
SIZED_CACHE = False


def has_local_layers(model: Any) -> bool:
    """Whether some decoder layers attend within a window (Gemma 3's local layers, Mistral's sliding window).

    The speed path's masks (packed blocks, the decode step's cache windows) are global: such a model's passes
    go through TRL's path.
    """
    text_config = peft_base(model).config.get_text_config(decoder=True)
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is None:
        return getattr(text_config, "sliding_window", None) is not None
    return any(t != "full_attention" for t in layer_types)


def unsupported_reason(model: Any) -> str | None:
    """Why this model must decode with ``generate`` (after the shared prefill) instead; None if it need not."""
    base = peft_base(model)
    text_config = base.config.get_text_config(decoder=True)
    attn = as_sdpa(getattr(text_config, "_attn_implementation", None))
    if attn not in _ATTENTION:
        return f"attention implementation {attn!r} (fast decode supports {', '.join(_ATTENTION)})"
    if has_local_layers(model):
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


def window_schedule(prefix: int, steps: int, window: int, size: int) -> list[tuple[int, int]]:
    """(first decode step, window length) of each attention window a decode of ``steps`` tokens passes through.

    Step t writes slot ``prefix + t`` and attends over slots ``[0, prefix + t]``, so it needs the smallest
    multiple of ``window`` that is >= ``prefix + t + 1``, capped at the cache length ``size``. ``window`` 0: one
    window of ``size`` slots. Empty when there are no steps."""
    if steps <= 0:
        return []
    if window <= 0:
        return [(0, size)]
    schedule = []
    t = 0
    while t < steps:
        length = min(size, cache_length(prefix + t + 1, window))
        schedule.append((t, length))
        if length >= size:
            break
        t = length - prefix  # the first step whose slot lies past this window
    return schedule


_compiled_forward: Any = None
# Inductor options of the compiled step (those a torch lacks are left out). Combo kernels launch a layer's rotary and
# cache-write kernels as one instead of three: 3.92 -> 3.82 ms a token (H100, 3B, 16 rows, decode_lengths.py).
INDUCTOR_OPTIONS: dict[str, Any] = {"combo_kernels": True}


def _compiled() -> Any:
    """One compiled step per process: dynamo caches by code object, so later generation calls (new caches)
    reuse it. The first cache length compiles static kernels; the first call in another bucket recompiles
    once with the length dynamic, which then serves every later bucket (measured on an H100, 3B: static
    kernels were not measurably faster, and a static compilation per bucket costs 13-48 s each). A sized cache
    (``SIZED_CACHE``) changes its length within a call: its slot dimension is marked dynamic from the start.
    A compacting decode changes its row count within a call: every row dimension a step reads is marked dynamic
    from the full width on (:func:`vlm_grpo.fastpath.decode_compact.rows_dynamic`), so one compilation serves
    every width (without the marks: one at full width, one at the first narrower width).

    Attention windows change the mask's last dimension within a call. Left to dynamo, the first window would
    compile static and the next recompile with that dimension dynamic: two compilations in the first call.
    So :func:`_window_mask` marks it dynamic from the first window on (``maybe_mark_dynamic``: a hint, never an
    error), and one compilation serves every window of every call in the bucket (tested on CPU, counting dynamo's
    graphs). The cache's length dimension is left alone: it never changes within a call, and across buckets it
    goes dynamic at the first recompile, as before (a marked dimension gets its own symbol, never duck-sized to
    another, so no equality guard ties the window to the cache length). The guards windows add: window <= cache
    length (the K/V slice) and window != cache length (lowerings may check whether the sliced K/V and the mask
    view are contiguous, as they would be for a window spanning the whole cache; sdpa's did): hence the spare slot
    past the last window (see _fast_decode). Measured on an H100 (3B): one compilation in the first call at 128 and
    at 1024 tokens (five windows), none in later calls of the bucket."""
    global _compiled_forward
    if _compiled_forward is None:
        import torch._inductor.config as inductor

        options = {name: value for name, value in INDUCTOR_OPTIONS.items() if hasattr(inductor, name)}
        _compiled_forward = torch.compile(_decode_forward, options=options)
    return _compiled_forward


def _window_mask(mask: torch.Tensor, length: int, compile: bool) -> torch.Tensor:
    """The mask of a window: a view of the first ``length`` slots (same storage, so a graph captured on it sees
    what the loop writes into ``mask`` later); its length marked dynamic for a compiled step (see _compiled)."""
    view = mask[..., :length]
    if compile:
        torch._dynamo.maybe_mark_dynamic(view, view.dim() - 1)
    return view


class _Step:
    """One decode step over static buffers (the cache, the fed tokens and positions, a mask window);
    ``__call__(decoder, head)`` runs (or replays) it. The model is passed per call, not held: a step kept between
    generation calls (``keep_decode_graphs``) must not keep the model alive.

    ``in_step``: the step also opens the fed token's mask slot before its forward and selects the next token after
    it (:mod:`vlm_grpo.fastpath.decode_select`), so the graph captures the whole token.

    ``compile``: the step goes through ``torch.compile`` (inductor fuses the ~700 small elementwise and
    norm kernels a decoder step launches), and the CUDA graph then captures the compiled kernels. If
    compilation fails, the step warns once and runs eagerly.

    The graph is captured on the first call, mid-decode for a later window (see :func:`cache_restored`), in
    ``pool`` (the windows of a workspace share one memory pool: one runs at a time, and each one's logits are
    copied out before another replays). ``warm_up``: also run the warm-up passes without a graph (tests, on CPU).
    """

    def __init__(
        self, cache: Any, cache_kw: dict[str, Any], tokens, positions, mask, use_graph: bool, compile: bool = False,
        warmups: int = 2, pool: Any = None, warm_up: bool = False, autocast: AutocastState = None,
        in_step: InStep | None = None, rows_dynamic: bool = False,
    ) -> None:  # fmt: skip
        self.cache, self.autocast, self.in_step, self.rows_dynamic = cache, autocast, in_step, rows_dynamic
        self.tokens, self.positions, self.mask = tokens, positions, mask
        self.use_graph, self.warmups, self.pool = use_graph, warmups, pool
        self._cache_kwarg = cache_kw  # how the decoder takes the cache (see cache_kwarg)
        failed = "compile_decode: compiling the decode step failed"
        self._fn = EagerOnFailure(_compiled(), _decode_forward, logger, failed) if compile else _decode_forward
        self.graph = None
        self.logits: torch.Tensor | None = None
        self._pending = use_graph or warm_up  # warm-ups (and the capture) still to run, on the first call

    @property
    def compiled(self) -> bool:
        return isinstance(self._fn, EagerOnFailure) and self._fn.compiled

    def _forward(self, decoder: Any, head: Any) -> torch.Tensor:
        if self.in_step is not None:
            self.in_step.before()
        # Grouped K/V not copied per query head (sdpa); the prefill's autocast (see decode_autocast.autocast_seen).
        with decode_attention(decoder.config), _autocast(self.autocast):
            logits = self._fn(decoder, head, self.tokens, self.positions, self.mask, self._cache_kwarg)
        if self.in_step is not None:
            if self.rows_dynamic:  # the compiled selection's input: its rows dynamic, as the step's (decode_compact)
                torch._dynamo.maybe_mark_dynamic(logits, 0)
            self.in_step.after(logits)
        return logits

    def _warm_up(self, rewind: Callable[[], None], decoder: Any, head: Any) -> None:
        """Compilation, lazy cuBLAS / kernel selection: on a side stream under a graph. Each pass rewinds the
        cache first, so all of them write the step's own slot."""
        stream = torch.cuda.Stream() if self.use_graph else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for _ in range(self.warmups):
                rewind()
                self._forward(decoder, head)
        if stream is not None:
            torch.cuda.current_stream().wait_stream(stream)

    def _capture(self, decoder: Any, head: Any) -> None:
        """Warm-up, then capture (under a graph), with the cache put back as it was (see cache_restored), and
        the selection's buffers and the sampler too (see InStep.restored)."""
        with cache_restored(self.cache) as rewind:
            with self.in_step.restored() if self.in_step else contextlib.nullcontext(lambda: None) as reset:

                def again() -> None:
                    rewind()
                    reset()

                with startup.timed("decode_warmup"):
                    self._warm_up(again, decoder, head)
            if self.use_graph:
                self.graph = torch.cuda.CUDAGraph()
                with startup.timed("decode_capture"), torch.cuda.graph(self.graph, pool=self.pool):
                    self.logits = self._forward(decoder, head)

    def __call__(self, decoder: Any, head: Any) -> torch.Tensor:
        if self._pending:
            self._pending = False
            self._capture(decoder, head)
        if self.graph is None:
            return self._forward(decoder, head)
        self.graph.replay()
        return self.logits


@dataclass(eq=False)
class _Workspace:
    """What the decode steps read and write besides the model: the static cache (``slots`` per row), the fed
    tokens and positions, the mask, the graphs' memory pool, the token selection's buffers, the batch row each
    row holds (``order``, see :mod:`vlm_grpo.fastpath.decode_compact`), a view per width, and one step per
    width and attention window (by the two).
    Made per generation call, or kept for the next one (see :func:`fast_decode`'s ``keep``) under ``key`` (every
    setting a step's graph bakes in) and ``pointers`` (the addresses of every tensor of the model it reads)."""

    key: tuple
    pointers: tuple
    slots: int
    cache: Any
    tokens: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    pool: Any
    selection: Selection
    order: torch.Tensor
    shared: tuple[torch.Tensor, torch.Tensor] | None = None
    views: dict[int, compaction.View] = field(default_factory=dict)
    steps: dict[tuple[int, int], _Step] = field(default_factory=dict)


# One kept workspace per decoder (keep_decode_graphs); its steps hold no reference to the model.
_KEPT: weakref.WeakKeyDictionary[torch.nn.Module, _Workspace] = weakref.WeakKeyDictionary()


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
    autocast: AutocastState = None,
    keep: bool | None = False,
    export: list | None = None,
) -> torch.Tensor:
    """Tokens generated after ``input_ids`` (rows expanded by ``index``); their last token is not in the cache.

    ``prefill_cache`` holds the KV of ``input_ids[:, :-1]`` for the unique prompts; ``index[k]`` is the
    unique prompt of row k. ``next_positions`` are the rotary positions of each unique prompt's last
    token: ``(U,)`` for 1-D models, ``(3, U)`` for mrope. Returns ``(rows, steps)`` token ids, pad after
    EOS, like ``generate(...)[:, prompt_len:]``. ``fuse``: q|k|v and gate|up run as one GEMM each
    (:mod:`vlm_grpo.fastpath.decode_fusion`). ``autocast``: the prefill's (``autocast_seen``).
    ``keep``: keep the workspace (cache, buffers, captured graphs) and the fused copy for the next call, which
    then replays the graphs instead of capturing them again, as long as the batch's rows, the settings, the
    model's module modes and the addresses of its tensors are the same and the cache is long enough (else it
    makes a new one); None: keep them under a CUDA graph when they take at most ``decode_keep.KEEP_FRACTION`` of
    the card.
    ``export``: a list that gets the decode's static cache appended (the prompt's K/V from slot 0, then the fed
    tokens' from slot ``prompt_len - 1``); read it before the next call, which may reuse it.
    """
    from transformers import LogitsProcessorList

    base = peft_base(model)
    decoder = base.get_decoder()
    device = input_ids.device
    weights = next(decoder.parameters()).dtype
    cast = autocast[1] if autocast is not None and autocast[1] != weights else None  # fp32 weights under autocast
    head = base.get_output_embeddings()
    rows, prompt_len = input_ids.shape
    gc = prepared_generation_config(base, generation_config, prompt_len, device)
    steps = gc.max_length - prompt_len
    processors = base._get_logits_processor(
        generation_config=gc, input_ids_seq_length=prompt_len, encoder_input_ids=input_ids,
        prefix_allowed_tokens_fn=None, logits_processor=LogitsProcessorList(), device=device, model_kwargs={},
    )  # fmt: skip

    # Static cache of the expanded batch: the prompt's KV plus room for every decode step, rounded up to a
    # bucket (the slots past prefix + steps stay masked).
    prefix = prompt_len - 1
    size = cache_length(prefix + steps)
    attn = as_sdpa(base.config.get_text_config(decoder=True)._attn_implementation)
    # Attention windows: sdpa only (decode_sdpa reads the cache up to the mask's length; eager adds the mask to
    # scores over every slot), and only under the graph (tests: or when _WINDOWS_WITHOUT_GRAPH says so).
    windowed = attn == "sdpa" and ATTENTION_WINDOW > 0 and (use_graph or _WINDOWS_WITHOUT_GRAPH)
    # Windowed, the cache and the mask get one spare slot past the last window (never written, never attended):
    # every window is then a strict prefix, and its K/V slices and mask view are non-contiguous in every window.
    # A window spanning the whole cache would be contiguous, and a lowering may guard on that (sdpa's did): a recompile.
    slots = size + 1 if windowed else size
    layers = prefill_cache.layers
    in_step = _select_in_step(processors, use_graph)
    eos_count = None if gc._eos_token_tensor is None else gc._eos_token_tensor.numel()
    key = (
        rows, tuple((x.dtype, x.size(1), x.size(-1)) for layer in layers for x in (layer.keys, layer.values)),
        attn, windowed, tuple(next_positions.shape[:-1]), use_graph, compile, (fuse, decode_mlp.switches()), autocast,
        decode_keep.modes(decoder), eos_count, in_step and (gc.do_sample, signature(processors)),
        attention_module.SHARED_PROMPT,
    )  # fmt: skip
    if keep is None:
        kept = _KEPT.get(decoder)
        held = max(slots, kept.slots if kept is not None and kept.key == key else 0)
        per_slot = sum(
            x.size(1) * x.size(-1) * x.element_size() for layer in layers for x in (layer.keys, layer.values)
        )
        fused = fused_nbytes(decoder, cast, head, rows) if fuse else 0
        need = fused + held * rows * per_slot
        parked = decode_keep.spare_nbytes(decoder, kept, key) if use_graph else 0
        if parked and not decode_keep.within_budget(device, need + parked):
            decode_keep.drop_spares(decoder)  # the spares of other widths go first
        keep = decode_keep.keep_by_default(use_graph, device, need)
        if not keep:  # over the budget now (a longer decode): what was kept goes
            _KEPT.pop(decoder, None)
            decode_keep.drop_spares(decoder)
            release_kept(decoder)
    # keep False leaves a kept workspace alone: it is neither used nor freed by this call.
    with fused_projections(decoder, cast, head, keep=keep, rows=rows) if fuse else contextlib.nullcontext():
        head = stand_in(decoder, head)
        pointers = decode_keep.pointers(decoder, head) if keep else ()
        # The last workspace or a spare of this width (decode_keep.take); another is freed before the new one.
        ws = decode_keep.take(decoder, _KEPT.pop(decoder, None), key, slots, pointers) if keep else None
        # Sized (see SIZED_CACHE): a windowed cache starts with the first window's slots and the spare one.
        sized = SIZED_CACHE and not keep
        first = window_schedule(prefix, steps, ATTENTION_WINDOW, size)[:1] if sized and windowed else []
        if ws is None:
            ws = _workspace(
                base, layers, rows, slots, attn, next_positions, key, pointers, use_graph, eos_count,
                cache_slots=first[0][1] + 1 if first else None,
            )  # fmt: skip
        if keep:
            _KEPT[decoder] = ws
        try:
            out = _decode(
                decoder, head, ws, layers, index, input_ids, attention_mask, next_positions, gc, processors,
                prefix, steps, windowed, use_graph, compile, autocast, in_step, export is not None, sized,
            )  # fmt: skip
            if export is not None:
                export.append(ws.cache)
            return out
        except BaseException:
            if keep:
                _KEPT.pop(decoder, None)  # a step may be half captured
            raise


def _select_in_step(processors: Any, use_graph: bool) -> bool:
    """Whether the decode steps select the next token themselves (inside the graph); says once why not."""
    if not SELECT_IN_GRAPH or not (use_graph or _SELECT_IN_STEP_WITHOUT_GRAPH):
        return False
    reason = in_graph_blocker(processors)
    if reason is not None:
        message = f"fast_decode: the next token is chosen after each decode graph replay, not in the graph: {reason}"
        warn_once(logger, message, logging.INFO)
    return reason is None


def _workspace(
    base: Any, layers: Any, rows: int, slots: int, attn: str, next_positions: torch.Tensor, key: tuple,
    pointers: tuple, use_graph: bool, eos_count: int | None, cache_slots: int | None = None,
) -> _Workspace:  # fmt: skip
    """A new workspace of ``rows`` rows whose mask and selection span ``slots`` slots; its cache holds ``cache_slots``
    (default: ``slots``; fewer when it grows as the decode goes, see ``SIZED_CACHE``)."""
    cache = decode_cache(base.config, cache_slots or slots, layers, rows)
    device = next_positions.device
    if attn == "sdpa":
        mask = torch.ones(rows, 1, 1, slots, dtype=torch.bool, device=device)
    else:  # eager adds the mask to the scores
        mask = torch.zeros(rows, 1, 1, slots, dtype=layers[0].keys.dtype, device=device)
    tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
    # (rows, 1) or (3, rows, 1), rows outermost in memory: a narrower width's view (decode_compact) has the strides
    # of the full width's, so a compiled step with the rows dynamic does not tie a stride to the row count.
    positions = next_positions.new_zeros(rows, *next_positions.shape[:-1], 1).movedim(0, -2)
    pool = torch.cuda.graph_pool_handle() if use_graph else None
    selection = Selection(rows, slots + 1, eos_count, device)  # the prompt and every step fit in slots + 1 columns
    shared = None
    if attn == "sdpa" and attention_module.SHARED_PROMPT:  # int32: what decode_kernel's shared takes
        int32 = {"dtype": torch.int32, "device": device}
        shared = (torch.zeros(rows, **int32), torch.zeros((), **int32))  # first rows (per call), prompt slots
    order = torch.arange(rows, device=device)
    return _Workspace(key, pointers, slots, cache, tokens, positions, mask, pool, selection, order, shared)


def _decode(
    decoder: Any, head: Any, ws: _Workspace, layers: Any, index, input_ids, attention_mask, next_positions,
    gc: Any, processors: Any, prefix: int, steps: int, windowed: bool, use_graph: bool, compile: bool,
    autocast: AutocastState, in_step: bool, exported: bool, sized: bool = False,
) -> torch.Tensor:  # fmt: skip
    """The decode loop of :func:`fast_decode` over the workspace ``ws``; ``head``: the LM head or its stand-in.
    ``in_step``: each step (its graph) selects the next token itself; else the loop does, after each replay.
    ``exported``: the cache is handed on, so its rows are put back in batch order after a compaction.
    ``sized``: the cache grows by windows and drops the rows a compaction leaves behind (see ``SIZED_CACHE``)."""
    prompt_len = input_ids.size(1)
    rows = input_ids.size(0)
    cache, mask, tokens, positions, sel = ws.cache, ws.mask, ws.tokens, ws.positions, ws.selection
    size = ws.slots - 1 if windowed else ws.slots
    if mask.dtype == torch.bool:
        attend, blocked = True, False
    else:
        attend, blocked = 0.0, torch.finfo(mask.dtype).min
    windows = dict(window_schedule(prefix, steps, ATTENTION_WINDOW if windowed else 0, size))

    # Load the prompt (the slots past it hold the last call's tokens, masked out). The steps capture later, on
    # their first call, and put back what their warm-ups write.
    for layer, src in zip(cache.layers, layers, strict=True):
        layer.keys[:, :, :prefix].copy_(src.keys[index])
        layer.values[:, :, :prefix].copy_(src.values[index])
        layer.cumulative_length.fill_(prefix)
    mask.fill_(blocked)
    mask[:, 0, 0, :prefix].masked_fill_(attention_mask[:, :prefix].bool(), attend)
    tokens.copy_(input_ids[:, -1:])
    positions.copy_(next_positions[..., index].unsqueeze(-1))
    sel.load(input_ids, prefix, gc, processors)
    ws.order.copy_(torch.arange(rows, device=ws.order.device))
    del layers
    if ws.shared is not None:  # the decode attention reads each prompt's slots from its first row (see _workspace)
        ws.shared[0].copy_(compaction.first_rows(index))
        ws.shared[1].fill_(prefix)
    compact = compaction.enabled(processors, rows, sel.eos is not None)

    # Per width (rows leave the batch: decode_compact), the selection in the step and how the decoder takes the cache.
    per_width: dict[int, tuple[InStep | None, dict[str, Any]]] = {}
    made = bool(ws.steps)  # a step was made on this workspace: the kernels are compiled and loaded

    def moved(cache_rows: int, cache_slots: int, written: int) -> None:
        """The cache into new storage (sized): the views and steps made on the old one go first, so that it is freed
        layer by layer (none of them is used again: windows only grow, widths only narrow, within a call). The next
        steps capture into a new pool: one whose graphs are all gone cannot take another capture (PyTorch asserts)."""
        ws.views.clear()
        per_width.clear()
        ws.steps.clear()
        ws.pool = torch.cuda.graph_pool_handle() if ws.pool is not None else None
        peak = resize(ws.cache, cache_rows, cache_slots, written, dynamic=windowed)
        stats.allocations.append((cache_rows, cache_slots))
        stats.peak_cache_bytes = max(stats.peak_cache_bytes, peak)

    def step_for(width: int, length: int) -> _Step:
        step = ws.steps.get((width, length))
        if step is None:  # a width or window not reached before: its step captures on its first call
            v = compaction.view(ws, width)
            if width not in per_width:
                fed = (v.tokens, v.positions)
                select = InStep(v.selection, v.mask, attend, gc.do_sample, *fed, compile) if in_step else None
                shared = {SHARED_KWARG: v.shared} if v.shared is not None else {}
                per_width[width] = (select, {**cache_kwarg(decoder, v.cache), **shared})
            selector, cache_kw = per_width[width]
            view = _window_mask(v.mask, length, compile) if windowed else v.mask
            dynamic = compile and compact  # the width changes within the call: one compilation for every width
            if dynamic:
                compaction.rows_dynamic(v, view)
            nonlocal made
            warmups, made = 1 if made else 2, True  # later steps: the kernels are compiled and loaded already
            step = ws.steps[width, length] = _Step(
                v.cache, cache_kw, v.tokens, v.positions, view, use_graph, compile, warmups, ws.pool,
                warm_up=windowed, autocast=autocast, in_step=selector, rows_dynamic=dynamic,
            )  # fmt: skip
        return step

    # The selection counts, on the device, the steps produced while some row was unfinished (the output length
    # generate would return); the host checks for "all finished" only every _CHECK_EVERY tokens, not every token.
    # generate draws once per token it returns; this loop may run up to _CHECK_EVERY - 1 steps past the end: the
    # sampler's state before each draw since the last check is kept, to hand back what generate leaves.
    rng = default_generator(input_ids.device) if gc.do_sample else None
    states: dict[int, torch.Tensor] = {}
    stats = compaction.last_stats = compaction.DecodeStats(rows=rows, widths=[rows])
    stats.allocations, stats.peak_cache_bytes = [tuple(ws.cache.layers[0].keys.shape[::2])], nbytes(ws.cache)
    if sized and windowed:  # the cache's slots change within the call: one compilation for all (see _compiled)
        slots_dynamic(ws.cache)
    width, length = rows, 0
    told = row_ends.watch(rows, prompt_len) if sel.eos is not None else None  # rows that ended, to a listener
    step: _Step | None = None
    t = -1
    for t in range(steps):
        if t in windows:
            length, step = windows[t], None
            if sized and windowed and length + 1 > ws.cache.layers[0].keys.size(2):  # a window past its slots
                moved(ws.cache.layers[0].keys.size(0), length + 1, prefix + t)
        if step is None:
            step = step_for(width, length)
        if rng is not None:
            states[t] = rng.get_state()  # host-side (CPU state, or CUDA seed + offset): no device sync
        if in_step:
            step(decoder, head)
        else:
            v = compaction.view(ws, width)
            v.selection.open(mask, attend)
            logits = step(decoder, head)  # consumed (copied) by the selection before the next replay
            ids = v.selection.out[:, : prompt_len + t]
            v.selection.select(logits, processors, ids, gc.do_sample, v.tokens, v.positions)
            del v  # a view of the cache, which a sized decode may move
        stats.steps, stats.row_steps = t + 1, stats.row_steps + width
        if sel.eos is not None and (t + 1) % _CHECK_EVERY == 0:
            if told is not None:
                told(ws, t + 1)
            live = int(sel.unfinished[:width].sum())
            if not live:
                break
            states.clear()  # some row goes on: the output is longer than t + 1 tokens
            new = compaction.narrower(rows, width, live) if compact and t + 1 < steps else None
            if new is not None:
                compaction.compact(ws, width, new, prefix + t + 1, prompt_len + t + 1, index)
                width, step = new, None
                stats.narrowed(width, t + 1)
                if sized and not exported:  # the finished rows' K/V is read no more
                    moved(new, ws.cache.layers[0].keys.size(2), prefix + t + 1)
    length = int(sel.produced) if sel.eos is not None else steps
    if rng is not None and length < t + 1:
        rng.set_state(states[length])  # the sampler as generate leaves it: later draws (next step, next batch) agree
    out = sel.out[:, prompt_len : prompt_len + length]
    if width == rows:
        return out.clone()  # a kept workspace's buffer: the next call reuses it
    if exported:
        compaction.cache_in_batch_order(ws, prefix + t + 1)
    return compaction.in_batch_order(ws, out)
