"""The dummy vision pass that keeps sharded ranks in step (``vlm_grpo.fastpath.vision_sync``), on one process:
it runs exactly where and when the real vision pass would, and changes neither loss nor gradients."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, DynamicCache

from vlm_grpo.fastpath.decode import cache_kwarg
from vlm_grpo.fastpath.vision_sync import install_vision_sync
from vlm_grpo.modules import get_vlm_module
from vlm_grpo.testing import FAMILIES

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _setup(tiny_models, family):
    path = str(tiny_models[family])
    module = get_vlm_module(path)
    processor = module.load_processor(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    return module, processor, model


def _batch(processor, image: bool):
    content = [{"type": "text", "text": "What is 2 + 2?"}]
    if image:
        content.insert(0, {"type": "image"})
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    images = [Image.new("RGB", (56, 56), (200, 30, 30))] if image else None
    return processor(text=[text, text], images=[images[0], images[0]] if image else None, return_tensors="pt")


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    labels = batch["input_ids"].clone()
    loss = model(**batch, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
def test_dummy_vision_pass_leaves_loss_and_grads_unchanged(tiny_models, family):
    module, processor, model = _setup(tiny_models, family)
    batch = _batch(processor, image=False)
    loss, grads = _loss_and_grads(model, batch)
    vision = [n for n in grads if module.is_vision_parameter(n)]
    assert vision and all(grads[n] is None for n in vision)  # text only: the tower does not run

    sync = install_vision_sync(module, model)
    synced_loss, synced_grads = _loss_and_grads(model, batch)
    assert sync.dummy_passes == 1
    assert torch.equal(loss, synced_loss)
    for name, grad in grads.items():
        if module.is_vision_parameter(name):
            # Every vision parameter a real image pass trains gets a gradient, and it is zero.
            assert synced_grads[name] is not None and not synced_grads[name].any(), name
        else:
            assert torch.equal(grad, synced_grads[name]), name

    # A batch with images runs the real tower: no dummy pass.
    _loss_and_grads(model, _batch(processor, image=True))
    assert sync.dummy_passes == 1
    sync.remove()
    _loss_and_grads(model, batch)
    assert sync.dummy_passes == 1


@pytest.mark.parametrize("family", ["qwen2_5_vl", "internvl"])
def test_dummy_vision_pass_runs_in_prefill_only(tiny_models, family):
    """Generation: the prefill of a text-only batch encodes the dummy image, decode steps do not (nor does
    a forward that continues a filled cache), on every rank alike."""
    module, processor, model = _setup(tiny_models, family)
    sync = install_vision_sync(module, model)
    batch = _batch(processor, image=False)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        cache = DynamicCache(config=model.config)  # the shared-prefill path: prefill, then continue the cache
        model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], **cache_kwarg(model, cache), use_cache=True)
        assert sync.dummy_passes == 1
        model(input_ids=ids[:, -1:], attention_mask=mask, **cache_kwarg(model, cache), use_cache=True)
        assert sync.dummy_passes == 1
        model.generate(**batch, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert sync.dummy_passes == 2
