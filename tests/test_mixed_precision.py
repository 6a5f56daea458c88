"""``--bf16`` without DeepSpeed: fp32 weights (TRL's default load) under accelerate's bf16 autocast.

The single-GPU and LoRA setup. Under that autocast the rotary embedding hands attention fp32 q / k and a bf16 v,
generate runs through the prepared model's autocast-wrapped forward, and the decode step, which calls the decoder
directly, must enter the same autocast.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

import test_group_sharing
from test_group_sharing import G, _tokenized_batch, assert_parity, make_trainer, real_batch
from vlm_grpo.utils import peft_base

rows_file = test_group_sharing.rows_file  # the fixture: two rows, one and two images


@pytest.mark.parametrize("lora", [False, True])
def test_bf16_autocast_without_deepspeed_trains_through_the_block_kernel(lora, tiny_models, rows_file, tmp_path,
                                                                         monkeypatch):  # fmt: skip
    """``--bf16 true`` without DeepSpeed (one GPU, LoRA) and the CLI's default fp32 weights: under accelerate's
    bf16 autocast the rotary embedding hands the attention fp32 q/k and a bf16 v. A plain sdpa call is cast by
    autocast; the block kernel's lower-right causal bias checks the dtypes before autocast would, so the shared
    pass failed on its first step."""
    import vlm_grpo.fastpath.block_attention as block_attention

    real, dtypes = block_attention._packed_sdpa, []

    def spy(query, key, value, *args):
        dtypes.append((query.dtype, key.dtype, value.dtype))
        return real(query, key, value, *args)

    monkeypatch.setattr(block_attention, "_packed_sdpa", spy)
    trainer = make_trainer(
        tiny_models["qwen2_5_vl"], rows_file, tmp_path, lora=lora, bf16=True, use_cpu=True,
        max_steps=1, learning_rate=1e-2, gradient_checkpointing=True,
    )  # fmt: skip
    with torch.autocast("cpu", dtype=torch.bfloat16):  # TRL's per-row pass, cast by autocast, is the reference
        assert_parity(trainer, real_batch(trainer), tol=3e-2)  # bf16: measured 5e-4 (log-probs), 1e-2 (gradients)
    trained = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert (torch.float32, torch.float32, torch.bfloat16) in dtypes, f"no mixed dtypes reached the kernel: {dtypes}"
    after = dict(trainer.model.named_parameters())
    assert any(not torch.equal(after[n], p) for n, p in trained.items()), "no trainable parameter changed"


@pytest.mark.parametrize("compile_decode", [False, True], ids=["eager_step", "compiled_step"])
def test_fast_decode_runs_under_the_autocast_of_the_prepared_model(compile_decode, tiny_models, rows_file, tmp_path,
                                                                    monkeypatch):  # fmt: skip
    """``--bf16`` without DeepSpeed, fp32 weights: accelerate wraps the model's forward in a bf16 autocast and TRL's
    generate runs through it. The decode step calls the decoder past that wrapper, so it enters the same autocast:
    bf16 GEMMs over weights cast once per call (o, down and the LM head too), a cache of fp32 keys and bf16 values,
    and the sampled tokens of generate after the same shared prefill. The control decodes without entering the autocast:
    its fp32 values do not fit the prefill's cache.

    generate runs the decode's attention function here: under autocast, CPU's sdpa rounds the scores to bf16,
    while the GPU kernels and that function keep them in fp32
    (``test_decode_attention_under_autocast_keeps_fp32_scores_as_sdpa_does``), and in bf16 that alone changes
    sampled tokens. Eager attention is left out: its sums over the static cache's masked slots round differently."""
    import torch.nn.functional as F

    import vlm_grpo.fastpath.decode as decode
    from vlm_grpo.fastpath import decode_fusion
    from vlm_grpo.fastpath.decode_attention import decode_attention

    trainer = make_trainer(
        tiny_models["qwen2_5_vl"], rows_file, tmp_path, bf16=True, use_cpu=True, compile_decode=compile_decode
    )
    trainer.model = trainer.model_wrapped = trainer.accelerator.prepare_model(trainer.model)  # as train() does
    config = trainer.generation_config
    config.temperature, config.top_k, config.top_p, config.repetition_penalty = 0.7, 50, 0.9, 1.2
    config.min_new_tokens = config.max_new_tokens
    batch = _tokenized_batch(trainer)
    dtypes = []
    down = trainer.model.get_decoder().layers[-1].mlp.down_proj  # not fused: it runs as itself in the decode

    def generate(fast: bool) -> list[list[int]]:
        trainer.args.fast_decode = fast
        dtypes.clear()
        torch.manual_seed(5)
        # generate's steps in the decode's attention function (fast decode itself is off under that name)
        with contextlib.nullcontext() if fast else decode_attention(peft_base(trainer.model).get_decoder().config):
            return trainer._generate_single_turn(*batch, G)[0]

    used, fused = [], []
    real = decode.fast_decode
    monkeypatch.setattr(decode, "fast_decode", lambda *a, **k: used.append(k["autocast"]) or real(*a, **k))

    def linear(x, weight, bias=None):  # the fused GEMMs: weights pre-cast to bf16, o, down and the head included
        fused.append((weight.dtype, weight.size(0)))
        return F.linear(x, weight, bias)

    monkeypatch.setattr(decode_fusion, "F", SimpleNamespace(linear=linear))
    handle = down.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    try:
        reference = generate(fast=False)  # the shared prefill, then generate
        assert not used and set(dtypes) == {torch.bfloat16}
        assert generate(fast=True) == reference
        assert used == [("cpu", torch.bfloat16)] and set(dtypes) == {torch.bfloat16}
        layer = trainer.model.get_decoder().layers[-1]
        head = peft_base(trainer.model).get_output_embeddings()
        sizes = {m.weight.size(0) for m in (layer.self_attn.o_proj, layer.mlp.down_proj, head)}
        assert head.weight.size(0) not in {layer.self_attn.o_proj.weight.size(0), layer.mlp.down_proj.weight.size(0)}
        assert {d for d, _ in fused} == {torch.bfloat16} and sizes <= {n for _, n in fused}
        assert len({tuple(c) for c in reference}) > 2  # really sampled: the G copies of a prompt differ
        monkeypatch.setattr(decode, "_autocast", lambda state: contextlib.nullcontext())
        with pytest.raises(RuntimeError, match="same dtype"):  # fp32 values against the prefill's bf16 ones
            generate(fast=True)
    finally:
        handle.remove()
