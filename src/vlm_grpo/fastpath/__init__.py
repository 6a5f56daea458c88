"""The speed path: each GRPO group computed once, at TRL's numbers.

What it does (every piece behind a ``VLMGRPOConfig`` flag, parity-tested against TRL's own path):

* ``sharing``: ``share_prompt`` (one forward per group over ``[prompt | c1 | ... | cG]`` for the old,
  reference and policy log-probs, each block its rollout's own length) and ``share_prefill`` (prefill each unique
  prompt once, decode its G samples from the repeated cache); ``pack_plan``: where the packed pass puts each token
  (block lengths, groups per packed row, forwards per pass: ``packed_chunk_tokens``);
* ``decode``: ``fast_decode`` / ``compile_decode`` / ``keep_decode_graphs`` (static cache, CUDA-graph decode step
  per attention window, kept from one generation call to the next); ``decode_cache``: its static cache, one write
  position for all layers, and the restore around a capture; ``decode_compact``: finished rows leave the decode
  batch; ``decode_keep``: what a kept workspace is checked against; ``row_ends``: the rows that have ended (or decided
  their turn), told at the decode's host checks to a listener (tool calls started early);
* ``decode_select``: the token's choice (processors, draw, EOS bookkeeping) inside the decode step's graph,
  compiled with a compiled step (the draw spelled out as ``torch.multinomial`` computes it);
* ``process_once``: ``process_prompts_once`` (TRL's processor calls run on a batch's distinct prompts only);
* ``route``: which generations may take the shared prefill; the rest (beam search, stop strings, a wrapped
  ``generate``, ...) go through TRL's own path, whole;
* ``decode_attention``: the decode step's attention over grouped K/V heads, without per-head copies: on GPUs with
  Triton ``decode_kernel`` (flash-decoding, a ``torch.library.triton_op``), elsewhere two matmuls;
* ``decode_mlp``: the decode step's MLP as two Triton kernels on the live weights (gate, up and SiLU; down),
  swapped in by ``decode_fusion`` for a generation call;
* ``block_attention``: the packed pass's attention kernel (``packed_attention=blocks``): one varlen flash call on
  GPUs, per-row sdpa calls elsewhere;
* ``compiled_layers``: ``compile_layers``; ``fallback``: compiled-with-eager-fallback;
* ``vision_attention``: ``batch_vision_attention`` (one varlen flash call per layer on GPUs, per-length sdpa calls
  elsewhere); ``vision_sync``: vision passes kept in step across ranks;
* ``varlen``: the variable-length attention kernel both packed paths call (flash's on GPUs);
* ``fused_update``: ``update_chunk_tokens`` (an optimizer step's micro-batches in a few forwards + backwards, each
  micro-batch's loss TRL's own).

It leans on names that TRL, transformers and torch do not promise to keep. ``contract.PRIVATE_NAMES`` lists
each one with the signature we rely on, and ``tests/test_fastpath_contract.py`` checks them against the
installed versions, so an upgrade that drops one fails there, naming it:

* TRL ``GRPOTrainer``: ``_get_per_token_logps_and_entropies``, ``_generate_single_turn``, ``_tokenize_prompts``
  (overridden by ``VLMGRPOTrainer``), ``_compute_loss``, the ``_tokenizer``, ``_buffered_inputs`` and ``_step``
  attributes; ``trl.models.utils.unwrap_model_for_generation``.
* transformers ``Trainer._load_from_checkpoint``; ``GenerationMixin._prepare_generation_config``,
  ``_prepare_special_tokens`` (which sets ``GenerationConfig._pad_token_tensor`` / ``_eos_token_tensor``),
  ``_get_logits_processor``; Qwen-VL's ``_prepare_position_ids_for_generation``;
  ``PretrainedConfig._attn_implementation``; ``GradientCheckpointingLayer._gradient_checkpointing_func``;
  ``integrations.sdpa_attention.sdpa_attention_forward``; ``masking_utils.sdpa_mask``;
  ``cache_utils.StaticLayer.cumulative_length`` (the static cache's write position), its ``lazy_initialization``
  and ``update`` (extended by ``decode_cache``); ``activations.SiLUActivation``.
* torch ``torch._dynamo.exc.TorchDynamoException``, ``torch._dynamo.maybe_mark_dynamic``, ``torch._assert_async``,
  ``torch.ops.aten._flash_attention_forward`` (the varlen flash call of the packed pass and the vision tower).
"""
