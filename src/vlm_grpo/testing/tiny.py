"""Offline builder of randomly initialised VLM checkpoints: tiny ones per family, and real-size presets.

Tests and smoke runs need real checkpoints (``config.json`` + weights + processor) that load through
``AutoProcessor`` / ``AutoModelForImageTextToText`` exactly like hub models, but the machines that run
them have no hub access. This module builds such checkpoints from scratch in a few seconds:

* a byte-level BPE tokenizer (Qwen2's pre-tokenizer: digits split one by one) trained with
  ``tokenizers`` on a built-in corpus, with the family's special tokens and a chat template that
  carries ``{% generation %}`` markers for ``return_assistant_tokens_mask``;
* the family's image and video processors with small default limits (few image tokens);
* a 2-layer, 64-wide language model and a 2-block vision tower, seeded, so the same seed gives the
  same weights.

Size presets (:data:`PRESETS`, defined in :mod:`vlm_grpo.testing.presets`) copy real checkpoints'
shapes instead (Qwen2-VL-2B, Qwen2.5-VL-3B/7B, Qwen3-VL-2B, InternVL3-1B/2B), so the trainer can be
timed at real size offline: speed and memory do not depend on weight values. Their tokenizer is the
same BPE extended with synthetic merges to exactly the real ``vocab_size`` (every id decodes), and
their processors use the real default image limits. :func:`build_model` builds one in memory on any
device (random init straight on the GPU) and optionally saves it.

Nothing is cached on disk outside ``out_dir``. Usage::

    python -m vlm_grpo.testing.tiny --family qwen2_5_vl --out /tmp/tiny-qwen2_5_vl
    python -m vlm_grpo.testing.tiny --family all --out /tmp/tiny   # one sub-folder per family
    python -m vlm_grpo.testing.tiny --preset qwen2_5_vl_3b --out /tmp/qwen2_5_vl_3b --device cuda
"""

from __future__ import annotations

import argparse
import functools
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlm_grpo.testing.presets import FAMILIES, PRESETS, TINY_FAMILIES, Preset, get_preset
from vlm_grpo.testing.tiny_parts import (
    COMMON_SPECIAL_TOKENS,
    MROPE_SECTION,
    QWEN3_TINY_VISION,
    QWEN_SPECIAL_TOKENS,
    TEXT_DIMS,
    TinyFamily,
    qwen3_rope,
)
from vlm_grpo.testing.tiny_parts import merged as _merged
from vlm_grpo.testing.tiny_parts import qwen_processors as _qwen_processors
from vlm_grpo.testing.tiny_parts import qwen_token_ids as _qwen_token_ids
from vlm_grpo.testing.tiny_parts import text_config as _text_config
from vlm_grpo.tools.templates import INTERNVL_IMAGE, INTERNVL_VIDEO, QWEN_IMAGE, QWEN_VIDEO, tool_chat_template

if TYPE_CHECKING:
    import torch

__all__ = [
    "FAMILIES",
    "PRESETS",
    "TINY_FAMILIES",
    "Preset",
    "TinyFamily",
    "build_config",
    "build_model",
    "build_tiny_model",
    "build_tokenizer",
]

VOCAB_SIZE = 1536  # target for BPE training; the reached size is reported by ``len(tokenizer)``

# Qwen2's split regex: contractions, letter runs, single digits, punctuation runs, newlines, spaces.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# InternVL's processor reads these four as tokenizer attributes (``extra_special_tokens``).
INTERNVL_EXTRA_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}

# ----------------------------------------------------------------------------- chat templates
# The tool-capable templates of vlm_grpo.tools.templates, without a default system prompt: one renderer
# for string or list content (list items in order), assistant turns wrapped in {% generation %} (with
# their <|im_end|>) so SFT can ask for the assistant-token mask, and tools rendered as Qwen2.5's real
# templates render them (schemas in a system turn, <tool_call> blocks, <tool_response> results).
QWEN_CHAT_TEMPLATE = tool_chat_template(QWEN_IMAGE, QWEN_VIDEO, default_system=None)
# Like InternVL3-hf's template: a newline follows each placeholder; the processor expands
# <IMG_CONTEXT> into <img> + image_seq_length * tiles * <IMG_CONTEXT> + </img>.
INTERNVL_CHAT_TEMPLATE = tool_chat_template(INTERNVL_IMAGE, INTERNVL_VIDEO, default_system=None)

# ----------------------------------------------------------------------------- corpus
_WORDS = """
the a an of and or to in on at by for with from into over under above below between behind near far left
right top bottom middle center front back up down inside outside is are was were be been has have had do does
did can could will would should may might must not no yes this that these those there here what which who whom
whose where when why how many much more most less least some any all each every other another both either
neither one two three four five six seven eight nine ten eleven twelve twenty thirty hundred thousand first
second third last next number count total sum answer question image picture photo scene object objects box boxes
bounding coordinate coordinates region area point points line lines shape shapes color colors size large small
big tiny tall short long wide narrow red blue green yellow orange purple pink brown black white gray grey dark
light bright square squares circle circles triangle triangles rectangle rectangles star stars dot dots cube
cubes sphere spheres cylinder cylinders person people man woman boy girl child children dog dogs cat cats bird
birds horse horses cow cows sheep car cars bus truck bike bicycle train plane boat ship road street sign tree
trees flower flowers grass sky cloud clouds sun moon water river lake sea beach mountain hill house building
window door wall floor table chair bed sofa lamp cup glass bottle plate bowl fork knife spoon food apple banana
orange pizza cake bread phone laptop computer screen keyboard mouse book books paper pen clock watch bag ball
hat shirt shoe shoes kitchen room office park city field garden think thinking thought reason reasoning step
steps solve solution check verify because therefore so then first finally output final result correct wrong
true false see look looks seen find found locate located detect show shows shown describe description answer
user assistant system you your i me my we our they them their he she it its his her please tell give list
name names word words letter letters text read write math equation value values add subtract multiply divide
plus minus times equals equal greater smaller than same different compare larger largest smallest highest lowest
how many are there in the image what is the color of shape which object is on the left of right count all
visible only also just very quite about around approximately exactly nearly almost half quarter percent degree
angle radius diameter length width height depth position relative absolute pixel pixels normalized frame grid
row column rows columns cell cells table chart graph bar pie axis label labels title legend data value mean
average median maximum minimum sort order sequence pattern repeat repeated match matching pair pairs group
groups set sets element elements sample samples train training test testing model models vision language
reward rewards policy group relative optimization advantage loss gradient learning rate batch epoch
""".split()

_SYLLABLES = "ba be bi bo bu ka ke ki ko ku la le li lo lu ma me mi mo mu na ne ni no nu ra re ri ro ru ta te ti to tu"


def _corpus() -> Iterator[str]:
    """A fixed, varied corpus: words, sentences, tags, boxes, numbers and chat fragments."""
    rng = random.Random(1234)  # the corpus is fixed: the tokenizer must not depend on the weight seed
    words = list(dict.fromkeys(_WORDS))
    colors = "red blue green yellow orange purple pink brown black white gray".split()
    shapes = "square circle triangle rectangle star dot cube sphere cylinder".split()
    syll = _SYLLABLES.split()
    for _ in range(3):
        yield " ".join(words)
        yield " ".join(w.capitalize() for w in words)
    for _ in range(1500):
        c, s, n = rng.choice(colors), rng.choice(shapes), rng.randint(0, 20)
        box = [rng.randint(0, 999) for _ in range(4)]
        pseudo = "".join(rng.choice(syll) for _ in range(rng.randint(2, 4)))
        yield f"How many {c} {s}s are there in the image? Count the {s}s."
        yield f"<think> I see {n} {c} {s}s and {n + 1} {rng.choice(colors)} {rng.choice(shapes)}s. </think>"
        yield f"<answer>{n}</answer> <answer> {box} </answer> <answer>[{box[0]}, {box[1]}, {box[2]}, {box[3]}]</answer>"
        yield f'{{"bbox_2d": [{box[0]}, {box[1]}, {box[2]}, {box[3]}], "label": "{c} {s}"}} ({n}, {box[0]})'
        yield f"{n} + {box[0]} = {n + box[0]}; {box[1]} - {n} = {box[1] - n}; {n} * 3 = {n * 3}. {pseudo} {pseudo}s"
        yield " ".join(rng.sample(words, 12)) + rng.choice([".", "?", "!", ",", ":", ";"])
        yield "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
        yield "<|im_start|>assistant\n<think>\n</think>\n<answer>\n</answer><|im_end|>\n"


@functools.lru_cache(maxsize=1)
def _trained_bpe_json() -> str:
    """Train the BPE once per process (deterministic: fixed corpus, no special tokens yet)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return tok.to_str()


def _extended_bpe(size: int) -> Any:
    """The trained BPE grown to exactly ``size`` entries with synthetic merges (deterministic).

    Each new entry merges two trained tokens (picked by a fixed-seed RNG) into a string not yet in
    the vocabulary. The merges rank after the trained ones, so the model stays valid BPE (normal
    text still round-trips) and every id decodes to text. 150k merges take well under a second.
    """
    from tokenizers import Tokenizer, models

    trained = Tokenizer.from_str(_trained_bpe_json())
    data = json.loads(_trained_bpe_json())["model"]
    vocab: dict[str, int] = data["vocab"]
    merges: list[tuple[str, str]] = [tuple(m) for m in data["merges"]]
    if size < len(vocab):
        raise ValueError(f"vocabulary size {size} is below the trained BPE's {len(vocab)} entries")
    base = sorted(vocab, key=vocab.__getitem__)
    rng = random.Random(4321)  # fixed: the tokenizer must not depend on the weight seed
    while len(vocab) < size:
        picks = rng.choices(base, k=2 * (size - len(vocab)))
        for left, right in zip(picks[::2], picks[1::2], strict=True):
            merged = left + right
            if merged not in vocab:
                vocab[merged] = len(vocab)
                merges.append((left, right))
                if len(vocab) == size:
                    break
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = trained.pre_tokenizer
    tok.decoder = trained.decoder
    return tok


def _add_special_tokens(tok: Any, specials: list[str]) -> None:
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])


@functools.lru_cache(maxsize=4)
def _full_vocab_backend(specials: tuple[str, ...], vocab_size: int) -> Any:
    """The ``tokenizers.Tokenizer`` of exactly ``vocab_size`` entries, specials last (kept per process).

    Never handed out: ``PreTrainedTokenizerFast(tokenizer_object=...)`` works on a deep copy.
    """
    tok = _extended_bpe(vocab_size - len(specials))
    _add_special_tokens(tok, list(specials))
    return tok


def build_tokenizer(family: str, vocab_size: int | None = None) -> Any:
    """A ``PreTrainedTokenizerFast`` with the family's special tokens and chat template.

    ``vocab_size`` (special tokens included) grows the BPE with synthetic merges so that
    ``len(tokenizer) == vocab_size`` exactly; ``None`` keeps the trained BPE (about 1.5k entries).
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = family_spec(family)
    specials = list(spec.specials)
    if vocab_size is None:
        tok = Tokenizer.from_str(_trained_bpe_json())
        _add_special_tokens(tok, specials)
    else:
        tok = _full_vocab_backend(tuple(specials), vocab_size)
    kwargs: dict[str, Any] = {"extra_special_tokens": dict(spec.extra_tokens)} if spec.extra_tokens else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=spec.eos,
        pad_token=spec.pad,
        padding_side="left",
        chat_template=spec.chat_template,
        model_max_length=32768,
        **kwargs,
    )


# ----------------------------------------------------------------------------- per-family parts
def _qwen_top(tokenizer: Any, preset: Preset) -> dict[str, Any]:
    return _merged({"tie_word_embeddings": True, **_qwen_token_ids(tokenizer)}, preset.model)


def _qwen2_vl(tokenizer: Any, preset: Preset) -> tuple[Any, Any]:
    from transformers import Qwen2VLConfig, Qwen2VLProcessor, Qwen2VLVideoProcessor

    rope = {"rope_type": "default", "mrope_section": MROPE_SECTION}
    config = Qwen2VLConfig(
        text_config=_merged(_text_config(tokenizer, rope_parameters=rope), preset.text),
        vision_config=_merged(
            {
                "depth": 2,
                "embed_dim": 32,
                "hidden_size": TEXT_DIMS["hidden_size"],
                "num_heads": 2,
                "mlp_ratio": 2,
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
            },
            preset.vision,
        ),
        **_qwen_top(tokenizer, preset),
    )
    image, video = _qwen_processors(14, 56 * 56, 112 * 112, Qwen2VLVideoProcessor, preset.processor)
    processor = Qwen2VLProcessor(image, tokenizer, video, chat_template=QWEN_CHAT_TEMPLATE)
    return config, processor


def _qwen2_5_vl(tokenizer: Any, preset: Preset) -> tuple[Any, Any]:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLProcessor, Qwen2VLVideoProcessor

    rope = {"rope_type": "default", "mrope_section": MROPE_SECTION}
    config = Qwen2_5_VLConfig(
        text_config=_merged(_text_config(tokenizer, rope_parameters=rope), preset.text),
        vision_config=_merged(
            {
                "depth": 2,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_heads": 2,
                "out_hidden_size": TEXT_DIMS["hidden_size"],
                "patch_size": 14,
                "spatial_merge_size": 2,
                "temporal_patch_size": 2,
                "window_size": 56,
                "fullatt_block_indexes": [1],
            },
            preset.vision,
        ),
        **_qwen_top(tokenizer, preset),
    )
    image, video = _qwen_processors(14, 56 * 56, 112 * 112, Qwen2VLVideoProcessor, preset.processor)
    processor = Qwen2_5_VLProcessor(image, tokenizer, video, chat_template=QWEN_CHAT_TEMPLATE)
    return config, processor


def _qwen3_vl(tokenizer: Any, preset: Preset) -> tuple[Any, Any]:
    from transformers import Qwen3VLConfig, Qwen3VLProcessor, Qwen3VLVideoProcessor

    config = Qwen3VLConfig(
        text_config=_merged(_text_config(tokenizer, head_dim=16, rope_parameters=qwen3_rope()), preset.text),
        vision_config=_merged(QWEN3_TINY_VISION, preset.vision),
        **_qwen_top(tokenizer, preset),
    )
    # Patch 16 x merge 2 = 32 px per image token: 64x64 .. 128x128 px gives 4 .. 16 tokens.
    image, video = _qwen_processors(16, 64 * 64, 128 * 128, Qwen3VLVideoProcessor, preset.processor)
    processor = Qwen3VLProcessor(image, tokenizer, video, chat_template=QWEN_CHAT_TEMPLATE)
    return config, processor


INTERNVL_TILE = 56  # px; patch 14 and downsample 0.5 give (56 / 14)^2 / 4 = 4 tokens per tile
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


def _internvl(tokenizer: Any, preset: Preset) -> tuple[Any, Any]:
    from transformers import GotOcr2ImageProcessor, InternVLConfig, InternVLProcessor, InternVLVideoProcessor

    tile_px = preset.processor.get("tile", INTERNVL_TILE)
    image_seq_length = (tile_px // 14) ** 2 // 4
    top = _merged(
        {
            "image_token_id": tokenizer.convert_tokens_to_ids(INTERNVL_EXTRA_TOKENS["context_image_token"]),
            "image_seq_length": image_seq_length,
            "downsample_ratio": 0.5,
            "tie_word_embeddings": True,
        },
        preset.model,
    )
    if top["image_seq_length"] != image_seq_length:
        raise ValueError(f"image_seq_length {top['image_seq_length']} does not match {tile_px}px tiles")
    config = InternVLConfig(
        vision_config=_merged(
            {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "image_size": tile_px,
                "patch_size": 14,
            },
            preset.vision,
        ),
        text_config=_merged({"model_type": "qwen2", **_text_config(tokenizer)}, preset.text),
        **top,
    )
    tile = {"height": tile_px, "width": tile_px}
    # InternVLProcessor passes crop_to_patches=True on every call, overriding the image processor's
    # False: max_patches=1 is what really keeps one tile per image (``--max_anyres_num`` raises it).
    # The real checkpoints ship the same pair with max_patches=12 (448 px tiles).
    image = GotOcr2ImageProcessor(
        size=tile,
        crop_to_patches=False,
        min_patches=1,
        max_patches=preset.processor.get("max_patches", 1),
        image_mean=IMAGENET_MEAN,
        image_std=IMAGENET_STD,
    )
    video = InternVLVideoProcessor(size=tile, image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD)
    processor = InternVLProcessor(
        image, tokenizer, video, image_seq_length=image_seq_length, chat_template=INTERNVL_CHAT_TEMPLATE
    )
    return config, processor


_QWEN_SPECIALS = COMMON_SPECIAL_TOKENS + QWEN_SPECIAL_TOKENS
_INTERNVL_SPECIALS = COMMON_SPECIAL_TOKENS + tuple(INTERNVL_EXTRA_TOKENS.values())
_SPECS: dict[str, TinyFamily] = {
    "qwen2_vl": TinyFamily(_qwen2_vl, QWEN_CHAT_TEMPLATE, _QWEN_SPECIALS),
    "qwen2_5_vl": TinyFamily(_qwen2_5_vl, QWEN_CHAT_TEMPLATE, _QWEN_SPECIALS),
    "qwen3_vl": TinyFamily(_qwen3_vl, QWEN_CHAT_TEMPLATE, _QWEN_SPECIALS),
    "internvl": TinyFamily(_internvl, INTERNVL_CHAT_TEMPLATE, _INTERNVL_SPECIALS, INTERNVL_EXTRA_TOKENS),
}
#: Families built by their own file: ``family -> "module"`` whose ``SPEC`` is the family's :class:`TinyFamily`.
TINY_FAMILY_FILES: dict[str, str] = {
    "glm4v": "vlm_grpo.testing.tiny_glm4v",
    "glm4v_moe": "vlm_grpo.testing.tiny_glm4v_moe",
    "qwen3_vl_moe": "vlm_grpo.testing.tiny_qwen3_vl_moe",
    "gemma3": "vlm_grpo.testing.tiny_gemma3",
    "mistral3": "vlm_grpo.testing.tiny_mistral3",
    "llava_onevision": "vlm_grpo.testing.tiny_llava_onevision",
    "idefics3": "vlm_grpo.testing.tiny_idefics3",
    "smolvlm": "vlm_grpo.testing.tiny_smolvlm",
}


def family_spec(family: str) -> TinyFamily:
    """The tiny-build spec of ``family`` (its own file is imported on first use)."""
    _check_family(family)
    if family not in _SPECS:
        import importlib

        _SPECS[family] = importlib.import_module(TINY_FAMILY_FILES[family]).SPEC
    return _SPECS[family]


def _check_family(family: str) -> None:
    if family not in TINY_FAMILIES:
        raise ValueError(f"Unknown tiny-model family '{family}'. Available: {', '.join(TINY_FAMILIES)}")


def _set_generation_config(model: Any, tokenizer: Any, preset: Preset) -> None:
    gen = model.generation_config
    ids = tokenizer.convert_tokens_to_ids
    if not preset.generation:  # tiny: single ids
        spec = family_spec(preset.family)
        gen.eos_token_id = ids(spec.eos)
        gen.pad_token_id = ids(spec.pad)
        gen.bos_token_id = ids(spec.bos)
        return
    settings = dict(preset.generation)
    eos = [ids(t) for t in settings.pop("eos")]
    gen.eos_token_id = eos[0] if len(eos) == 1 else eos
    gen.pad_token_id = ids(settings.pop("pad"))
    gen.bos_token_id = ids(settings.pop("bos"))
    for key, value in settings.items():
        setattr(gen, key, value)


# ----------------------------------------------------------------------------- public API
def build_config(preset: str | Preset) -> tuple[Any, Any]:
    """``(config, processor)`` of a preset, without weights (cheap: a meta-device model can be made).

    ``config.text_config.vocab_size == len(processor.tokenizer)`` for every preset.
    """
    p = get_preset(preset) if isinstance(preset, str) else preset
    tokenizer = build_tokenizer(p.family, vocab_size=p.vocab_size)
    config, processor = family_spec(p.family).build(tokenizer, p)
    vocab = config.get_text_config().vocab_size
    if vocab != len(tokenizer):
        raise ValueError(f"config vocab_size {vocab} != tokenizer size {len(tokenizer)}")
    return config, processor


def num_parameters(model: Any) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in model.parameters())


def build_model(
    preset: str | Preset,
    out_dir: str | Path | None = None,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> tuple[Any, Any]:
    """Build a randomly initialised model of ``preset`` in memory on ``device``; return (model, processor).

    Weights are initialised directly on ``device`` (fast on a GPU), in ``dtype`` (default
    ``torch.bfloat16``), from ``seed`` on a forked RNG (the caller's CPU and CUDA streams are left
    alone). With ``out_dir`` the checkpoint (model, processor, tokenizer, generation config) is also
    saved there, loadable by ``AutoModelForImageTextToText`` / ``AutoProcessor`` like a hub model.
    See :data:`PRESETS` for the names; ``tiny_<family>`` with ``dtype=torch.float32`` on the CPU
    is exactly :func:`build_tiny_model`.
    """
    import torch
    from transformers import AutoModelForImageTextToText

    p = get_preset(preset) if isinstance(preset, str) else preset
    config, processor = build_config(p)
    device = torch.device(device)
    rng_devices: list[int] = []
    if device.type == "cuda":
        rng_devices = [device.index if device.index is not None else torch.cuda.current_device()]
    # Seed a private generator state: don't disturb the caller's RNG stream.
    with torch.random.fork_rng(devices=rng_devices), device:
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype or torch.bfloat16)
        init_weights = family_spec(p.family).init_weights
        if init_weights is not None:
            init_weights(model)
    _set_generation_config(model, processor.tokenizer, p)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        processor.save_pretrained(out)
        saved = family_spec(p.family).saved
        if saved is not None:
            saved(out)
    return model, processor


def build_tiny_model(family: str, out_dir: str | Path, seed: int = 0, init_std: float | None = None) -> Path:
    """Write a tiny random checkpoint of ``family`` (model, processor, tokenizer) into ``out_dir``.

    The same ``family``, ``seed`` and ``init_std`` always give the same weights and the same tokenizer.
    ``init_std``: the language model's init std (default 0.02: near-uniform attention, where a position off by one
    barely moves the logits; 0.15 makes it show, as the generation parity tests need). Returns ``out_dir``.
    """
    import dataclasses

    import torch

    _check_family(family)
    preset = PRESETS[f"tiny_{family}"]
    if init_std is not None:
        preset = dataclasses.replace(preset, text={**preset.text, "initializer_range": init_std})
    build_model(preset, out_dir, seed=seed, dtype=torch.float32, device="cpu")
    return Path(out_dir)


def main(argv: list[str] | None = None) -> None:
    import torch

    parser = argparse.ArgumentParser(
        prog="python -m vlm_grpo.testing.tiny",
        description="Build randomly initialised VLM checkpoints offline: tiny ones (tests, smoke runs) "
        "or real-size presets (timing the trainer at real model size).",
    )
    parser.add_argument(
        "--preset",
        choices=["tiny", *PRESETS],
        help="model preset (default tiny, which needs --family); real ones: "
        + ", ".join(f"{name} ({p.reference})" for name, p in PRESETS.items() if not p.is_tiny),
    )
    parser.add_argument(
        "--family",
        choices=[*TINY_FAMILIES, "all"],
        help="tiny checkpoints: model family (config.json model_type), or all",
    )
    parser.add_argument("--out", required=True, help="output folder; with --family all, one sub-folder per family")
    parser.add_argument("--seed", type=int, default=0, help="weight-initialisation seed (default 0)")
    parser.add_argument("--device", default="cpu", help="device to initialise the weights on (default cpu; cuda)")
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        help="weight dtype (default bfloat16 for real presets, float32 for tiny)",
    )
    args = parser.parse_args(argv)
    preset = args.preset or "tiny"
    if preset == "tiny" and args.family is None:
        parser.error("tiny checkpoints need --family (or pick a real --preset)")
    if preset != "tiny" and args.family is not None:
        parser.error("--family only applies to tiny checkpoints (--preset tiny)")

    jobs: list[tuple[str, Path]]
    if preset == "tiny":
        families = TINY_FAMILIES if args.family == "all" else (args.family,)
        jobs = [(f"tiny_{f}", Path(args.out) / f if args.family == "all" else Path(args.out)) for f in families]
    else:
        jobs = [(preset, Path(args.out))]
    for name, out in jobs:
        default = torch.float32 if PRESETS[name].is_tiny else torch.bfloat16
        dtype = getattr(torch, args.dtype) if args.dtype else default
        model, _ = build_model(name, out, seed=args.seed, dtype=dtype, device=args.device)
        n = num_parameters(model)
        size = f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
        print(f"{out}  ({name}: {n:,} parameters = {size}, {dtype}, built on {args.device})")
        del model


if __name__ == "__main__":
    main()
