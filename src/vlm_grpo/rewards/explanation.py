"""Explanation reward (ViVQA-X): CIDEr of the ``<explain>`` text against the reference explanations, optionally
mixed with a CLIP image-text score.

CIDEr is pycocoevalcap's CIDEr-D (n-grams 1..4, sigma 6, clipped tf-idf cosine, Gaussian length penalty, ×10; no
Java: texts are tokenised by our own normalisation instead of the PTB tokenizer). Its idf needs a corpus of
reference documents. pycocoevalcap takes it from the texts scored together, which inside a GRPO batch is mostly
the same prompt repeated ``num_generations`` times (every n-gram then gets idf 0 and CIDEr 0 when the batch holds
one prompt). The default ``idf="running"`` therefore uses the distinct reference sets this process has scored so
far (the current batch included) plus one empty pseudo-document, so idf = ``log((N + 1) / df)`` is never 0 for
all n-grams; ``idf="batch"`` calls pycocoevalcap's ``Cider`` on the batch exactly as the library does.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections import Counter
from collections.abc import Sequence
from typing import Any

from vlm_grpo.rewards.accuracy import normalize_text
from vlm_grpo.rewards.base import completion_text
from vlm_grpo.rewards.format import extract_tag

logger = logging.getLogger(__name__)

CIDER_N = 4
CIDER_SIGMA = 6.0
# Explanations are cut to this many characters / words before scoring (one sentence is expected).
EXPLAIN_MAX_CHARS = 5_000
EXPLAIN_MAX_WORDS = 200
# References read from one solution.
MAX_REFERENCES = 20
# The running idf corpus stops growing at this many distinct reference sets.
MAX_CORPUS_DOCS = 100_000

_EXPLAIN_BLOCK = re.compile(r"<explain\s*>(.*?)</explain\s*>", re.IGNORECASE | re.DOTALL)


def cider_tokens(text: str) -> str:
    """The text CIDEr sees: :func:`~vlm_grpo.rewards.accuracy.normalize_text` (NFKC, case-folded, punctuation
    outside words dropped, whitespace collapsed), at most 200 words."""
    return " ".join(normalize_text(text[:EXPLAIN_MAX_CHARS]).split()[:EXPLAIN_MAX_WORDS])


def reference_explanations(solution: Any) -> list[str]:
    """Every non-empty ``<explain>…</explain>`` of the solution (several blocks = several references), tokenised
    by :func:`cider_tokens`; at most 20."""
    if solution is None:
        return []
    text = solution if isinstance(solution, str) else str(solution)
    refs = []
    for match in _EXPLAIN_BLOCK.finditer(text):
        tokens = cider_tokens(match.group(1))
        if tokens:
            refs.append(tokens)
            if len(refs) >= MAX_REFERENCES:
                break
    return refs


def _precook(text: str, n: int = CIDER_N) -> Counter:
    from pycocoevalcap.cider.cider_scorer import precook

    return Counter(precook(text, n))


def cider_d(
    hypothesis: str,
    references: Sequence[str],
    document_frequency: dict[tuple[str, ...], float],
    log_num_docs: float,
    n: int = CIDER_N,
    sigma: float = CIDER_SIGMA,
) -> float:
    """CIDEr-D of one tokenised hypothesis against its tokenised references, with the idf given by
    ``document_frequency`` (n-gram -> number of documents) and ``log_num_docs`` (log of the corpus size); the
    arithmetic of ``pycocoevalcap.cider.cider_scorer.CiderScorer.compute_cider``. In [0, 10] (0 without
    references)."""
    if not references:
        return 0.0

    def vectorise(counts: Counter) -> tuple[list[dict], list[float], int]:
        vec: list[dict] = [{} for _ in range(n)]
        norm = [0.0] * n
        length = 0
        for ngram, tf in counts.items():
            k = len(ngram) - 1
            weight = float(tf) * (log_num_docs - math.log(max(1.0, document_frequency.get(ngram, 0.0))))
            vec[k][ngram] = weight
            norm[k] += weight * weight
            if k == 1:  # pycocoevalcap counts the length in bigrams
                length += tf
        return vec, [math.sqrt(v) for v in norm], length

    vec_h, norm_h, len_h = vectorise(_precook(hypothesis, n))
    total = [0.0] * n
    for ref in references:
        vec_r, norm_r, len_r = vectorise(_precook(ref, n))
        penalty = math.exp(-((len_h - len_r) ** 2) / (2 * sigma**2))
        for k in range(n):
            val = sum(min(w, vec_r[k].get(g, 0.0)) * vec_r[k].get(g, 0.0) for g, w in vec_h[k].items())
            if norm_h[k] != 0 and norm_r[k] != 0:
                val /= norm_h[k] * norm_r[k]
            total[k] += val * penalty
    return 10.0 * (sum(total) / n) / len(references)


class RunningCiderCorpus:
    """Document frequencies over the distinct reference sets seen so far (one document per set), thread-safe."""

    def __init__(self, max_docs: int = MAX_CORPUS_DOCS) -> None:
        self.max_docs = max_docs
        self.document_frequency: Counter = Counter()
        self._docs: set[tuple[str, ...]] = set()
        self._lock = threading.Lock()

    @property
    def num_docs(self) -> int:
        return len(self._docs)

    def add(self, references: Sequence[str]) -> None:
        key = tuple(sorted(references))
        with self._lock:
            if not key or key in self._docs or len(self._docs) >= self.max_docs:
                return
            self._docs.add(key)
            ngrams = set()
            for ref in references:
                ngrams.update(_precook(ref))
            self.document_frequency.update(ngrams)

    def score(self, hypothesis: str, references: Sequence[str]) -> float:
        """CIDEr-D with idf ``log((N + 1) / df)``: N documents plus one empty pseudo-document."""
        with self._lock:
            log_n = math.log(len(self._docs) + 1.0)
            return cider_d(hypothesis, references, self.document_frequency, log_n)


CIDER_CORPUS = RunningCiderCorpus()


def batch_cider(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> list[float]:
    """pycocoevalcap's ``Cider().compute_score`` over the batch (idf from the batch's own references)."""
    from pycocoevalcap.cider.cider import Cider

    gts = {i: list(refs) for i, refs in enumerate(references)}
    res = {i: [hyp] for i, hyp in enumerate(hypotheses)}
    if not gts:
        return []
    _, scores = Cider().compute_score(gts, res)
    return [float(s) for s in scores]


# --------------------------------------------------------------------------------------------- CLIP

_CLIP_CACHE: dict[tuple[str, str], tuple[Any, Any]] = {}
_CLIP_LOCK = threading.Lock()
_NO_CLIP_WARNED = False


def _default_device() -> str:
    import os

    import torch

    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"


def load_clip(path: str, device: str | None = None) -> tuple[Any, Any]:
    """``(CLIPModel, CLIPProcessor)`` from ``path``, loaded once per process and device, in eval mode."""
    device = device or _default_device()
    key = (str(path), device)
    with _CLIP_LOCK:
        if key not in _CLIP_CACHE:
            from transformers import CLIPModel, CLIPProcessor

            model = CLIPModel.from_pretrained(path).to(device).eval()
            processor = CLIPProcessor.from_pretrained(path)
            _CLIP_CACHE[key] = (model, processor)
            logger.info("explanation reward: loaded CLIP from %s on %s", path, device)
        return _CLIP_CACHE[key]


def clip_similarity(texts: Sequence[str], images: Sequence[Any], path: str, device: str | None = None) -> list[float]:
    """CLIP-S (Hessel et al., 2021) of each (text, image) pair: ``2.5 · max(cos(text, image), 0)`` clipped to
    [0, 1], with the checkpoint at ``path``. Images are PIL images."""
    if not texts:
        return []
    import torch

    model, processor = load_clip(path, device)
    max_len = int(getattr(getattr(model.config, "text_config", None), "max_position_embeddings", 77) or 77)
    inputs = processor(
        text=list(texts),
        images=list(images),
        return_tensors="pt",
        padding=True,
        truncation=True,
        max_length=max_len,
    )
    inputs = {k: v.to(model.device) if hasattr(v, "to") else v for k, v in inputs.items()}
    with torch.inference_mode():
        text_features = model.get_text_features(
            input_ids=inputs["input_ids"], attention_mask=inputs.get("attention_mask")
        )
        image_features = model.get_image_features(pixel_values=inputs["pixel_values"])
    text_features = getattr(text_features, "pooler_output", text_features)
    image_features = getattr(image_features, "pooler_output", image_features)
    text_features = torch.nn.functional.normalize(text_features.float(), dim=-1)
    image_features = torch.nn.functional.normalize(image_features.float(), dim=-1)
    cosine = (text_features * image_features).sum(-1).clamp(min=0.0)
    scores = (2.5 * cosine).clamp(max=1.0).nan_to_num(0.0)
    return [float(v) for v in scores.cpu()]


def _row_image(images: Any, image_path: Any) -> Any:
    """The first image of a row: the decoded ``images`` entry, else the first ``image_path`` opened as RGB."""
    if isinstance(images, (list, tuple)) and images and images[0] is not None and hasattr(images[0], "convert"):
        return images[0].convert("RGB")
    if isinstance(image_path, (list, tuple)) and image_path and isinstance(image_path[0], str):
        from vlm_grpo.data.jsonl import open_image

        with open_image(image_path[0]) as image:
            return image.convert("RGB")
    return None


def explanation_reward(
    completions: Sequence[Any],
    solution: Sequence[Any] | None = None,
    clip_model: str | None = None,
    clip_weight: float = 0.5,
    clip_device: str | None = None,
    idf: str = "running",
    **kwargs: Any,
) -> list[float | None]:
    """Explanation reward: CIDEr-D of the completion's last ``<explain>…</explain>`` against every ``<explain>``
    block of the solution (the references), divided by 10 and clipped to [0, 1]. Range [0.0, 1.0].

    With ``clip_model`` (a CLIP checkpoint path: ``--reward_kwargs '{"explanation": {"clip_model": PATH}}'``; loaded
    once per process): ``(1 − clip_weight) · CIDEr/10 + clip_weight · CLIP-S``, CLIP-S = ``min(1, 2.5 · max(cos, 0))``
    between the explanation and the row's first image (``clip_weight`` 0.5 by default; rows without an image get the
    CIDEr term only). Without ``clip_model`` the CLIP term is skipped (logged once). Texts are tokenised by
    normalisation (NFKC, case-folded, punctuation outside words dropped), at most 200 words. ``idf``: ``running``
    (default; distinct reference sets seen so far in this process + one empty pseudo-document) or ``batch``
    (pycocoevalcap's ``Cider`` on the batch as is) — see the module docstring.

    0.0 when the completion has no complete ``<explain>`` block or it is empty. ``None`` for rows whose solution has
    no ``<explain>`` reference. Raises ``ValueError`` without a ``solution`` column or with bad parameters.
    """
    global _NO_CLIP_WARNED
    if solution is None:
        raise ValueError("The explanation reward needs a 'solution' column")
    n = len(completions)
    if len(solution) != n:
        raise ValueError(f"Got {n} completions but {len(solution)} solutions")
    clip_weight = float(clip_weight)
    if not 0.0 <= clip_weight <= 1.0:
        raise ValueError(f"clip_weight must be in [0, 1], got {clip_weight}")
    if idf not in ("running", "batch"):
        raise ValueError(f"idf must be 'running' or 'batch', got {idf!r}")
    if clip_model is None and not _NO_CLIP_WARNED:
        _NO_CLIP_WARNED = True
        logger.warning(
            "explanation reward: no CLIP checkpoint given, so the CLIP term is skipped and the reward is CIDEr only "
            '(add it with --reward_kwargs \'{"explanation": {"clip_model": "/path/to/clip"}}\')'
        )

    references = [reference_explanations(sol) for sol in solution]
    hypotheses = []
    for completion in completions:
        content = extract_tag(completion_text(completion)[-200_000:], "explain")
        hypotheses.append(cider_tokens(content) if content is not None else "")

    if idf == "running":
        for refs in references:
            if refs:
                CIDER_CORPUS.add(refs)
        cider = [CIDER_CORPUS.score(h, r) if (h and r) else 0.0 for h, r in zip(hypotheses, references, strict=True)]
    else:
        scored = [i for i in range(n) if references[i]]
        values = batch_cider([hypotheses[i] for i in scored], [references[i] for i in scored])
        cider = [0.0] * n
        for i, value in zip(scored, values, strict=True):
            cider[i] = value if hypotheses[i] else 0.0

    rewards: list[float | None] = [
        min(1.0, max(0.0, c / 10.0)) if refs else None for c, refs in zip(cider, references, strict=True)
    ]
    if clip_model is None or clip_weight == 0.0:
        return rewards
    load_clip(clip_model, clip_device)  # once per process; a bad path fails on the first batch, not silently

    images_col = kwargs.get("images") or [None] * n
    paths_col = kwargs.get("image_path") or [None] * n
    rows, texts, images = [], [], []
    for i in range(n):
        if rewards[i] is None:
            continue
        if not hypotheses[i]:
            continue  # no explanation: 0.0 already
        image = _row_image(images_col[i], paths_col[i])
        if image is None:
            continue
        rows.append(i)
        texts.append(hypotheses[i])
        images.append(image)
    scores = clip_similarity(texts, images, clip_model, clip_device) if rows else []
    for i, score in zip(rows, scores, strict=True):
        rewards[i] = (1.0 - clip_weight) * rewards[i] + clip_weight * score  # type: ignore[operator]
    return rewards


explanation_reward.value_range = (0.0, 1.0)  # type: ignore[attr-defined]
explanation_reward.requires = {"pycocoevalcap": "cider"}  # type: ignore[attr-defined]

__all__ = [
    "CIDER_CORPUS",
    "RunningCiderCorpus",
    "batch_cider",
    "cider_d",
    "cider_tokens",
    "clip_similarity",
    "explanation_reward",
    "load_clip",
    "reference_explanations",
]
