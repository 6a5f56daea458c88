"""The update pass of an accumulation window in a few large forwards + backwards (``update_chunk_tokens``).

TRL runs a window one micro-batch at a time: with EasyR1's micro-batches of 4 rows that is 20 small forwards and
backwards per optimizer step, and the host (kernel launches, autograd) sets the pace, not the GPU. Here, at the
window's first micro-step, its micro-batches before the last are laid, in order, into chunks of at most
``update_chunk_tokens`` tokens (:func:`plan_chunks`); each chunk runs one forward of all its
rows (the trainer's own log-prob pass, packed or TRL's), then each micro-batch's loss is TRL's own ``_compute_loss``
on its own rows, fed the log-probs and entropies the chunk computed for them, and the chunk's losses go through one
backward. So every loss type keeps its normaliser (per sequence, per micro-batch tokens, ``num_items_in_batch``,
...), its scaling for gradient accumulation and its per-micro-batch metrics, in TRL's order. The window's other
micro-steps run no forward: each returns its micro-batch's loss for the Trainer's logging. The last micro-batch runs
as TRL's step, outside DDP's ``no_sync``, so gradients are all-reduced once at the boundary, as TRL does, and the
state TRL updates there (the adaptive entropy coefficient) is updated there.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from trl import GRPOTrainer

from vlm_grpo.utils import warn_once

logger = logging.getLogger(__name__)

_LOGP_SIGNATURE = inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies)
_CALL_ARGS = frozenset({"self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size"})
_CALL_ARGS |= {"compute_entropy", "compute_aux_loss"}
#: Multimodal inputs laid out per token like ``input_ids``: padded with them, not concatenated.
TOKEN_ALIGNED = frozenset({"token_type_ids", "mm_token_type_ids"})


def fused_update_reason(trainer: Any) -> str | None:
    """Why this run's update pass cannot be fused (None: it can), for the one info line."""
    args = trainer.args
    ga = args.gradient_accumulation_steps
    if ga < 2:
        return "gradient_accumulation_steps=1: one micro-batch per optimizer step, nothing to fuse"
    if args.steps_per_generation % ga:
        return f"steps_per_generation={args.steps_per_generation} is not a multiple of gradient_accumulation_steps={ga}"
    if trainer.is_deepspeed_enabled:
        return "DeepSpeed: its engine counts a micro-step at every backward"
    if trainer.is_fsdp_enabled:
        return "FSDP: its sharded parameters are gathered per forward and resharded per backward"
    if args.n_gpu > 1:
        return "torch DataParallel (several GPUs in one process): launch one process per GPU"
    if trainer.aux_loss_enabled:
        return "the router's auxiliary loss is a mean over a forward's tokens, not a micro-batch's"
    if "lomo" in str(args.optim):
        return "LOMO optimizers update the parameters inside backward"
    return None


@dataclass
class ForwardCall:
    """The log-prob call TRL's ``_compute_loss`` makes for one micro-batch."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    logits_to_keep: int
    mm: dict[str, Any]

    @property
    def rows(self) -> int:
        return self.input_ids.size(0)

    @property
    def prompt_width(self) -> int:
        return self.input_ids.size(1) - self.logits_to_keep

    @property
    def tokens(self) -> int:
        """Prompt + completion tokens of its rows, padding excluded."""
        return int(self.attention_mask.sum())


class _Recorded(Exception):
    """Ends TRL's ``_compute_loss`` once its log-prob call is known."""


@contextlib.contextmanager
def _logps_replaced(trainer: Any, fn: Callable) -> Iterator[None]:
    """``trainer._get_per_token_logps_and_entropies`` is ``fn`` inside the block (this instance only)."""
    trainer.__dict__["_get_per_token_logps_and_entropies"] = fn
    try:
        yield
    finally:
        del trainer.__dict__["_get_per_token_logps_and_entropies"]


def _bound(trainer: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = _LOGP_SIGNATURE.bind(trainer, *args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def record_forward(trainer: Any, model: Any, inputs: dict[str, Any]) -> ForwardCall:
    """The inputs TRL's loss hands its log-prob pass for ``inputs``: TRL's ``_compute_loss`` runs up to that call
    (its tensors' concatenation) and stops, so the forward's inputs are TRL's whichever fields a family has."""
    seen: dict[str, Any] = {}

    def record(*args: Any, **kwargs: Any) -> None:
        seen.update(_bound(trainer, args, kwargs))
        raise _Recorded

    with _logps_replaced(trainer, record), contextlib.suppress(_Recorded):
        trainer._compute_loss(model, inputs)
    mm = {k: v for k, v in seen.items() if k not in _CALL_ARGS}
    return ForwardCall(seen["input_ids"], seen["attention_mask"], seen["logits_to_keep"], mm)


def plan_chunks(calls: list[ForwardCall], budget: int, padded: bool = False) -> list[list[int]]:
    """Consecutive micro-batches per forward while the forward's tokens stay within ``budget``; a micro-batch over
    the budget gets a forward of its own. Tokens are the rows' own (prompt + completion, padding excluded: the packed
    pass, as EasyR1's ``dynamic_batching`` counts them), or with ``padded`` (TRL's pass) rows x (longest prompt +
    longest completion)."""
    chunks: list[list[int]] = []
    rows = prompt = completion = tokens = 0
    for i, call in enumerate(calls):
        grown = (rows + call.rows, max(prompt, call.prompt_width), max(completion, call.logits_to_keep))
        cost = grown[0] * (grown[1] + grown[2]) if padded else tokens + call.tokens
        if chunks and cost <= budget:
            chunks[-1].append(i)
            rows, prompt, completion = grown
            tokens += call.tokens
        else:
            chunks.append([i])
            rows, prompt, completion, tokens = call.rows, call.prompt_width, call.logits_to_keep, call.tokens
    return chunks


def split_to(chunks: list[list[int]], count: int) -> list[list[int]]:
    """``chunks`` cut into ``count`` chunks (the largest halved first): every rank runs as many forwards."""
    chunks = [list(c) for c in chunks]
    while len(chunks) < count:
        i = max(range(len(chunks)), key=lambda j: len(chunks[j]))
        if len(chunks[i]) < 2:
            raise ValueError(f"cannot cut {sum(map(len, chunks))} micro-batches into {count} forwards")
        half = len(chunks[i]) // 2
        chunks[i : i + 1] = [chunks[i][:half], chunks[i][half:]]
    return chunks


def merge_problem(calls: list[ForwardCall]) -> str | None:
    """Why the micro-batches' inputs cannot be stacked into one forward (None: they can)."""
    for key in calls[0].mm:
        values = [c.mm[key] for c in calls]
        if all(v is None for v in values):
            continue
        if any(v is None for v in values):
            return f"{key} is given for some micro-batches only"
        if key in TOKEN_ALIGNED or isinstance(values[0], list):
            continue
        if isinstance(values[0], torch.Tensor):
            if len({v.shape[1:] for v in values}) > 1:
                return f"{key} has different shapes past its first dimension"
        elif any(v != values[0] for v in values):
            return f"{key} differs between micro-batches"
    return None


def _merge_field(key: str, values: list[Any], calls: list[ForwardCall], pad: tuple[int, int]) -> Any:
    if values[0] is None:
        return None
    if key in TOKEN_ALIGNED:
        return torch.cat([_pad_like_ids(v, c, *pad, 0) for v, c in zip(values, calls, strict=True)])
    if isinstance(values[0], torch.Tensor):
        return torch.cat(values)
    if isinstance(values[0], list):
        return [x for v in values for x in v]
    return values[0]


def _pad_like_ids(t: torch.Tensor, call: ForwardCall, prompt: int, completion: int, value: int) -> torch.Tensor:
    """``t`` laid out as ``input_ids`` ([prompt | completion]) with the prompt left-padded to ``prompt`` tokens and the
    completion right-padded to ``completion``, as TRL pads them."""
    C = call.logits_to_keep
    head = F.pad(t[:, : t.size(1) - C], (prompt - call.prompt_width, 0), value=value)
    return torch.cat([head, F.pad(t[:, t.size(1) - C :], (0, completion - C), value=value)], dim=1)


def merge_calls(calls: list[ForwardCall], pad_id: int) -> ForwardCall:
    """One forward over the rows of ``calls``, in order (:func:`merge_problem` says when it cannot be)."""
    pad = (max(c.prompt_width for c in calls), max(c.logits_to_keep for c in calls))
    ids = torch.cat([_pad_like_ids(c.input_ids, c, *pad, pad_id) for c in calls])
    mask = torch.cat([_pad_like_ids(c.attention_mask, c, *pad, 0) for c in calls])
    mm = {key: _merge_field(key, [c.mm[key] for c in calls], calls, pad) for key in calls[0].mm}
    return ForwardCall(ids, mask, pad[1], mm)


@dataclass
class FusedWindow:
    """What one window's fused micro-steps hand the Trainer: each micro-batch's loss, and its advantages to check
    that the Trainer hands the micro-batches in the order they were computed."""

    losses: list[torch.Tensor] = field(default_factory=list)
    advantages: list[torch.Tensor] = field(default_factory=list)
    forwards: int = 0
    planned: int = 0  # forwards this rank's own plan needed (before the ranks agreed on one count)


def run_window(
    trainer: Any,
    model: Any,
    micro_batches: list[dict[str, Any]],
    loss_fn: Callable[[dict[str, Any]], torch.Tensor],
    budget: int,
) -> FusedWindow:
    """Forward, loss and backward of ``micro_batches`` in chunks of at most ``budget`` padded tokens; the losses
    are ``loss_fn``'s (TRL's ``compute_loss``) for each micro-batch, in order."""
    calls = [record_forward(trainer, model, mb) for mb in micro_batches]
    problem = merge_problem(calls)
    if problem is None:
        chunks = plan_chunks(calls, budget, padded=not trainer.args.share_prompt)
    else:  # e.g. images padded to different sizes per micro-batch
        warn_once(logger, f"update_chunk_tokens: a window runs one forward per micro-batch: {problem}", logging.INFO)
        chunks = [[i] for i in range(len(calls))]
    window = FusedWindow(planned=len(chunks))
    if trainer.accelerator.num_processes > 1:  # DDP: every rank runs the same number of forwards
        count = torch.tensor(len(chunks), device=trainer.accelerator.device)
        chunks = split_to(chunks, int(trainer.accelerator.reduce(count, reduction="max").item()))
    pad_id = trainer._tokenizer.pad_token_id or 0  # where the mask is 0: any id
    for chunk in chunks:
        members = [calls[i] for i in chunk]
        merged = merge_calls(members, pad_id) if len(members) > 1 else members[0]
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            model,
            merged.input_ids,
            merged.attention_mask,
            merged.logits_to_keep,
            compute_entropy=True,
            compute_aux_loss=False,
            **merged.mm,
        )
        window.forwards += 1
        total: torch.Tensor | None = None
        start = 0
        for i, call in zip(chunk, members, strict=True):
            rows = slice(start, start + call.rows)
            start += call.rows
            served = (logps[rows, : call.logits_to_keep], entropies[rows, : call.logits_to_keep], None)
            with _logps_replaced(trainer, _server(trainer, call, served)):
                loss = loss_fn(micro_batches[i])
            window.losses.append(loss.detach())
            window.advantages.append(micro_batches[i]["advantages"])
            total = loss if total is None else total + loss
        trainer.accelerator.backward(total)
    return window


def _server(trainer: Any, call: ForwardCall, served: tuple) -> Callable:
    """Stands in for the log-prob pass inside one micro-batch's loss: the chunk's rows for it, after checking that
    TRL asks for the call that was recorded."""

    def serve(*args: Any, **kwargs: Any) -> tuple:
        asked = _bound(trainer, args, kwargs)
        if asked["input_ids"].shape != call.input_ids.shape or asked["logits_to_keep"] != call.logits_to_keep:
            raise RuntimeError("update_chunk_tokens: the loss asked for other rows than the chunk computed")
        return served

    return serve


class FusedUpdate:
    """The trainer's fused update: ``loss`` stands in for ``compute_loss`` at each training micro-step."""

    def __init__(self, trainer: Any) -> None:
        self.budget = trainer.args.update_chunk_tokens
        self.window: FusedWindow | None = None
        self.reason = fused_update_reason(trainer) if self.budget is not None else None
        if self.reason is not None:
            logger.info("update_chunk_tokens: the update pass runs TRL's micro-batches one by one: %s", self.reason)
        #: Forwards the last fused window ran, and those this rank's own plan needed (before the ranks agreed).
        self.last_forwards = self.last_planned = 0

    @property
    def enabled(self) -> bool:
        return self.budget is not None and self.reason is None

    def loss(
        self,
        trainer: Any,
        model: Any,
        inputs: dict[str, Any],
        micro_batch: Callable[[dict[str, Any]], dict[str, Any]],
        loss_fn: Callable[[dict[str, Any]], torch.Tensor],
    ) -> torch.Tensor | None:
        """This micro-step's loss, or None where TRL's own step runs (evaluation, the window's last micro-batch,
        a window shortened at an epoch's end). ``micro_batch`` makes a buffered slice what ``_prepare_inputs``
        hands the Trainer."""
        # Set by the Trainer's loop for each optimizer step (absent where compute_loss is called outside it).
        ga = getattr(trainer, "current_gradient_accumulation_steps", None) if self.enabled else None
        if not (trainer.model.training and ga == trainer.args.gradient_accumulation_steps):
            self.window = None
            return None
        position = trainer._step % ga
        if position == ga - 1:
            self.window = None
            return None
        if position == 0:
            spg = trainer.args.steps_per_generation
            slices = [micro_batch(trainer._buffered_inputs[(trainer._step + j) % spg]) for j in range(ga - 1)]
            self.window = run_window(trainer, model, slices, loss_fn, self.budget)
            self.last_forwards = self.window.forwards
            self.last_planned = self.window.planned
        window = self.window
        if window is None:  # a window that did not start at its first micro-step: TRL's steps
            return None
        if not torch.equal(window.advantages[position], inputs["advantages"]):
            raise RuntimeError("update_chunk_tokens: the Trainer handed a micro-batch the fused window did not compute")
        return window.losses[position].clone().requires_grad_(True)
