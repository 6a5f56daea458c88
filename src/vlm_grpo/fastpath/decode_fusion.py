"""One GEMM for q|k|v and one for gate|up in ``fast_decode``'s step, from weights fused per generation call.

At decode a batch is ~16 rows, so every projection is a matrix-vector product bound by reading its
weight. Profiled on an H100 (Qwen2.5-VL-3B, 16 rows): the k and v projections (1 MB each) took as long
as q (8 MB), ~5.8 us each, and the three ran at a third of the card's bandwidth; gate and up at ~70%.
One GEMM over the concatenated weights reads the same bytes in one launch at a higher bandwidth.

The fused weights are built from the live weights when a generation call starts (training has changed them since
the last call) and dropped when it ends; they cost one extra copy of the fused projections for that time (3B: ~3.6
GB; 7B: ~8.5 GB). Under ``keep_decode_graphs`` the copy is kept instead, and each call refills the same storage,
the addresses a kept CUDA graph reads. The model's modules are not rewritten: for the duration of the call, each
projection's ``nn.Linear`` is replaced by a :class:`_Part` that returns its slice of the group's one GEMM, computed
by whichever part of the group is called first for an input. Under PEFT, a LoRA layer without dropout is replaced
as a whole and its active adapters' ``scaling * B @ A`` is added to its rows of the fused copy (the model's own
weights are never changed), so a LoRA decode step costs what a full one does; with dropout, only the base Linear is
replaced and the layer adds its adapter term itself. The projections outside the groups (o, down) get the same
folding, each a group of one, when they carry a foldable LoRA layer: its adapter would otherwise add two small
GEMMs and an add per layer and token (H100, 3B, LoRA r64 on every projection: 6.1 ms per decoded token against 4.7
for full fine-tuning). A plain Linear outside the groups is left alone (a copy of its weight would gain nothing),
except under a mixed-precision autocast.

Under a bf16 autocast with fp32 weights (``--bf16`` without DeepSpeed, TRL's default fp32 load), every GEMM of
every decode step would read its fp32 weight and write and read a bf16 copy: about four times the bytes of bf16
weights. ``dtype`` then builds every fused weight in the autocast's dtype, and o and down get a copy of their
own too. The numbers are the same: autocast casts the weight to that dtype before the GEMM anyway.
The LM head gets its copy too (3B: otherwise 1.2 GB of fp32 read and 0.6 GB of bf16 written and read again at
every step). It lives outside the decoder and is not swapped: :func:`stand_in` gives the caller its stand-in.

For decode calls of a few rows (``decode_mlp.ROWS_MAX``) without a cast, a plain SiLU MLP is not a gate|up group:
the whole MLP module is swapped for ``decode_mlp.FusedMLP``, two Triton kernels on its live weights (no copy), or,
under foldable LoRA layers, on copies with the adapters folded in (made per call like the groups').
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlm_grpo.fastpath import decode_mlp

# Projections that read the same input in the decoders of the supported families (Qwen2/2.5/3-VL; InternVL
# with a Qwen2/Qwen3 language model), in the order the model calls them.
GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# The other projections of those decoders: folded alone, and only when they carry a foldable LoRA layer.
SINGLES: tuple[str, ...] = ("o_proj", "down_proj")


class _Group:
    """The fused weight of one group (set for the length of a generation call) and its pending outputs.

    ``loras[i]``: the PEFT LoRA layer whose adapters are folded into part i's rows of the fused weight (the
    layer itself is swapped out for the call), or None."""

    def __init__(self, linears: Sequence[nn.Linear], loras: Sequence[Any | None]) -> None:
        self.linears, self.loras = list(linears), list(loras)
        self.sizes = [m.out_features for m in linears]
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.kept: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (weight, bias) kept between calls
        self.outputs: tuple[torch.Tensor, ...] | None = None
        self.pending = 0  # parts still to hand their slice of ``outputs`` out

    def build(self, dtype: torch.dtype | None = None, keep: bool = False) -> None:
        """Concatenate the live weights (training changed them since the last generation call); in ``dtype``.
        ``keep``: into the kept storage, made by the first such call and refilled by the later ones (a kept CUDA
        graph reads it there; see ``keep_decode_graphs``); otherwise into new storage, freed by :meth:`drop`."""
        linears = self.linears
        first = linears[0].weight
        shape, dtype, has_bias = self._layout(dtype)
        kept = self.kept if keep else None
        storage = kept if kept is not None and _fits(kept[0], shape, dtype, first.device) else None
        if storage is None:
            if keep:
                self.kept = None  # a kept copy of another shape is freed before the new one is made
            bias = torch.empty(shape[:1], dtype=dtype, device=first.device) if has_bias else None
            storage = (torch.empty(shape, dtype=dtype, device=first.device), bias)
            if keep:
                self.kept = storage
        weight, bias = storage
        for linear, lora, out in zip(linears, self.loras, weight.split(self.sizes), strict=True):
            delta = _lora_delta(lora) if lora is not None else None
            w = linear.weight
            out.copy_(w if delta is None else (w.float() + delta).to(w.dtype))
        if bias is not None:
            for m, out in zip(linears, bias.split(self.sizes), strict=True):
                out.copy_(m.bias) if m.bias is not None else out.zero_()
        self.weight, self.bias = weight, bias
        self.pending = 0

    def _layout(self, dtype: torch.dtype | None) -> tuple[tuple[int, int], torch.dtype, bool]:
        """(shape, dtype, whether it has a bias) of the fused copy in ``dtype`` (None: the weights' own)."""
        first = self.linears[0].weight
        has_bias = any(m.bias is not None for m in self.linears)
        return (sum(self.sizes), first.size(1)), dtype or first.dtype, has_bias

    def nbytes(self, dtype: torch.dtype | None = None) -> int:
        (rows, cols), dtype, has_bias = self._layout(dtype)
        return rows * (cols + has_bias) * dtype.itemsize

    def drop(self) -> None:
        """End of a call: the call's references go (a kept copy stays in ``kept``)."""
        self.weight = self.bias = self.outputs = None
        self.pending = 0


def _fits(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> bool:
    return tuple(t.shape) == shape and t.dtype == dtype and t.device == device


def _is_lora_layer(module: Any) -> bool:
    return all(hasattr(module, a) for a in ("lora_A", "lora_B", "scaling", "base_layer", "active_adapters"))


def _foldable_lora(module: Any) -> bool:
    """A LoRA layer whose adapters can be folded into the fused weight exactly: plain Linear A and B over a plain
    Linear, no dropout (with dropout, generate draws masks; the layer then runs as it is), no DoRA, no bias."""
    if not _is_lora_layer(module) or type(module.base_layer) is not nn.Linear or getattr(module, "fan_in_fan_out", 0):
        return False
    for name in module.lora_A:
        if (
            type(module.lora_A[name]) is not nn.Linear
            or name not in module.lora_B
            or type(module.lora_B[name]) is not nn.Linear
        ):
            return False
        if not isinstance(module.lora_dropout[name], nn.Identity):
            return False
        if getattr(module, "use_dora", {}).get(name) or getattr(module, "lora_bias", {}).get(name):
            return False
        if name in getattr(module, "lora_variant", {}):  # DoRA and later variants have their own forward
            return False
    return True


def _lora_delta(lora: Any) -> torch.Tensor | None:
    """The active adapters' ``scaling * B @ A`` (fp32), what the LoRA layer adds to ``x @ W.T``; None when it
    adds nothing (adapters merged into W already, or disabled)."""
    if lora.merged or lora.disable_adapters:
        return None
    delta = None
    for name in lora.active_adapters:
        if name in lora.lora_A:
            d = (lora.lora_B[name].weight.float() @ lora.lora_A[name].weight.float()) * lora.scaling[name]
            delta = d if delta is None else delta + d
    return delta


class _Part(nn.Module):
    """Stands in for one ``nn.Linear`` of a group during a generation call.

    The first part called for an input runs the group's GEMM; the others return their slices of it. Every
    part of a group is called once per layer pass (the decoder calls all of q, k, v; gate and up), so the
    count of parts still pending says when the next call is for a new input.
    """

    def __init__(self, group: _Group, index: int, original: nn.Linear) -> None:
        super().__init__()
        self.group, self.index = group, index
        # What code reading a Linear's attributes expects (PEFT reads base_layer.weight's dtype and device).
        self.weight, self.bias = original.weight, original.bias
        self.in_features, self.out_features = original.in_features, original.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.group
        if group.pending == 0:
            group.outputs = F.linear(x, group.weight, group.bias).split(group.sizes, dim=-1)
            group.pending = len(group.sizes)
        group.pending -= 1
        out = group.outputs[self.index]
        if group.pending == 0:
            group.outputs = None  # nothing outlives the layer pass (and a compiled step returns no extra tensors)
        return out


def _innermost_linear(holder: nn.Module, key: str) -> tuple[nn.Module, str, nn.Linear] | None:
    """(holder, attribute, plain Linear) of the projection ``holder.key``, looking through PEFT's ``base_layer``;
    None if it is not a plain ``nn.Linear`` (quantized, already fused, ...)."""
    module = getattr(holder, key)
    while isinstance(getattr(module, "base_layer", None), nn.Module):
        holder, key, module = module, "base_layer", module.base_layer
    return (holder, key, module) if type(module) is nn.Linear else None


_Swap = tuple[nn.Module, str, nn.Module, nn.Module]  # holder, attribute, the module there, its stand-in
# The groups, the swaps, and the stand-ins for modules outside the decoder (the LM head), which the caller calls
# in their place (swapping them would need their holder, the whole model, in this cache: it would never be freed).
_Plan = tuple[list[_Group], list[_Swap], dict[nn.Module, _Part]]
# The parts of a decoder (per "every single too": see fused_projections), kept between generation calls: a
# compiled decode step guards on the objects it traced through, so new objects at every call could recompile it
# (tens of seconds at 3B).
_PLANS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, _Plan]] = weakref.WeakKeyDictionary()
_ACTIVE: weakref.WeakKeyDictionary[nn.Module, _Plan] = weakref.WeakKeyDictionary()  # inside fused_projections


def _plan(decoder: nn.Module, every_single: bool, head: nn.Module | None, mlp_kernel: bool) -> _Plan:
    groups: list[_Group] = []
    swaps: list[_Swap] = []
    outside: dict[nn.Module, _Part] = {}
    if type(head) is nn.Linear:  # the LM head: a group of one, called through stand_in
        group = _Group([head], [None])
        groups.append(group)
        outside[head] = _Part(group, 0, head)
    # A plain SiLU MLP runs as decode_mlp's kernels on its live weights (no gate|up copy), a LoRA one on copies
    # with its adapters folded in. Not under a cast: the kernels would read the fp32 weights.
    kernels: set[nn.Module] = set()
    for holder in decoder.modules() if mlp_kernel and not every_single else []:
        for name, child in holder.named_children():
            fused = decode_mlp.stand_in_for(child) or _folded_mlp(child, groups)
            if fused is not None:
                swaps.append((holder, name, child, fused))
                kernels.add(child)
    for module in decoder.modules():
        if module in kernels:
            continue
        singles = [(n,) for n in SINGLES if every_single or _foldable_lora(getattr(module, n, None))]
        for names in (*GROUPS, *singles):
            if not all(isinstance(getattr(module, n, None), nn.Module) for n in names):
                continue
            found = []
            for n in names:
                projection = getattr(module, n)
                if _foldable_lora(projection):  # the whole LoRA layer stands aside: its adapters are in the GEMM
                    found.append((module, n, projection.base_layer, projection))
                else:  # the innermost Linear stands aside (a LoRA layer around it still adds its own term)
                    inner = _innermost_linear(module, n)
                    found.append(None if inner is None else (*inner, None))
            if any(f is None for f in found):
                continue
            linears = [f[2] for f in found]
            first = linears[0].weight
            if any(
                m.in_features != linears[0].in_features or m.weight.dtype != first.dtype
                or m.weight.device != first.device for m in linears
            ):  # fmt: skip
                continue
            group = _Group(linears, [f[3] for f in found])
            groups.append(group)
            for index, (holder, key, linear, _) in enumerate(found):
                swaps.append((holder, key, getattr(holder, key), _Part(group, index, linear)))
    return groups, swaps, outside


def _folded_mlp(mlp: nn.Module, groups: list[_Group]) -> decode_mlp.FusedMLP | None:
    """The kernels for a SiLU MLP under PEFT, where each projection is a plain Linear or a foldable LoRA layer over
    one and some are LoRA: on copies with the adapters folded in, made per call like the groups' (gate|up one
    group, down another; a projection group without LoRA reads its live weights). None otherwise."""
    projections = decode_mlp.silu_mlp(mlp)
    if projections is None:
        return None
    loras = [p if _foldable_lora(p) else None for p in projections]
    linears = [p.base_layer if lora is not None else p for p, lora in zip(projections, loras, strict=True)]
    if not any(loras) or any(type(m) is not nn.Linear for m in linears) or not decode_mlp.kernel_takes(*linears):
        return None
    gate_up = _Group(linears[:2], loras[:2]) if any(loras[:2]) else None
    down = _Group(linears[2:], loras[2:]) if loras[2] is not None else None
    groups.extend(group for group in (gate_up, down) if group is not None)
    inter = linears[0].out_features

    def weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # read during the call, after the build
        if gate_up is None:
            gate, up = linears[0].weight, linears[1].weight
        else:
            gate, up = gate_up.weight[:inter], gate_up.weight[inter:]
        return gate, up, linears[2].weight if down is None else down.weight

    return decode_mlp.FusedMLP(mlp, weights)


def stand_in(decoder: nn.Module, module: nn.Module) -> nn.Module:
    """What to call instead of ``module`` (the LM head passed to :func:`fused_projections`) while that context is
    active for ``decoder``; ``module`` itself otherwise."""
    plan = _ACTIVE.get(decoder)
    return plan[2].get(module, module) if plan is not None else module


def _unmerges_on_forward(module: nn.Module) -> bool:
    """A LoRA layer with merged adapters that are disabled: its forward unmerges them from the base weight,
    which the fused copy would not see."""
    return _is_lora_layer(module) and bool(module.disable_adapters) and bool(module.merged)


def _current_plan(decoder: nn.Module, every_single: bool, head: nn.Module | None, rows: int | None) -> _Plan:
    plans = _PLANS.setdefault(decoder, {})
    mlp_kernel = decode_mlp.KERNEL and rows is not None and rows <= decode_mlp.ROWS_MAX
    key = (every_single, head, mlp_kernel)
    plan = plans.get(key)
    if plan is None or any(getattr(holder, name, None) is not original for holder, name, original, _ in plan[1]):
        plan = plans[key] = _plan(decoder, every_single, head, mlp_kernel)  # first call, or the modules changed
    return plan


def fused_nbytes(
    decoder: nn.Module, dtype: torch.dtype | None = None, head: nn.Module | None = None, rows: int | None = None
) -> int:
    """Bytes of the copy :func:`fused_projections` makes with these arguments."""
    every_single = dtype is not None
    groups = _current_plan(decoder, every_single, head if every_single else None, rows)[0]
    return sum(group.nbytes(dtype) for group in groups)


def kept_tensors(decoder: nn.Module) -> list[torch.Tensor]:
    """The fused weights (and biases) of the active call: what a captured decode step reads besides the model."""
    plan = _ACTIVE.get(decoder)
    groups = plan[0] if plan is not None else []
    return [t for group in groups for t in (group.weight, group.bias) if t is not None]


@contextlib.contextmanager
def fused_projections(
    decoder: nn.Module, dtype: torch.dtype | None = None, head: nn.Module | None = None, keep: bool = False,
    rows: int | None = None,
) -> Iterator[int]:  # fmt: skip
    """While active, every q|k|v and gate|up group of ``decoder`` runs as one GEMM (and every o / down projection
    with a foldable LoRA layer as one plain GEMM). ``dtype``: the autocast's, when it differs from the weights'
    (see the module doc): every fused weight in it, and every o / down projection too. ``head``: the LM head; with
    ``dtype``, :func:`stand_in` gives what to call in its place, a copy in ``dtype`` (a plain ``nn.Linear`` only).
    ``keep``: the copy is made in storage kept after the call, which the next such call refills (a kept decode
    graph reads it there; :func:`release_kept` frees it); otherwise in storage of the call's own, freed on exit
    (a kept copy is left alone). ``rows``: the rows each decode step computes; up to ``decode_mlp.ROWS_MAX`` (and
    without ``dtype``), each plain SiLU MLP runs as ``decode_mlp``'s kernels on its live weights instead of a
    gate|up group. Yields the number of groups fused (0 when none qualifies: the model runs unchanged). The modules
    are restored on exit."""
    every_single = dtype is not None
    head = head if every_single else None  # the head only needs a stand-in to be cast
    plan = _current_plan(decoder, every_single, head, rows)
    groups, swaps, _ = plan
    if any(_unmerges_on_forward(m) for m in decoder.modules()):
        yield 0  # PEFT would change the base weights during the call: the model runs unchanged
        return
    done: list[_Swap] = []
    try:
        with torch.no_grad():
            for group in groups:
                group.build(dtype, keep)
        for swap in swaps:
            holder, name, _, part = swap
            setattr(holder, name, part)
            done.append(swap)
        _ACTIVE[decoder] = plan
        yield len(groups)
    finally:
        _ACTIVE.pop(decoder, None)
        for holder, name, original, _ in reversed(done):
            setattr(holder, name, original)
        for group in groups:
            group.drop()


def release_kept(decoder: nn.Module) -> None:
    """Free the fused copies kept for ``decoder`` (see ``keep`` in :func:`fused_projections`)."""
    for groups, _, _ in _PLANS.get(decoder, {}).values():
        for group in groups:
            group.kept = None
