"""Offline builder of tiny, randomly initialised VLM checkpoints, one per supported family.

Tests and smoke runs need real checkpoints (``config.json`` + weights + processor) that load through
``AutoProcessor`` / ``AutoModelForImageTextToText`` exactly like hub models, but the machines that run
them have no hub access. This module builds such checkpoints from scratch in a few seconds:

* a byte-level BPE tokenizer (Qwen2's pre-tokenizer: digits split one by one) trained with
  ``tokenizers`` on a built-in corpus, with the family's special tokens and a chat template that
  carries ``{% generation %}`` markers for ``return_assistant_tokens_mask``;
* the family's image and video processors with small default limits (few image tokens);
* a 2-layer, 64-wide language model and a 2-block vision tower, seeded, so the same seed gives the
  same weights.

Nothing is cached on disk outside ``out_dir``. Usage::

    python -m vlm_grpo.testing.tiny --family qwen2_5_vl --out /tmp/tiny-qwen2_5_vl
    python -m vlm_grpo.testing.tiny --family all --out /tmp/tiny   # one sub-folder per family
"""

from __future__ import annotations

import argparse
import functools
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

FAMILIES: tuple[str, ...] = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "internvl")

VOCAB_SIZE = 1536  # target for BPE training; the reached size is reported by ``len(tokenizer)``

# Qwen2's split regex: contractions, letter runs, single digits, punctuation runs, newlines, spaces.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

COMMON_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_SPECIAL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# InternVL's processor reads these four as tokenizer attributes (``extra_special_tokens``).
INTERNVL_EXTRA_TOKENS = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": "<IMG_CONTEXT>",
    "video_token": "<video>",
}

# ----------------------------------------------------------------------------- chat templates
# One renderer for string or list content; list items are emitted in order. Assistant turns are
# wrapped in {% generation %} (with their <|im_end|>) so SFT can ask for the assistant-token mask.
_CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for item in content -%}"
    "{%- if item.type == 'image' or 'image' in item or 'image_url' in item -%}{{- IMAGE -}}"
    "{%- elif item.type == 'video' or 'video' in item -%}{{- VIDEO -}}"
    "{%- elif 'text' in item -%}{{- item['text'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- generation -%}{{- render(message['content']) + '<|im_end|>' -}}{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- render(message['content']) + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
QWEN_CHAT_TEMPLATE = _CHAT_TEMPLATE.replace("IMAGE", "'<|vision_start|><|image_pad|><|vision_end|>'").replace(
    "VIDEO", "'<|vision_start|><|video_pad|><|vision_end|>'"
)
# Like InternVL3-hf's template: a newline follows each placeholder; the processor expands
# <IMG_CONTEXT> into <img> + image_seq_length * tiles * <IMG_CONTEXT> + </img>.
INTERNVL_CHAT_TEMPLATE = _CHAT_TEMPLATE.replace("IMAGE", "'<IMG_CONTEXT>\\n'").replace("VIDEO", "'<video>\\n'")

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


def build_tokenizer(family: str) -> Any:
    """A ``PreTrainedTokenizerFast`` with the family's special tokens and chat template."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    _check_family(family)
    tok = Tokenizer.from_str(_trained_bpe_json())
    specials = COMMON_SPECIAL_TOKENS + QWEN_SPECIAL_TOKENS
    extra: dict[str, str] = {}
    if family == "internvl":
        specials = COMMON_SPECIAL_TOKENS + list(INTERNVL_EXTRA_TOKENS.values())
        extra = dict(INTERNVL_EXTRA_TOKENS)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    template = INTERNVL_CHAT_TEMPLATE if family == "internvl" else QWEN_CHAT_TEMPLATE
    kwargs: dict[str, Any] = {"extra_special_tokens": extra} if extra else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        chat_template=template,
        model_max_length=32768,
        **kwargs,
    )


# ----------------------------------------------------------------------------- per-family parts
TEXT_DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
MROPE_SECTION = [2, 3, 3]  # sums to head_dim / 2 = 64 / 4 / 2


def _qwen_token_ids(tokenizer: Any) -> dict[str, int]:
    ids = tokenizer.convert_tokens_to_ids
    return {
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
    }


def _text_config(tokenizer: Any, **extra: Any) -> dict[str, Any]:
    return {
        **TEXT_DIMS,
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "pad_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        **extra,
    }


def _qwen_processors(patch_size: int, min_pixels: int, max_pixels: int, video_cls: Any) -> tuple[Any, Any]:
    from transformers import Qwen2VLImageProcessor

    size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}
    common = {"patch_size": patch_size, "temporal_patch_size": 2, "merge_size": 2, "size": size}
    return Qwen2VLImageProcessor(**common), video_cls(**common)


def _qwen2_vl(tokenizer: Any) -> tuple[Any, Any]:
    from transformers import Qwen2VLConfig, Qwen2VLProcessor, Qwen2VLVideoProcessor

    config = Qwen2VLConfig(
        text_config=_text_config(tokenizer, rope_parameters={"rope_type": "default", "mrope_section": MROPE_SECTION}),
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": TEXT_DIMS["hidden_size"],
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        tie_word_embeddings=True,
        **_qwen_token_ids(tokenizer),
    )
    image, video = _qwen_processors(14, 56 * 56, 112 * 112, Qwen2VLVideoProcessor)
    processor = Qwen2VLProcessor(image, tokenizer, video, chat_template=QWEN_CHAT_TEMPLATE)
    return config, processor


def _qwen2_5_vl(tokenizer: Any) -> tuple[Any, Any]:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLProcessor, Qwen2VLVideoProcessor

    config = Qwen2_5_VLConfig(
        text_config=_text_config(tokenizer, rope_parameters={"rope_type": "default", "mrope_section": MROPE_SECTION}),
        vision_config={
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
        tie_word_embeddings=True,
        **_qwen_token_ids(tokenizer),
    )
    image, video = _qwen_processors(14, 56 * 56, 112 * 112, Qwen2VLVideoProcessor)
    processor = Qwen2_5_VLProcessor(image, tokenizer, video, chat_template=QWEN_CHAT_TEMPLATE)
    return config, processor


def _qwen3_vl(tokenizer: Any) -> tuple[Any, Any]:
    from transformers import Qwen3VLConfig, Qwen3VLProcessor, Qwen3VLVideoProcessor

    rope = {"rope_type": "default", "mrope_section": MROPE_SECTION, "mrope_interleaved": True, "rope_theta": 5e6}
    config = Qwen3VLConfig(
        text_config=_text_config(tokenizer, head_dim=16, rope_parameters=rope),
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": TEXT_DIMS["hidden_size"],
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,  # an 8x8 grid, interpolated to the image's grid
            "deepstack_visual_indexes": [0],
        },
        tie_word_embeddings=True,
        **_qwen_token_ids(tokenizer),
    )
    # Patch 16 x merge 2 = 32 px per image token: 64x64 .. 128x128 px gives 4 .. 16 tokens.
    image, video = _qwen_processors(16, 64 * 64, 128 * 128, Qwen3VLVideoProcessor)
    processor = Qwen3VLProcessor(image, tokenizer, video, chat_template=QWEN_CHAT_TEMPLATE)
    return config, processor


INTERNVL_TILE = 56  # px; patch 14 and downsample 0.5 give (56 / 14)^2 / 4 = 4 tokens per tile
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


def _internvl(tokenizer: Any) -> tuple[Any, Any]:
    from transformers import GotOcr2ImageProcessor, InternVLConfig, InternVLProcessor, InternVLVideoProcessor

    image_seq_length = (INTERNVL_TILE // 14) ** 2 // 4
    config = InternVLConfig(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": INTERNVL_TILE,
            "patch_size": 14,
        },
        text_config={"model_type": "qwen2", **_text_config(tokenizer)},
        image_token_id=tokenizer.convert_tokens_to_ids(INTERNVL_EXTRA_TOKENS["context_image_token"]),
        image_seq_length=image_seq_length,
        downsample_ratio=0.5,
        tie_word_embeddings=True,
    )
    tile = {"height": INTERNVL_TILE, "width": INTERNVL_TILE}
    # InternVLProcessor passes crop_to_patches=True on every call, overriding the image processor's
    # False: max_patches=1 is what really keeps one tile per image (``--max_anyres_num`` raises it).
    image = GotOcr2ImageProcessor(
        size=tile, crop_to_patches=False, min_patches=1, max_patches=1, image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD
    )
    video = InternVLVideoProcessor(size=tile, image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD)
    processor = InternVLProcessor(
        image, tokenizer, video, image_seq_length=image_seq_length, chat_template=INTERNVL_CHAT_TEMPLATE
    )
    return config, processor


_BUILDERS: dict[str, Callable[[Any], tuple[Any, Any]]] = {
    "qwen2_vl": _qwen2_vl,
    "qwen2_5_vl": _qwen2_5_vl,
    "qwen3_vl": _qwen3_vl,
    "internvl": _internvl,
}


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"Unknown tiny-model family '{family}'. Available: {', '.join(FAMILIES)}")


# ----------------------------------------------------------------------------- public API
def build_tiny_model(family: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny random checkpoint of ``family`` (model, processor, tokenizer) into ``out_dir``.

    The same ``family`` and ``seed`` always give the same weights and the same tokenizer.
    Returns ``out_dir`` as a :class:`~pathlib.Path`.
    """
    import torch
    from transformers import AutoModelForImageTextToText

    _check_family(family)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(family)
    config, processor = _BUILDERS[family](tokenizer)

    # Seed a private generator state: don't disturb the caller's RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.generation_config.pad_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model.generation_config.bos_token_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m vlm_grpo.testing.tiny",
        description="Build tiny randomly initialised VLM checkpoints offline (for tests and smoke runs).",
    )
    parser.add_argument(
        "--family", required=True, choices=[*FAMILIES, "all"], help="model family (config.json model_type), or all"
    )
    parser.add_argument("--out", required=True, help="output folder; with --family all, one sub-folder per family")
    parser.add_argument("--seed", type=int, default=0, help="weight-initialisation seed (default 0)")
    args = parser.parse_args(argv)
    families = FAMILIES if args.family == "all" else (args.family,)
    for family in families:
        out = Path(args.out) / family if args.family == "all" else Path(args.out)
        print(build_tiny_model(family, out, seed=args.seed))


if __name__ == "__main__":
    main()
