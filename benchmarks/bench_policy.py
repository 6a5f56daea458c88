"""What a benchmark run trains, and on what card: the random-weight policy (``build_policy``), the trainer variants'
switches (``is_vanilla``, ``parse_variant``, ``BENCH_ONLY``, ``bench_switches``), the card's peaks
(``hbm_bandwidth``, ``card_peak_tflops``), ``decode_weight_bytes`` for the decode floor, and the MFU
(``active_params``, ``mfu``: an MoE's routed experts count as many as each token runs through).

It imports no other benchmark script.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

# Dense bf16 peak of the card, TFLOP/s (for MFU).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
# Peak HBM bandwidth of the card, bytes/s (datasheet), for the decode floor.
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.04e12}


def is_vanilla(kind: str) -> bool:
    """``vanilla`` and its variants (``vanilla_static:cache_implementation=static``) run plain TRL."""
    return kind.partition(":")[0].startswith("vanilla")


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """``name`` or ``name:key=value,key=value`` -> (name, VLMGRPOConfig overrides).

    ``cache_implementation=static`` goes into ``generation_kwargs``; true/false become booleans, digits integers.
    Keys in :data:`BENCH_ONLY` are the benchmark's own switches (see :func:`bench_switches`), not config fields.
    """
    name, _, rest = spec.partition(":")
    overrides: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        overrides[key] = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)
    return name, overrides


BENCH_ONLY = {
    "compile_vision", "select_in_graph", "varlen_blocks", "varlen_vision", "decode_kernel", "compile_select",
    "decode_mlp", "down_slices", "block_multiple", "compact_rows", "sized_cache", "cpu_windows",
}  # fmt: skip
# decode_mlp's (BN2, BK2, DOWN_SLICES) with down over the whole K: 16 columns per program, 512-column blocks
# (``down_slices=false`` here and in decode_lengths.py).
WHOLE_K_DOWN = (16, 512, 1)


@contextmanager
def bench_switches(kind: str):
    """The variant's benchmark-only switches, for the duration of its run. ``compile_vision=false``: the packed
    passes compile the decoder layers only, not the vision blocks (``compile_layers`` does both), to measure what
    the vision blocks' compilation is worth. ``select_in_graph=false``: fast_decode chooses each token after the
    decode graph's replay, not inside the graph. ``varlen_blocks=false``: the packed passes' attention runs as
    per-row calls (a compiler-disabled island), not as one varlen flash call. ``varlen_vision=false``: the vision
    tower's attention runs as per-length sdpa calls (an island), not as one varlen flash call per layer.
    ``decode_kernel=false``: the decode step's attention runs as two matmuls and a softmax, not as the Triton
    flash-decoding kernel. ``compile_select=false``: a compiled decode step's in-graph token selection runs eagerly,
    not through torch.compile. ``decode_mlp=false``: the decode step's MLP runs as the fused gate|up GEMM, SiLU and
    down, not as two Triton kernels. ``down_slices=false``: the MLP kernels' down takes 16 columns per program over
    the whole K, not slices of K with fp32 partial sums. ``block_multiple=N``: the packed passes' blocks are rounded
    up to N tokens (at most C + 1: a large N gives every row the batch's longest completion, the uniform layout)."""
    from vlm_grpo.fastpath import (
        block_attention,
        compiled_layers,
        decode,
        decode_attention,
        decode_mlp,
        decode_select,
        sharing,
        vision_attention,
    )

    switches = parse_variant(kind)[1]
    multiple = sharing.BLOCK_MULTIPLE
    sharing.BLOCK_MULTIPLE = int(switches.get("block_multiple", multiple))
    real, select = compiled_layers.vision_blocks, decode.SELECT_IN_GRAPH
    text_varlen, vision_varlen = block_attention.VARLEN, vision_attention.VARLEN
    kernel, compiled_select, mlp = decode_attention.KERNEL, decode_select.COMPILE, decode_mlp.KERNEL
    down = decode_mlp.BN2, decode_mlp.BK2, decode_mlp.DOWN_SLICES
    if switches.get("down_slices") is False:
        decode_mlp.BN2, decode_mlp.BK2, decode_mlp.DOWN_SLICES = WHOLE_K_DOWN
    if switches.get("compile_vision") is False:
        compiled_layers.vision_blocks = lambda model, vlm_module: []
    decode.SELECT_IN_GRAPH = switches.get("select_in_graph", select) is not False
    block_attention.VARLEN = switches.get("varlen_blocks", text_varlen) is not False
    vision_attention.VARLEN = switches.get("varlen_vision", vision_varlen) is not False
    decode_attention.KERNEL = switches.get("decode_kernel", kernel) is not False
    decode_select.COMPILE = switches.get("compile_select", compiled_select) is not False
    decode_mlp.KERNEL = switches.get("decode_mlp", mlp) is not False
    try:
        yield
    finally:
        compiled_layers.vision_blocks, decode.SELECT_IN_GRAPH = real, select
        block_attention.VARLEN, vision_attention.VARLEN = text_varlen, vision_varlen
        decode_attention.KERNEL, decode_select.COMPILE, decode_mlp.KERNEL = kernel, compiled_select, mlp
        decode_mlp.BN2, decode_mlp.BK2, decode_mlp.DOWN_SLICES = down
        sharing.BLOCK_MULTIPLE = multiple


def build_policy(
    args: argparse.Namespace,
    workdir: Path,
    tag: str,
    lora_r: int = 0,
    lora_dropout: float = 0.05,
    freeze_vision: bool = False,
) -> tuple[Any, Any, Any]:
    """(model, processor, adapter) of ``args.preset`` with random weights, on ``args.device`` in ``args.dtype``.

    A reference model (beta > 0) is loaded by TRL from the policy's path: the weights are saved under
    ``workdir/model_<tag>`` then. ``lora_r > 0`` wraps the model in LoRA on the language model with the
    vision tower frozen (the targets the package picks), once, so every trainer trains the same adapter.
    ``freeze_vision`` (without LoRA): the vision tower and projector are frozen for every trainer.
    ``lora_dropout == 0`` lets fast decode fold the adapters into its fused weights (``decode_fusion``).
    """
    from vlm_grpo.modules import get_vlm_module
    from vlm_grpo.testing.tiny import build_model, get_preset

    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    ref_dir = workdir / f"model_{tag}" if args.beta > 0 else None
    model, processor = build_model(args.preset, out_dir=ref_dir, seed=args.seed, dtype=dtype, device=args.device)
    if ref_dir is not None:
        model.config._name_or_path = str(ref_dir)
    module = get_vlm_module("", get_preset(args.preset).family)
    processor = module.prepare_processor(processor)  # left padding, family fixes (as load_processor)
    module.prepare_model(model)  # both trainers get the model the package trains
    if lora_r:
        from peft import LoraConfig, get_peft_model

        from vlm_grpo.trainer_common import apply_adapter_options

        lora = LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=lora_dropout, task_type="CAUSAL_LM")
        apply_adapter_options(module, model, lora, freeze_vision_modules=True)
        model = get_peft_model(model, lora)
    elif freeze_vision:
        module.freeze_vision(model)  # the tower and projector train nothing: the log-prob passes may reuse features
    return model, processor, module


def hbm_bandwidth(device: str) -> float | None:
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in HBM_BYTES_PER_S.items() if k in name), None)


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: the text decoder's layers and final norm plus the LM head
    (the input embedding is a lookup of a few rows; the vision tower does not run)."""
    from vlm_grpo.utils import peft_base

    base = peft_base(model)
    decoder, head = base.get_decoder(), base.get_output_embeddings()
    lookup_only = {id(p) for p in decoder.get_input_embeddings().parameters()} - {id(p) for p in head.parameters()}
    params = {id(p): p for p in [*decoder.parameters(), *head.parameters()] if id(p) not in lookup_only}
    return sum(p.numel() * p.element_size() for p in params.values())


def card_peak_tflops(device: str) -> float | None:
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def active_params(model: torch.nn.Module) -> int:
    """Parameters one token runs through, for the MFU's ``6 * N * tokens``: all of a dense model's; of an MoE's routed
    experts (the ``experts`` modules: one slice per expert) only ``num_experts_per_tok`` of ``num_experts``
    (``n_routed_experts`` in GLM-4.5V), while its router and shared experts count in full."""
    config = model.config.get_text_config()
    routed = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    params = {id(p): (name, p.numel()) for name, p in model.named_parameters()}  # tied weights once
    total = sum(n for _, n in params.values())
    if not routed or not top_k:
        return total
    experts = sum(n for name, n in params.values() if ".experts." in name)
    return total - experts + experts * top_k // routed


def mfu(model: torch.nn.Module, executed_tokens: float, train_s: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation of the loss forward and backward: ``6 * active_params * executed_tokens`` over the
    seconds they took and the card's peak (None without a peak or a time)."""
    if not peak_tflops or train_s <= 0:
        return None
    return 6 * active_params(model) * executed_tokens / train_s / (peak_tflops * 1e12)
