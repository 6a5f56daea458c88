"""The served models: a listener that scores images with P("yes"), a speaker that describes them.

Both load any checkpoint whose family is in the VLM-module registry (``config.json``'s ``model_type``, or
``vlm_module=`` to force one), through the same adapter the trainer uses, and run without gradients.
They are plain Python objects; :mod:`vlm_grpo.serve.app` puts them behind HTTP.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlm_grpo.data.images import decode_rgb
from vlm_grpo.modules import ImageLimits, VLMModule, get_vlm_module

logger = logging.getLogger(__name__)

#: Appended to the listener question; the listener prompt is ``<image>{question} Answer yes or no.``
YES_NO_SUFFIX = " Answer yes or no."
YES_WORDS = ("yes", "Yes")
NO_WORDS = ("no", "No")
SPEAKER_TAGS = ("thinking", "coarse", "detailed")
DEFAULT_SPEAKER_PROMPT = (
    "Describe this image so that a listener can pick it out among similar images. First think in "
    "<thinking></thinking>, then give a short description in <coarse></coarse> and a one-sentence detailed "
    "description in <detailed></detailed>."
)


@dataclass
class LoadedVLM:
    model: Any
    processor: Any
    module: VLMModule
    name: str
    device: str


def load_vlm(
    path: str,
    *,
    vlm_module: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    limits: ImageLimits | None = None,
    trust_remote_code: bool = False,
) -> LoadedVLM:
    """Load model + processor of a registered family on ``device`` (default: CUDA if present, else CPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype in (None, "", "auto"):
        dtype = "bfloat16" if str(device).startswith("cuda") else "float32"
    module = get_vlm_module(path, vlm_module, limits)
    processor = module.load_processor(path, trust_remote_code=trust_remote_code)
    model = module.load_model(path, dtype=dtype, trust_remote_code=trust_remote_code)
    model.to(device).eval()
    logger.info("Loaded %s (%s adapter) on %s as %s", path, module.name or type(module).__name__, device, dtype)
    return LoadedVLM(model=model, processor=processor, module=module, name=str(path), device=str(device))


def _first_token_ids(tokenizer: Any, words: Sequence[str]) -> list[int]:
    ids: list[int] = []
    for word in words:
        encoded = tokenizer.encode(word, add_special_tokens=False)
        if encoded and encoded[0] not in ids:
            ids.append(encoded[0])
    return ids


def _chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class _Runner:
    """Shared by listener and speaker: builds processor inputs for one-image prompts."""

    def __init__(self, vlm: LoadedVLM, batch_size: int) -> None:
        self.vlm = vlm
        self.batch_size = batch_size
        self.max_image_pixels: int | None = None  # set by the app from its settings
        self.tokenizer = getattr(vlm.processor, "tokenizer", vlm.processor)

    @property
    def name(self) -> str:
        return self.vlm.name

    @property
    def device(self) -> str:
        return self.vlm.device

    def _inputs(self, pairs: Sequence[tuple[str, str]]) -> Any:
        """``pairs`` of (image path, user text) -> processor outputs on the device, left-padded."""
        texts, images = [], []
        for path, text in pairs:
            messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
            texts.append(self.vlm.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
            # the pixel limit is checked from the header, before decoding
            images.append(decode_rgb(path, self.max_image_pixels, "max_image_pixels"))
        inputs = self.vlm.processor(text=texts, images=images, return_tensors="pt", padding=True)
        return inputs.to(self.vlm.device)


class ListenerScorer(_Runner):
    """P("yes") of a question about each image.

    The rule: the prompt is the chat template applied to one user turn ``[image] + "{question} Answer yes or no."``
    with the generation prompt added; from the logits of the first generated token, take the ids of the first
    token of ``"yes"``, ``"Yes"`` (the yes set) and of ``"no"``, ``"No"`` (the no set), each word encoded without
    special tokens and duplicates dropped, and return ``sum(exp(yes logits)) / sum(exp(yes and no logits))``,
    i.e. a softmax restricted to those ids. On Qwen tokenizers these are the single tokens ``yes``/``Yes``/
    ``no``/``No``. The value is in [0, 1] whatever the model.
    """

    def __init__(self, vlm: LoadedVLM, batch_size: int = 8) -> None:
        super().__init__(vlm, batch_size)
        self.yes_ids = _first_token_ids(self.tokenizer, YES_WORDS)
        self.no_ids = _first_token_ids(self.tokenizer, NO_WORDS)
        if not self.yes_ids or not self.no_ids or set(self.yes_ids) & set(self.no_ids):
            raise ValueError(
                f"The tokenizer of {vlm.name} does not separate yes {self.yes_ids} from no {self.no_ids}; "
                "it cannot serve as a listener"
            )

    @torch.no_grad()
    def yes_probabilities(self, pairs: Sequence[tuple[str, str]]) -> list[float]:
        """``pairs`` of (image path, question) -> P("yes") for each, in order, ``batch_size`` images per forward."""
        out: list[float] = []
        ids = torch.tensor(self.yes_ids + self.no_ids)
        n_yes = len(self.yes_ids)
        for chunk in _chunks(list(pairs), self.batch_size):
            prompts = [(path, f"{question.strip()}{YES_NO_SUFFIX}") for path, question in chunk]
            inputs = self._inputs(prompts)
            logits = self.vlm.model(**inputs).logits[:, -1, :]
            picked = logits.float().cpu()[:, ids]
            probs = torch.softmax(picked, dim=-1)[:, :n_yes].sum(dim=-1).clamp(0.0, 1.0)
            out.extend(float(p) for p in probs)
        return out


def parse_speaker_output(text: str) -> dict[str, str | None]:
    """``{"thinking", "coarse", "detailed"}``: the stripped content of each tag's last complete block, else None."""
    from vlm_grpo.rewards.format import extract_tag

    fields: dict[str, str | None] = {}
    for tag in SPEAKER_TAGS:
        value = extract_tag(text, tag)
        fields[tag] = value.strip() if value is not None else None
    return fields


class SpeakerDescriber(_Runner):
    """Greedy (or sampled) descriptions of images, ``batch_size`` prompts per ``generate`` call."""

    def __init__(self, vlm: LoadedVLM, batch_size: int = 4, max_new_tokens: int = 128) -> None:
        super().__init__(vlm, batch_size)
        self.max_new_tokens = max_new_tokens

    @torch.no_grad()
    def describe(
        self,
        pairs: Sequence[tuple[str, str]],
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
    ) -> list[str]:
        """``pairs`` of (image path, prompt) -> generated text of each."""
        texts: list[str] = []
        limit = max_new_tokens or self.max_new_tokens
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        for chunk in _chunks(list(pairs), self.batch_size):
            inputs = self._inputs(chunk)
            generated = self.vlm.model.generate(**inputs, max_new_tokens=limit, pad_token_id=pad_id, **sampling)
            new = generated[:, inputs["input_ids"].shape[1] :]
            texts.extend(self.tokenizer.batch_decode(new, skip_special_tokens=True))
        return texts
