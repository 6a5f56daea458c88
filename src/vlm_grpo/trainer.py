"""``VLMGRPOTrainer``: TRL's GRPOTrainer plus the model-family adapter layer.

TRL already trains VLMs; what it lacks is knowing *which* family it trains. The adapter loads
model and processor with the family's image limits, keeps LoRA off the vision tower, freezes
the tower on request, and lets rewards be given by registered name. On top of TRL's loop the
trainer computes each GRPO group once (``share_prompt``, ``share_prefill``; see
:mod:`vlm_grpo.fastpath.sharing`), reloads resumed checkpoints correctly, survives batches that mix
text-only and image prompts, and offers RLOO / REINFORCE++ / ReMax advantages (:mod:`vlm_grpo.advantages`).
Losses, logging, DeepSpeed and the rest are TRL's, unmodified.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from trl import GRPOTrainer

from vlm_grpo.advantages import AdvantageEstimatorMixin
from vlm_grpo.configs import VLMGRPOConfig
from vlm_grpo.data.deferred import DeferredImagesMixin
from vlm_grpo.dynamic_sampling import DynamicSamplingMixin
from vlm_grpo.fastpath.block_attention import use_block_attention
from vlm_grpo.fastpath.compile_cache import use_compile_cache
from vlm_grpo.fastpath.compiled_layers import resolve_compile_layers
from vlm_grpo.fastpath.decode_keep import resolve_keep_decode_graphs
from vlm_grpo.fastpath.fused_update import FusedUpdate
from vlm_grpo.fastpath.process_once import ProcessOnce
from vlm_grpo.fastpath.route import trl_generation_reason
from vlm_grpo.fastpath.sharing import packed_logps, packed_pass_reason, shared_prefill_generate
from vlm_grpo.fastpath.startup import StartupLog
from vlm_grpo.fastpath.trim import trim_completion_padding
from vlm_grpo.fastpath.turn_cache import TurnCache, continue_turns, image_pad_id, join_held_round, paired_turn
from vlm_grpo.fastpath.vision_attention import use_batched_vision_attention
from vlm_grpo.fastpath.vision_reuse import VisionReuseMixin, replay_rows
from vlm_grpo.fastpath.vision_sync import install_vision_sync, needs_vision_sync
from vlm_grpo.modules import VLMModule
from vlm_grpo.rewards import build_reward_funcs
from vlm_grpo.rollout_log import RolloutLogMixin
from vlm_grpo.tools.early_calls import EarlyCalls, turn_rooms
from vlm_grpo.tools.rollout_text import rollout_messages, rollout_tool_stats
from vlm_grpo.tools.rollouts import (
    MALFORMED_CALL,
    ToolBatch,
    ToolTurns,
    build_tool_environment,
    parse_with_protocol,
    prepare_for_tools,
    tile_fields,
    tool_turns,
)
from vlm_grpo.tools.round_cache import RoundCaches
from vlm_grpo.tools.rounds import RoundSync, round_sync_for
from vlm_grpo.trainer_common import (
    CheckpointReloadMixin,
    CompleteCheckpointMixin,
    as_vlm_config,
    drop_stacked_input_grad_hooks,
    prepare_vlm,
)
from vlm_grpo.utils import is_zero3, peft_base, per_chunk_kwargs

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def rows_forward_kwargs(
    model: torch.nn.Module, module: VLMModule, mm: dict[str, Any], tool_images: bool = False
) -> Iterator[None]:
    """Hand each of TRL's per-row forwards the family's ``rows_forward_kwargs`` for the rows it covers.

    TRL's pass calls ``model`` on consecutive chunks of rows, in order, with the inputs it knows how to cut: a
    pre-forward hook counts the rows and adds (or replaces) what the family needs besides, e.g. LLaVA-OneVision's
    ``batch_num_images`` (several images in a sample are not tiled), which TRL never passes.
    """
    if not module.rows_forward_kwargs(mm, 0, 0, tool_images):
        yield
        return

    def update(start: int, end: int, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {**kwargs, **module.rows_forward_kwargs(mm, start, end, tool_images)}

    with per_chunk_kwargs(model, update):
        yield


_TRL_LOGP_PARAMS = frozenset(inspect.signature(GRPOTrainer._get_per_token_logps_and_entropies).parameters)


class VLMGRPOTrainer(
    CompleteCheckpointMixin,  # first: its marker goes in after every other mixin's checkpoint files
    DeferredImagesMixin,  # before dynamic sampling: its rounds get decoded rows
    DynamicSamplingMixin,
    RolloutLogMixin,
    AdvantageEstimatorMixin,
    CheckpointReloadMixin,
    VisionReuseMixin,  # after the mixins that regroup generation outputs: each round's rows keep their features
    GRPOTrainer,
):
    """GRPO for vision-language models.

    Args beyond ``trl.GRPOTrainer``:
        vlm_module: adapter instance or registered name; default: from the checkpoint's ``model_type``.
        freeze_vision_modules: freeze the vision tower and its projector before training.
        lora_include_vision: put LoRA on vision layers too (default: language model only).
        is_reward_customized_from_vlm_module: the adapter's own reward variants replace registered ones of the
            same name (VLM-R1's flag name, used by the CLI and the trainer alike).
        reward_funcs: callables as in TRL, or registered reward names / ``file.py:fn`` plugins.
        tools: registered tool names / ``file.py:fn`` plugins (they see the row's images, see
            :mod:`vlm_grpo.tools`), and/or plain callables passed to TRL as they are.
        tool_kwargs: options per named tool, ``{"python": {"timeout": 10}}`` (JSON text or a mapping).
        tool_protocol: how the model calls tools and reads replies (:mod:`vlm_grpo.tools.protocols`); None: the
            one the tools name, else ``hermes``.
        max_turn_tokens, max_tool_images, max_context_tokens: tool-rollout budgets (None: none); see
            ``GRPOScriptArguments``.
        args: a ``VLMGRPOConfig``; a plain ``trl.GRPOConfig`` keeps its values and gets ``VLMGRPOConfig``'s
            defaults for the speed options (``share_prompt``, ``fast_decode``, ...); None: all defaults.
    """

    def __init__(
        self,
        model: str | torch.nn.Module,
        reward_funcs: str | Callable | Sequence[str | Callable],
        args: Any = None,
        *,
        vlm_module: VLMModule | str | None = None,
        freeze_vision_modules: bool = False,
        lora_include_vision: bool = False,
        is_reward_customized_from_vlm_module: bool = False,
        processing_class: Any = None,
        peft_config: Any = None,
        tools: Sequence[str | Callable] | None = None,
        tool_kwargs: str | Mapping[str, Any] | None = None,
        tool_protocol: str | None = None,
        max_turn_tokens: int | None = None,
        max_tool_images: int | None = None,
        max_context_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        if any(getattr(t, "__name__", None) == MALFORMED_CALL for t in tools or []):  # before any model loads
            raise ValueError(f"A tool cannot be named {MALFORMED_CALL!r}: that name answers malformed tool calls")
        args = as_vlm_config(args, VLMGRPOConfig, model, "GRPO")
        vlm_module, model, processing_class = prepare_vlm(
            model,
            args,
            vlm_module,
            processing_class,
            peft_config,
            freeze_vision_modules=freeze_vision_modules,
            lora_include_vision=lora_include_vision,
        )
        self.vlm_module = vlm_module

        if isinstance(reward_funcs, (str, Callable)):
            reward_funcs = [reward_funcs]
        overrides = vlm_module.reward_overrides if is_reward_customized_from_vlm_module else None
        reward_funcs = [
            build_reward_funcs([f], overrides, processing_class=processing_class)[0] if isinstance(f, str) else f
            for f in reward_funcs
        ]

        tools = list(tools or [])
        named = [t for t in tools if isinstance(t, str)]
        if named or tool_kwargs:
            # Registered tools get the row's images and per-rollout state: one environment per rollout.
            if kwargs.get("environment_factory") is not None:
                raise ValueError("Pass tools by name (--tools) or an environment_factory, not both")
            module = vlm_module

            def coord_size(width: int, height: int) -> tuple[int, int]:
                return module.coord_size(processing_class, width, height)

            kwargs["environment_factory"] = build_tool_environment(named, tool_kwargs, coord_size)
            tools = [t for t in tools if not isinstance(t, str)]
        factory = kwargs.get("environment_factory")
        self._tool_turns: ToolTurns | None = None
        if tools or factory is not None:
            prepare_for_tools(args, processing_class)
            self._tool_turns = tool_turns(
                tools, factory, processing_class, tool_protocol, max_context_tokens, max_tool_images
            )
        elif args.max_tool_calling_iterations is not None:
            logger.warning("max_tool_calling_iterations has no effect without tools (--tools)")
        self.max_turn_tokens = max_turn_tokens

        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            processing_class=processing_class,
            peft_config=peft_config,
            tools=tools or None,
            **kwargs,
        )
        if self._tool_turns is not None:
            self._order_tools(getattr(factory, "_tool_order", ()))
            if not self._tool_turns.protocol.show_tools and getattr(self, "_env_tools", None):
                # The protocol's own prompt describes the tools (PyVision's, DeepEyes'): the template shows none.
                self._env_tools = {name: [] for name in self._env_tools}
        self._warn_if_groups_split()
        self._check_dynamic_sampling()
        self._check_advantage_estimator()
        sharded = self.is_fsdp_enabled or is_zero3(self.accelerator)
        # compile_layers as this run resolves it (None: on GPU without ZeRO-3 / FSDP); the args stay as given.
        self.compile_layers = resolve_compile_layers(self.args.compile_layers, self.accelerator.device.type, sharded)
        self.keep_decode_graphs = resolve_keep_decode_graphs(self.args.keep_decode_graphs, sharded)
        self.compile_cache = use_compile_cache(self.args.compile_cache_dir, self.accelerator.device)
        if self.accelerator.is_main_process:  # where the first step's compilation and graph captures went
            self.add_callback(StartupLog(logger))
        if not self.args.cudnn_attention and torch.backends.cuda.cudnn_sdp_enabled():
            logger.info("cudnn_attention=False: sdpa's cuDNN backend is off for this process (see its help)")
            torch.backends.cuda.enable_cudnn_sdp(False)
        batched = self.args.batch_vision_attention
        for target in (self.model, self.ref_model):  # the reference model is built inside TRL's __init__
            if target is not None:
                use_batched_vision_attention(target, batched, vlm_module)
                if self.args.share_prompt:
                    # Here rather than at the first packed pass: generation then sees the final attention
                    # name from the start, and a compiled decode step is not recompiled when it changes.
                    use_block_attention(target, self.args.packed_attention)
        if self.accelerator.num_processes > 1 and self.log_multimodal:
            # TRL gathers the batch's images for the completions table only on ranks whose batch has
            # images: with a text-only batch on one rank and images on another the run deadlocks.
            logger.warning("log_multimodal is turned off in multi-process runs (TRL deadlocks on mixed batches)")
            self.log_multimodal = False
        self.fused_update = FusedUpdate(self)
        self._vision_syncs = []
        if needs_vision_sync(self.accelerator, self.model, vlm_module):
            # Sharded runs: a rank without images must still run the vision tower where the others do.
            for target in (self.model, self.ref_model):
                sync = install_vision_sync(vlm_module, target) if target is not None else None
                if sync is not None:
                    self._vision_syncs.append(sync)

    # The rollouts' held KV caches while a tool generation runs (None outside one, or without fast_decode).
    _turn_cache: TurnCache | None = None
    # Reply tokens and preprocessed images of one tool generation, reused across its rollouts and rounds.
    _round_caches: RoundCaches | None = None
    # Inside TRL's tool loop (the turns after the first), and the ranks' round votes there (ZeRO-3 / FSDP).
    _in_tool_loop = False
    _round_sync: RoundSync | None = None
    #: What the last tool generation's turns after the first did (:class:`~vlm_grpo.fastpath.turn_cache.TurnStats`).
    last_turn_stats = None
    #: What the last tool generation's loop asked of the host and ran (:class:`~vlm_grpo.tools.round_cache.RoundWork`).
    last_round_work = None
    #: The fused update pass (``update_chunk_tokens``); None before ``__init__`` ends.
    fused_update: FusedUpdate | None = None
    #: What the last packed log-prob pass ran (:class:`~vlm_grpo.fastpath.sharing.PackedPass`: tokens, padding).
    last_packed_pass = None

    def _get_train_sampler(self, dataset: Any = None) -> Any:
        """TRL's sampler, reseeded per epoch so that a run resumed in a later epoch sees the same order."""
        return EpochSeededSampler(super()._get_train_sampler(dataset))

    def _warn_if_groups_split(self) -> None:
        """Sharing needs a group's rows in the same micro-batch; say so when the batch shape splits groups.

        TRL deals out G copies of each prompt consecutively, then shuffles each rank's generation batch
        and cuts it into ``steps_per_generation`` micro-batches. With one micro-batch per generation and a
        per-device batch that holds whole groups, every micro-batch is made of whole groups.
        """
        args = self.args
        if not (args.share_prompt or args.share_prefill):
            return
        if args.per_device_train_batch_size % self.num_generations or args.steps_per_generation > 1:
            logger.warning(
                "per_device_train_batch_size=%d, num_generations=%d, steps_per_generation=%d: GRPO groups are "
                "split across ranks or micro-batches, so share_prompt/share_prefill share only the part of a "
                "group each micro-batch holds. Use a per-device batch that is a multiple of num_generations "
                "and gradient_accumulation_steps=1 for the full effect.",
                args.per_device_train_batch_size,
                self.num_generations,
                args.steps_per_generation,
            )

    # Multimodal kwargs the packed path understands; anything else goes to TRL's per-row pass.
    _SHARED_MM_KEYS = frozenset({"pixel_values", "image_grid_thw", "num_images", "num_tiles", "mm_token_type_ids"})

    def _get_per_token_logps_and_entropies(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **mm: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Rows that share a prompt share one forward (``share_prompt``); see :mod:`vlm_grpo.fastpath.sharing`."""
        if not self.tools:
            mm = {**mm, **self.vlm_module.trl_pixel_fields(mm)}
        extra = (
            {k for k, v in mm.items() if v is not None} - self._SHARED_MM_KEYS - self.vlm_module.grouped_vision_inputs
        )
        if "token_type_ids" not in self._forward_parameters():
            extra.discard("token_type_ids")  # TRL's tool-image pass adds it for families whose forward ignores it
        with self._vision_reuse(model, mm, input_ids.size(0)) as replay:  # features kept from generation
            if self.args.share_prompt:  # every rank asks: ranks decide together
                usable = packed_pass_reason(self.accelerator.unwrap_model(model), extra, compute_aux_loss) is None
                result = packed_logps(
                    self, model, input_ids, attention_mask, logits_to_keep, compute_entropy, mm, batch_size, usable,
                    replay,
                )  # fmt: skip
                if result is not None:
                    return (*result, None)
            args = (model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss)
            tool_images = bool(self.tools)
            if tool_images:
                # Tool images reach TRL's old/reference passes as everything the image processor returned;
                # InternVL's carries ``num_patches``, which TRL's pass does not take (its tile counts come as
                # ``num_tiles``). That is one entry per image, which TRL's own cuts expect: no family inputs added.
                mm = {k: v for k, v in mm.items() if k in _TRL_LOGP_PARAMS}
                mm |= self.vlm_module.tool_pixel_fields(self.processing_class, mm, input_ids)
            with rows_forward_kwargs(model, self.vlm_module, mm, tool_images), replay_rows(model, replay):
                return super()._get_per_token_logps_and_entropies(*args, **mm)

    def _prepare_inputs(self, generation_batch: Any) -> dict[str, Any]:
        """TRL's micro-batch, its completions cut to its own longest one (``trim_completion_padding``)."""
        return self._micro_batch(super()._prepare_inputs(generation_batch))

    def _micro_batch(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """A slice of TRL's buffer as the Trainer gets it (the fused update reads the buffer directly)."""
        return trim_completion_padding(inputs) if self.args.trim_completion_padding else inputs

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's; with ``update_chunk_tokens``, a window's micro-batches share forwards and backwards
        (:mod:`vlm_grpo.fastpath.fused_update`), each micro-batch's loss still TRL's."""
        if not return_outputs and self.fused_update is not None:

            def loss_fn(mb: dict[str, Any]) -> torch.Tensor:
                return super(VLMGRPOTrainer, self).compute_loss(model, mb, num_items_in_batch=num_items_in_batch)

            loss = self.fused_update.loss(self, model, inputs, self._micro_batch, loss_fn)
            if loss is not None:
                return loss
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's, with the processor run once per distinct prompt (``process_prompts_once``), and without the
        input-embedding hooks its gradient-checkpointing toggles leave behind (:func:`drop_stacked_input_grad_hooks`).

        TRL calls ``self.processing_class`` inside this method (for generation, then for the log-prob passes'
        pixels) without a hook around either call: the stand-in takes its place for the method's duration only.
        """
        processor = self.processing_class
        if self.args.process_prompts_once:
            self.processing_class = ProcessOnce(processor, self.accelerator.device)
        caches = None
        if self.tools and self.args.share_prefill and self.args.fast_decode:  # see vlm_grpo.tools.round_cache
            caches = self._round_caches = RoundCaches(super()._get_tool_suffix_ids)
        try:
            with caches.images(processor, self.accelerator.device) if caches is not None else contextlib.nullcontext():
                output = super()._generate_and_score_completions(inputs)
                # Before TRL splits and shuffles the batch by its pixels
                if self.tools:
                    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
                    output.update(self.vlm_module.tool_pixel_fields(processor, output, ids))
                else:
                    output.update(self.vlm_module.trl_pixel_fields(output))
            return output
        finally:
            self.processing_class = processor
            self.last_round_work = caches.work if caches is not None else None
            self._round_caches = None
            drop_stacked_input_grad_hooks(self.model)

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ) -> tuple[list[list[int]], Any]:
        """One turn of every row (:meth:`_generate_turn`) within the tool budgets: ``max_turn_tokens`` new tokens
        a turn, and a row's whole context (prompt, turns, tool replies) within ``max_context_tokens``; each turn
        ends at the tool protocol's stop string (:meth:`~vlm_grpo.tools.rollouts.ToolTurns.cut`)."""
        early = self._turn_cache.early if self._turn_cache is not None else None
        with early.generation(prompt_ids) if early is not None else contextlib.nullcontext():
            ids, logprobs = self._generate_within_budgets(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        if self._tool_turns is None or not self._tool_turns.protocol.stop:
            return ids, logprobs
        ids = [self._tool_turns.cut(row) for row in ids]
        if logprobs is not None:
            logprobs = [row[: len(kept)] for row, kept in zip(logprobs, ids, strict=True)]
        return ids, logprobs

    def _generate_within_budgets(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ) -> tuple[list[list[int]], Any]:
        rooms = turn_rooms(self, prompt_ids)
        if rooms is None:
            return self._generate_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        config = getattr(self, "generation_config", None)
        before = getattr(config, "max_new_tokens", None)
        if config is not None and before is not None:
            config.max_new_tokens = max(1, min(before, max(rooms)))
        try:
            ids, logprobs = self._generate_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        finally:
            if config is not None and before is not None:
                config.max_new_tokens = before
        ids = [row[:room] for row, room in zip(ids, rooms, strict=True)]
        if logprobs is not None:
            logprobs = [row[: len(kept)] for row, kept in zip(logprobs, ids, strict=True)]
        return ids, logprobs

    def _generate_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ) -> tuple[list[list[int]], Any]:
        """Prefill each unique prompt once and decode its G samples from the shared cache (``share_prefill``).

        The turns of TRL's tool loop after a tool result (``num_generations == 1``: each row its own history)
        continue each rollout's held KV cache, prefilling only the tokens new to it, and decode with ``fast_decode``
        (:mod:`vlm_grpo.fastpath.turn_cache`). Generations the shared path cannot honour (beam search, stop strings,
        a wrapped ``generate``, ...) go through TRL's path whole; see :mod:`vlm_grpo.fastpath.route`.
        """
        multimodal_fields = {k: v for k, v in multimodal_fields.items() if k != "num_tiles"}  # see tile_fields
        if has_tool_images:
            # TRL's tool-image path passes everything the image processor returned, and adds token type ids for
            # models whose forward does not take them (InternVL): keep what the model accepts.
            accepted = self._forward_parameters()
            multimodal_fields = {k: v for k, v in multimodal_fields.items() if k in accepted}
            has_tool_images = bool({"mm_token_type_ids", "token_type_ids"} & accepted)
        own_history = bool(self.tools) and num_generations == 1
        shared_fields = multimodal_fields
        if has_tool_images and "mm_token_type_ids" in self._forward_parameters():
            shared_fields = {**multimodal_fields, "mm_token_type_ids": self._mm_token_types(prompt_ids)}
        token_type_ids = has_tool_images and "mm_token_type_ids" not in shared_fields
        sync = self._round_sync if self._in_tool_loop else None  # a tool round the ranks vote on (tools.rounds)
        share = trl_generation_reason(self, own_history, token_type_ids, paired=sync is not None) is None
        if sync is not None:  # the held path on every rank, or TRL's on every rank
            turn = paired_turn(self, self._turn_cache, sync.vote, share, prompt_ids, images, multimodal_fields)
            if turn is not None:
                return turn, None
        elif share:
            if own_history and self._turn_cache is not None:
                completion_ids = continue_turns(self, self._turn_cache, prompt_ids, images, multimodal_fields)
                if completion_ids is not None:
                    return completion_ids, None
            completion_ids = shared_prefill_generate(self, prompt_ids, images, shared_fields, own_history)
            if completion_ids is not None:
                return completion_ids, None
        return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)

    def _mm_token_types(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        """Per token 1 for an image pad, 2 for a video pad, else 0: what TRL builds for tool-image turns."""
        kinds = {self._image_pad_token_id: 1, self._video_pad_token_id: 2}
        kinds.pop(None, None)
        return [[kinds.get(t, 0) for t in row] for row in prompt_ids]

    def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
        """TRL's tool loop with the run's tool protocol (:class:`~vlm_grpo.tools.rollouts.ToolTurns`), plus
        per-rollout metrics: tool calls, errors, turns, images, sandbox timeouts, calls after the answer.

        Every turn is read by the protocol: the first one here, later ones as TRL's loop parses them
        (:class:`~vlm_grpo.tools.rollouts.ProtocolParser`). A malformed action or an unknown tool becomes a call
        of the hidden tool that answers with an error message, so the model sees what was wrong and goes on; a turn
        with the final answer runs nothing. Every rollout's tools reply in the protocol's words.
        """
        turns = self._tool_turns
        turns.reset_counts()
        turns.names = {name for tools in self._sync_tool_dicts for name in tools} | {MALFORMED_CALL}
        environments = self.environments or []
        for i, rollout in enumerate(completions):
            env = environments[i] if i < len(environments) else None
            prompt_images = len(images[i] or []) if images is not None else 0
            tools = turns.tools_for(self._sync_tool_dicts[i], env, prompt_images)
            rollout[-1] = turns.read(rollout[-1], completion_ids[i], len(prompt_ids[i]), tools)
        multimodal_fields = tile_fields(
            getattr(self.processing_class, "image_processor", None), images, multimodal_fields
        )
        # The rollouts' sandbox cells run together, per round; later turns are read as TRL's loop parses them.
        self._in_tool_loop = True
        self._round_sync = round_sync_for(self)
        if self._turn_cache is not None and self._turn_cache.early is not None:
            self._turn_cache.early.enter_loop(prompt_ids, completion_ids, completions)
        try:
            with ToolBatch(self.environments, completions, turns), parse_with_protocol(self, turns):
                result = super()._tool_call_loop(
                    prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields
                )
            if self._round_sync is not None:  # ranks with rounds left generate collectively: join them
                self._round_sync.drain(self._join_round)
        finally:
            self._in_tool_loop = False
        stats = rollout_tool_stats(result[1], self.environments)
        n = max(1, len(completions))
        stats["calls_after_answer"] = [turns.calls_after_answer / n]
        stats["context_stops"] = [turns.context_stops / n]
        stats["image_budget_refusals"] = [turns.image_refusals / n]
        self._log_tool_stats(stats)
        return result

    def _join_round(self, held: bool) -> None:
        """This rank's part in another rank's tool round (:mod:`vlm_grpo.tools.rounds`): the held path's collectives
        (:func:`~vlm_grpo.fastpath.turn_cache.join_held_round`), or TRL's generation of one token for a one-token
        prompt (the parameters gathered, ``synced_gpus`` steps until the other ranks are done), its output dropped."""
        if held:
            return join_held_round(self)
        config = self.generation_config
        saved = config.max_new_tokens, config.min_new_tokens
        config.max_new_tokens, config.min_new_tokens = 1, None
        try:
            super()._generate_single_turn([[self._tokenizer.pad_token_id]], None, {}, 1)
        finally:
            config.max_new_tokens, config.min_new_tokens = saved

    def _log_tool_stats(self, stats: dict[str, list[float]]) -> None:
        mode = "train" if self.model.training else "eval"
        for name, values in stats.items():
            local = torch.tensor(values, dtype=torch.float32, device=self.accelerator.device)
            gathered = self.accelerator.gather(local)
            self._metrics[mode][f"tools/{name}"].append(gathered.mean().item())

    def _generate(self, prompts: list):
        """TRL's; with tools, each completion handed on (rewards, ``--rollout_log``, the completions table) is the
        rollout as the model wrote and read it (:func:`~vlm_grpo.tools.rollout_text.rollout_messages`), rebuilt from
        its tokens: TRL's parsed messages move ``<think>`` and the calls out of the text."""
        if self.tools and self.args.share_prefill and self.args.fast_decode:
            # Each rollout's KV cache is held from one turn to the next (see vlm_grpo.fastpath.turn_cache).
            self._turn_cache = TurnCache(image_pad_id(self._tokenizer), self._tokenizer.pad_token_id)
            self._turn_cache.early = EarlyCalls(self, self._turn_cache.stats) if self.args.early_tool_calls else None
        try:
            out = super()._generate(prompts)
        finally:
            self.last_turn_stats = self._turn_cache.stats if self._turn_cache is not None else None
            self._turn_cache = None
        if self._tool_turns is None or out[2] is None:
            return out
        prompt_ids, completion_ids, tool_mask, completions, *rest = out
        tokenizer = self._tokenizer
        completions = [
            rollout_messages(tokenizer, ids, mask, turns)
            for ids, mask, turns in zip(completion_ids, tool_mask, completions, strict=True)
        ]
        return (prompt_ids, completion_ids, tool_mask, completions, *rest)

    def _get_tool_suffix_ids(self, tool_messages):
        """A protocol that words its own replies (PyVision, DeepEyes) has them rendered as one user turn; on the speed
        path, each reply shape is rendered once per generation (:class:`~vlm_grpo.tools.round_cache.SuffixIds`)."""
        if self._tool_turns is not None:
            tool_messages = self._tool_turns.reply_messages(tool_messages)
        if self._round_caches is not None:
            return self._round_caches.suffix(tool_messages)
        return super()._get_tool_suffix_ids(tool_messages)

    def _order_tools(self, order: Sequence[str]) -> None:
        """Show the tools in the order given (``--tools``), not TRL's alphabetical order of environment methods."""
        rank = {name: i for i, name in enumerate(order)}

        def ordered(tools: list) -> list:
            return sorted(tools, key=lambda t: rank.get(getattr(t, "__name__", ""), -1))  # stable: plain tools first

        self.tools = ordered(list(self.tools or []))
        for key, tools in (getattr(self, "_env_tools", None) or {}).items():
            self._env_tools[key] = ordered(list(tools))

    def _forward_parameters(self) -> set[str]:
        """Names the model's forward accepts (the base model's, under PEFT)."""
        if getattr(self, "_forward_params", None) is None:
            model = peft_base(self.accelerator.unwrap_model(self.model))
            self._forward_params = set(inspect.signature(type(model).forward).parameters)
        return self._forward_params

    def _tokenize_prompts(self, prompts: list) -> tuple:
        """Text-only prompts get ``[]`` rather than ``None`` images, so mixed batches reach the processor whole.

        TRL marks a text-only prompt's images as ``None``; when the same batch also holds image prompts,
        the processor receives ``[[img], None]`` and fails. An empty list is what processors expect.
        """
        prompt_ids, images, multimodal_fields = super()._tokenize_prompts(prompts)
        if images is not None:
            images = [image_list or [] for image_list in images]
        return prompt_ids, images, multimodal_fields


class EpochSeededSampler(torch.utils.data.Sampler):
    """TRL's ``RepeatSampler`` with its shuffle seeded by ``seed + epoch``.

    ``RepeatSampler`` seeds its generator once and draws each epoch's order from the running stream, so a
    run resumed after the first epoch (a fresh sampler, whatever epoch it starts in) shuffled differently
    from the run it continues. The Trainer calls ``set_epoch`` (through accelerate's data loader) before
    every epoch, resumed or not; epoch 0 keeps RepeatSampler's own order.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def set_epoch(self, epoch: int) -> None:
        if getattr(self.inner, "shuffle", False) and getattr(self.inner, "seed", None) is not None:
            self.inner.generator.manual_seed(self.inner.seed + epoch)

    def __iter__(self):
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)
