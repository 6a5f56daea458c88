"""Parity of the shared-prompt pass with TRL's per-row pass: log-probs and gradients, every family.

Batches come from TRL itself (``_generate_and_score_completions`` on a real dataset), then get
ragged completions; prompts differ in length (left padding) and in image count.
"""

from __future__ import annotations

import itertools
import json
import logging
import math

import pytest
import torch
from PIL import Image
from trl import GRPOTrainer

from vlm_grpo.configs import VLMGRPOConfig
from vlm_grpo.data import prepare_rows, read_rows, to_datasets
from vlm_grpo.data.deferred import decode_pending
from vlm_grpo.modules import ImageLimits, get_vlm_module
from vlm_grpo.testing.tiny import FAMILIES
from vlm_grpo.trainer import VLMGRPOTrainer, rows_forward_kwargs

G = 3
# What TRL hands its log-prob pass (None where a family has no such input).
MM_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "num_tiles",
    "mm_token_type_ids",
    "token_type_ids",
    "image_sizes",
    "pixel_attention_mask",
)


def _reward(completions, **kwargs):
    return [float(len(str(c)) % 3) for c in completions]


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("share")
    Image.new("RGB", (64, 48), (200, 30, 30)).save(root / "a.png")
    Image.new("RGB", (56, 90), (30, 30, 200)).save(root / "b.png")
    rows = [
        {"image": "a.png", "conversations": [{"from": "human", "value": "<image>Red?"}, {"from": "gpt", "value": "1"}]},
        {
            "image": ["a.png", "b.png"],
            "conversations": [
                {"from": "human", "value": "Compare <image> with <image> and tell which one is larger, please."},
                {"from": "gpt", "value": "2"},
            ],
        },
    ]
    path = root / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_trainer(
    model_dir, rows_file, tmp_path, attn="sdpa", lora=False, max_anyres_num=None, reward_funcs=(_reward,),
    trainer_kwargs=None, dtype=torch.float32, **overrides,
):  # fmt: skip
    module = get_vlm_module(str(model_dir), limits=ImageLimits(max_anyres_num=max_anyres_num))
    processor = module.load_processor(str(model_dir))
    model = module.load_model(str(model_dir), dtype=dtype, attn_implementation=attn)
    rows, bad = read_rows([str(rows_file)], task_type="raw")
    dataset, _ = to_datasets(prepare_rows(rows, bad, module, processor), module)
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False)  # non-zero B: LoRA changes outputs
    args = VLMGRPOConfig(
        output_dir=str(tmp_path / "out"),
        **{
            "per_device_train_batch_size": 2 * G,
            "num_generations": G,
            "max_completion_length": 6,
            "report_to": "none",
            "seed": 3,
            "gradient_checkpointing": False,
            **overrides,
        },
    )
    return VLMGRPOTrainer(
        model=model,
        reward_funcs=list(reward_funcs),
        args=args,
        vlm_module=module,
        processing_class=processor,
        train_dataset=dataset,
        peft_config=peft_config,
        **(trainer_kwargs or {}),
    )


def real_batch(trainer):
    trainer.model.eval()
    batch = next(iter(trainer.get_train_dataloader()))
    inputs = trainer._generate_and_score_completions(batch)
    # Ragged completions: cut two rows short (right padding, as TRL pads them).
    pad = trainer._tokenizer.pad_token_id
    for row, keep in ((1, 2), (4, 4)):
        inputs["completion_mask"][row, keep:] = 0
        inputs["completion_ids"][row, keep:] = pad
    assert inputs["prompt_mask"].sum(1).unique().numel() > 1, "prompts should differ in length"
    return inputs


def logps_and_grads(trainer, inputs, method, weights):
    trainer.model.zero_grad(set_to_none=True)
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    C = inputs["completion_ids"].size(1)
    logps, entropy, _ = method(
        trainer, trainer.model, input_ids, mask, C, compute_entropy=True, **{k: inputs.get(k) for k in MM_KEYS}
    )
    valid = inputs["completion_mask"].bool()
    ((logps * weights * valid).sum() + 0.1 * (entropy * valid).sum()).backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return logps.detach() * valid, grads


def assert_parity(trainer, inputs, tol=1e-5):
    torch.manual_seed(0)
    weights = torch.randn(inputs["completion_ids"].shape)
    # TRL's pass with the inputs it leaves out that a family needs (LLaVA-OneVision's batch_num_images), as training
    # runs it when rows share nothing.
    with rows_forward_kwargs(trainer.model, trainer.vlm_module, {k: inputs.get(k) for k in MM_KEYS}):
        ref, ref_grads = logps_and_grads(trainer, inputs, GRPOTrainer._get_per_token_logps_and_entropies, weights)
    ours, our_grads = logps_and_grads(trainer, inputs, VLMGRPOTrainer._get_per_token_logps_and_entropies, weights)
    torch.testing.assert_close(ours, ref, rtol=0, atol=tol)
    assert ref_grads.keys() == our_grads.keys()
    for name, g in ref_grads.items():
        if g.norm() < 1e-6 and our_grads[name].norm() < 1e-6:
            continue  # zero up to rounding (a key bias without rotary positions: softmax ignores the shift)
        rel = (our_grads[name] - g).norm() / g.norm().clamp_min(1e-12)
        assert rel <= tol, f"{name}: relative L2 {rel:.2e}"


def _tokenized_batch(trainer):
    from trl.data_utils import prepare_multimodal_messages

    batch = decode_pending(next(iter(trainer.get_train_dataloader())), trainer._pending_transform)
    prompts = [prepare_multimodal_messages(x["prompt"], images=x["images"]) for x in batch]
    return trainer._tokenize_prompts(prompts)


def _generate_both(trainer, monkeypatch, seed=0):
    """(ours, plain TRL, which decoder ours used): the same batch, the same RNG state for both."""
    import vlm_grpo.fastpath.decode as decode

    used = []
    real = decode.fast_decode  # the shared prefill calls decode.fast_decode
    monkeypatch.setattr(decode, "fast_decode", lambda *a, **k: used.append("fast") or real(*a, **k))
    prompt_ids, images, fields = _tokenized_batch(trainer)
    torch.manual_seed(seed)
    ours, _ = trainer._generate_single_turn(prompt_ids, images, fields, G)
    after_ours = torch.get_rng_state()
    torch.manual_seed(seed)
    plain, _ = GRPOTrainer._generate_single_turn(trainer, prompt_ids, images, fields, G)
    # The sampler is left as generate leaves it: the next generation (next step) draws the same numbers.
    assert torch.equal(after_ours, torch.get_rng_state())
    return ours, plain, used


def assert_samples_like_generate(trainer, monkeypatch) -> list[list[int]]:
    """Sampling with every processor on, full length: fast decode draws generate's tokens under the same seed."""
    config = trainer.generation_config
    config.temperature, config.top_k, config.top_p, config.repetition_penalty = 0.7, 50, 0.9, 1.2
    config.min_new_tokens = config.max_new_tokens
    ours, plain, used = _generate_both(trainer, monkeypatch, seed=5)
    assert used == ["fast"] and ours == plain
    assert len({tuple(c) for c in ours}) > 2  # really sampled: the G copies of a prompt differ
    return ours


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prompt_pass_matches_trl(family, attn, tiny_models, rows_file, tmp_path):
    trainer = make_trainer(tiny_models[family], rows_file, tmp_path, attn=attn)
    assert_parity(trainer, real_batch(trainer))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "internvl"])
def test_shared_prompt_pass_matches_trl_with_lora(family, tiny_models, rows_file, tmp_path):
    trainer = make_trainer(tiny_models[family], rows_file, tmp_path, lora=True)
    assert_parity(trainer, real_batch(trainer))


def test_shared_prompt_pass_matches_trl_with_internvl_tiles(tiny_models, rows_file, tmp_path):
    """Several tiles per image (``--max_anyres_num``): pixel rows are tiles, counted per sample."""
    trainer = make_trainer(tiny_models["internvl"], rows_file, tmp_path, max_anyres_num=4)
    inputs = real_batch(trainer)
    assert inputs.get("num_tiles") and sum(inputs["num_tiles"]) > sum(inputs["num_images"])
    assert_parity(trainer, inputs)


def test_the_parity_test_catches_1d_positions(tiny_models, rows_file, tmp_path, monkeypatch):
    """Wrong positions (plain 1-D instead of mrope) must fail parity: the test can tell wrong from right."""
    from vlm_grpo.modules.base import GroupSharingMixin

    trainer = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path)
    inputs = real_batch(trainer)
    one_d = GroupSharingMixin.packed_position_ids

    def wrong(self, model, group, mm, completions):
        return one_d(self, model, group, mm, completions).expand(3, 1, -1)

    monkeypatch.setattr(type(trainer.vlm_module), "packed_position_ids", wrong)
    with pytest.raises(AssertionError):
        assert_parity(trainer, inputs)


def test_the_parity_test_catches_blocks_that_see_each_other(tiny_models, rows_file, tmp_path, monkeypatch):
    import vlm_grpo.fastpath.sharing as sharing

    trainer = make_trainer(tiny_models["qwen2_vl"], rows_file, tmp_path, packed_attention="dense")
    inputs = real_batch(trainer)
    real_mask = sharing.build_mask

    def leaky(row, total, dtype, device):  # plain causal over the whole pack
        mask = real_mask(row, total, dtype, device)
        return mask | torch.ones_like(mask).tril() if dtype is None else mask

    monkeypatch.setattr(sharing, "build_mask", leaky)
    with pytest.raises(AssertionError):
        assert_parity(trainer, inputs)


def shuffled_as_trl_does(inputs, seed):
    """The batch in the order ``GRPOTrainer._prepare_inputs`` hands it to the loss: per-sample pixels split,
    rows permuted in unison (``shuffle_sequence_dict``), cut into micro-batches, pixels joined again."""
    from trl.trainer.utils import (
        shuffle_sequence_dict,
        split_pixel_values_by_grid,
        split_tensor_dict,
        unsplit_pixel_values_by_grid,
    )

    torch.manual_seed(seed)
    (batch,) = split_tensor_dict(shuffle_sequence_dict(split_pixel_values_by_grid(inputs)), 1)
    return unsplit_pixel_values_by_grid(batch)


def interleaved(inputs):
    """A shuffle (TRL's own, seeded) whose groups do not come in batch order, so the packed pass must put rows
    back to their rows."""
    for seed in range(100):
        batch = shuffled_as_trl_does(inputs, seed)
        lengths = batch["prompt_mask"].sum(1).tolist()  # the two prompts differ in length
        if sum(a != b for a, b in itertools.pairwise(lengths)) > len(set(lengths)) - 1:  # groups interleave
            return batch
    raise AssertionError("no interleaving shuffle found")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "internvl"])
def test_shared_prompt_pass_matches_trl_on_a_batch_shuffled_as_trl_shuffles_it(family, tiny_models, rows_file,
                                                                               tmp_path, monkeypatch):  # fmt: skip
    """TRL shuffles the generation batch before the loss; a group's rows then sit apart, and the packed pass must
    scatter its log-probs back to each row. Control: log-probs left in group order fail the same check."""
    import vlm_grpo.fastpath.sharing as sharing

    trainer = make_trainer(tiny_models[family], rows_file, tmp_path, max_anyres_num=2 if family == "internvl" else None)
    in_batch_order = real_batch(trainer)
    inputs = interleaved(in_batch_order)
    assert_parity(trainer, inputs)

    class GroupOrder:  # ``torch`` for the sharing module, with argsort planted as the identity (a one-line bug)
        def __getattr__(self, name):
            if name == "argsort":
                return lambda rows: torch.arange(len(rows), device=rows.device)
            return getattr(torch, name)

    monkeypatch.setattr(sharing, "torch", GroupOrder())
    with pytest.raises(AssertionError):
        assert_parity(trainer, inputs)
    assert_parity(trainer, in_batch_order)  # unshuffled, groups are contiguous: the same bug would go unseen


@pytest.mark.parametrize("family", FAMILIES)
def test_block_attention_matches_trl_without_a_dense_mask(family, tiny_models, rows_file, tmp_path, monkeypatch):
    """sdpa models take the prefix + blocks kernel: same numbers as TRL, and no (P+G*C)^2 mask is built."""
    import vlm_grpo.fastpath.sharing as sharing
    from vlm_grpo.fastpath.block_attention import NAME

    def no_dense_mask(*args, **kwargs):
        raise AssertionError("the block kernel must not build the dense mask")

    trainer = make_trainer(tiny_models[family], rows_file, tmp_path)
    inputs = real_batch(trainer)
    monkeypatch.setattr(sharing, "build_mask", no_dense_mask)
    assert_parity(trainer, inputs)
    assert trainer.model.config.get_text_config(decoder=True)._attn_implementation == NAME


def test_every_attention_call_of_the_shared_pass_takes_batched_4d_inputs(tiny_models, rows_file, tmp_path):
    """On GPU sdpa's flash / memory-efficient / cuDNN kernels take only (batch, heads, length, dim): a 3-D call
    falls back to the math kernel (fp32 scores, several times slower), which the CPU numbers cannot show."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    shapes: list[tuple[int, ...]] = []

    class RecordSdpa(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.scaled_dot_product_attention:
                shapes.append(tuple(t.dim() for t in args[:3]))
            return func(*args, **(kwargs or {}))

    trainer = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path)
    inputs = real_batch(trainer)
    with RecordSdpa():
        logps_and_grads(trainer, inputs, VLMGRPOTrainer._get_per_token_logps_and_entropies, 1.0)
    assert shapes and set(shapes) == {(4, 4, 4)}, sorted(set(shapes))


def test_the_trainer_turns_cudnn_attention_off_unless_asked(tiny_models, rows_file, tmp_path):
    """cuDNN plans every new sequence length (~150 ms on H100) and prompts change length every step. The switch
    is process-wide so that checkpointing's recomputation picks the kernels its forward picked (on an H100 a
    forward-only switch failed: flash's saved tensors against cuDNN's in the recomputation)."""
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path, cudnn_attention=True)
        assert torch.backends.cuda.cudnn_sdp_enabled()
        make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path)
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


def test_block_attention_is_chosen_only_where_it_applies_and_is_not_saved(tiny_models, rows_file, tmp_path):
    """sdpa + full attention switches; eager, sliding-window layers and packed_attention=dense do not; a
    checkpoint saved after training does not carry the kernel's name."""
    from vlm_grpo.fastpath.block_attention import NAME, use_block_attention

    trainer = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path)
    model = trainer.model
    text = model.config.get_text_config(decoder=True)
    assert text._attn_implementation == NAME  # switched when the trainer was built
    assert not use_block_attention(model, "dense") and text._attn_implementation == "sdpa"
    assert use_block_attention(model, "blocks") and text._attn_implementation == NAME
    model.save_pretrained(tmp_path / "saved")
    assert "vlm_grpo" not in (tmp_path / "saved" / "config.json").read_text()

    text._attn_implementation = "sdpa"
    text.layer_types = ["sliding_attention", *text.layer_types[1:]]
    assert not use_block_attention(model, "blocks") and text._attn_implementation == "sdpa"
    eager = make_trainer(tiny_models["qwen2_vl"], rows_file, tmp_path, attn="eager")
    assert eager.model.config.get_text_config(decoder=True)._attn_implementation == "eager"
    with pytest.raises(ValueError, match="packed_attention must be"):
        use_block_attention(eager.model, "flex")


@pytest.mark.parametrize("family", ["qwen2_5_vl", "internvl"])
def test_block_attention_matches_trl_under_gradient_checkpointing(family, tiny_models, rows_file, tmp_path):
    """The recomputed layers of the backward pass must see the packed layout too (it travels in kwargs)."""
    trainer = make_trainer(tiny_models[family], rows_file, tmp_path)
    inputs = real_batch(trainer)
    trainer.model.gradient_checkpointing_enable({"use_reentrant": False})
    trainer.model.train()
    calls = []
    attention = trainer.model.get_decoder().layers[0].self_attn
    handle = attention.register_forward_hook(lambda *a: calls.append(1))
    try:
        logps_and_grads(trainer, inputs, VLMGRPOTrainer._get_per_token_logps_and_entropies, 1.0)
    finally:
        handle.remove()
    assert len(calls) == 2, "one forward and one recomputation in backward"
    assert_parity(trainer, inputs)


@pytest.mark.parametrize(
    ("family", "lora", "backend"),
    [
        ("qwen2_5_vl", False, "inductor"),
        ("qwen3_vl", False, "aot_eager"),
        ("internvl", False, "aot_eager"),
        ("qwen2_5_vl", True, "aot_eager"),
    ],
)
def test_compiled_layers_match_trl_under_gradient_checkpointing(family, lora, backend, tiny_models, rows_file, tmp_path,
                                                                monkeypatch):  # fmt: skip
    """compile_layers: decoder layers compiled inside the checkpoint, the packed kernel an eager island.
    A new completion width recompiles once (dynamic shapes), a third width not at all; new layouts never.
    Inductor's generated code is held against TRL once; the other cases check dynamo's tracing with ``aot_eager``
    (no code generation: ~40 s less each on a cold CI machine)."""
    from torch._dynamo.utils import counters

    import vlm_grpo.fastpath.compiled_layers as compiled_layers
    from vlm_grpo.fastpath.compiled_layers import decoder_layers

    monkeypatch.setattr(compiled_layers, "_compiled", {})
    monkeypatch.setattr(compiled_layers, "_BACKEND", backend)
    trainer = make_trainer(tiny_models[family], rows_file, tmp_path, lora=lora, compile_layers=True)
    # The trainer names a compile job, whose profile of dynamic dimensions (kept in the compile cache by earlier
    # runs) would make the widths dynamic from the first call: the counts below are a cold process's.
    monkeypatch.setattr(torch.compiler.config, "job_id", None)
    inputs = real_batch(trainer)
    trainer.model.gradient_checkpointing_enable({"use_reentrant": False})
    trainer.model.train()
    torch._dynamo.reset()  # forget shapes earlier tests compiled for: the counts below start from nothing
    counters.clear()
    frames = []
    for cut in (0, 1, 2):  # narrower completions: other shapes, other layouts
        batch = {**inputs}
        for key in ("completion_ids", "completion_mask", "mm_token_type_ids"):  # the last spans prompt + completion
            if batch.get(key) is not None:
                batch[key] = inputs[key][:, : inputs[key].size(1) - cut]
        assert_parity(trainer, batch)
        frames.append(counters["frames"]["total"])
    assert counters["stats"]["unique_graphs"] >= 2, "dynamo compiled nothing"
    assert frames[2] == frames[1] > frames[0] > 0, frames
    assert all("disable" in reason for reason in counters["graph_break"]), list(counters["graph_break"])
    assert any("_packed_sdpa" in reason for reason in counters["graph_break"]), "the island breaks the graph"
    layers = decoder_layers(trainer.model)
    assert layers and all("forward" not in layer.__dict__ for layer in layers), "layers restored after the pass"


def test_compile_layers_defaults_to_gpus_and_is_refused_where_parameters_are_gathered_per_module():
    """Unset: on for a GPU, off on CPU and under ZeRO-3 / FSDP; asked for under ZeRO-3 / FSDP: a clear error."""
    from vlm_grpo.fastpath.compiled_layers import resolve_compile_layers

    with pytest.raises(ValueError, match="compile_layers=True does not work with DeepSpeed ZeRO-3 or FSDP"):
        resolve_compile_layers(True, "cuda", sharded=True)
    assert resolve_compile_layers(None, "cuda", sharded=False) is True
    assert resolve_compile_layers(None, "cuda", sharded=True) is False
    assert resolve_compile_layers(None, "cpu", sharded=False) is False
    assert resolve_compile_layers(True, "cpu", sharded=False) is True
    assert resolve_compile_layers(False, "cuda", sharded=False) is False


def test_the_trainer_resolves_compile_layers_without_changing_its_arguments(tiny_models, rows_file, tmp_path):
    default = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path)
    assert default.args.compile_layers is None and default.compile_layers is False  # CPU
    asked = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path / "asked", compile_layers=True)
    assert asked.compile_layers is True


def test_a_failed_layer_compilation_warns_once_and_trains_eagerly(tiny_models, rows_file, tmp_path, monkeypatch,
                                                                  caplog):  # fmt: skip
    """A machine where inductor cannot compile must still train, with TRL's numbers."""
    import vlm_grpo.fastpath.compiled_layers as compiled_layers

    def broken_backend(graph, example_inputs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(compiled_layers, "_compiled", {})
    monkeypatch.setattr(compiled_layers, "_BACKEND", broken_backend)
    trainer = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path, compile_layers=True)
    inputs = real_batch(trainer)
    trainer.model.gradient_checkpointing_enable({"use_reentrant": False})
    trainer.model.train()
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING, logger="vlm_grpo.fastpath.compiled_layers"):
        assert_parity(trainer, inputs)
        assert_parity(trainer, inputs)
    failures = sorted(r.message for r in caplog.records if "failed" in r.message)
    assert len(failures) == 2, failures  # once per layer class, not per layer or per pass
    assert "compiling Qwen2_5_VLDecoderLayer failed" in failures[0] and "no compiler here" in failures[0]
    assert "compiling Qwen2_5_VLVisionBlock failed" in failures[1]


def test_training_with_compiled_layers_and_a_reference_model_updates_the_policy(tiny_models, rows_file, tmp_path):
    """The whole loop (generation, reference and policy passes, optimizer) with compile_layers on."""
    from vlm_grpo.fastpath.compiled_layers import decoder_layers

    trainer = make_trainer(
        tiny_models["qwen2_5_vl"], rows_file, tmp_path, compile_layers=True, gradient_checkpointing=True,
        beta=0.04, max_steps=2, learning_rate=1e-2, logging_steps=1,
    )  # fmt: skip
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "layers.0.mlp" in n}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert before and any(not torch.equal(before[n], after[n]) for n in before), "the policy did not change"
    kl = [log["kl"] for log in trainer.state.log_history if "kl" in log]
    assert len(kl) == 2 and all(math.isfinite(x) for x in kl)
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(trainer.model))


def test_the_parity_test_catches_a_detached_prompt_in_the_block_kernel(tiny_models, rows_file, tmp_path):
    """Blocks that read the prompt's keys/values without a gradient path to them must fail parity."""
    from transformers import AttentionInterface

    from vlm_grpo.fastpath.block_attention import LAYOUT_KWARG, NAME, block_sdpa

    def detached_prefix(module, query, key, value, *args, **kwargs):
        layout = kwargs.get(LAYOUT_KWARG)
        if layout is not None:
            cut = torch.arange(key.size(2)) < max(g[0].prefix for g in layout.rows)  # the longest prefix of any row
            key = torch.where(cut[None, None, :, None], key.detach(), key)
            value = torch.where(cut[None, None, :, None], value.detach(), value)
        return block_sdpa(module, query, key, value, *args, **kwargs)

    trainer = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path)
    inputs = real_batch(trainer)
    assert_parity(trainer, inputs)  # registers the kernel on the model
    AttentionInterface.register(NAME, detached_prefix)
    try:
        with pytest.raises(AssertionError):
            assert_parity(trainer, inputs)
    finally:
        AttentionInterface.register(NAME, block_sdpa)


def test_shared_pass_processes_each_image_once(tiny_models, rows_file, tmp_path):
    trainer = make_trainer(tiny_models["qwen2_5_vl"], rows_file, tmp_path)
    inputs = real_batch(trainer)
    calls = []
    visual = trainer.model.model.visual
    handle = visual.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]))
    try:
        logps_and_grads(trainer, inputs, VLMGRPOTrainer._get_per_token_logps_and_entropies, 1.0)
    finally:
        handle.remove()
    rows_per_image = inputs["image_grid_thw"].prod(-1)
    unique_rows = int(rows_per_image[:1].sum() + rows_per_image[G : G + 2].sum())  # one copy of each prompt's images
    assert calls == [unique_rows], (calls, unique_rows, int(inputs["pixel_values"].shape[0]))
