"""VQA-X-style JSON (question, answer(s), explanation(s), image id/name) -> VLM-R1 GRPO rows.

Input: a JSON list of items, or a JSON object mapping question ids to items (the VQA-X layout), e.g.::

    {"262148000": {"question": "Where is this?", "answers": [{"answer": "beach", ...}, ...],
                   "explanation": ["there is sand and water", ...], "image_id": 262148,
                   "image_name": "COCO_val2014_000000262148.jpg"}}

Each item becomes one row whose human turn is the prompt template filled with the question (``<image>``
where the template puts it, at the front when it has none) and whose solution is
``<answer>{answer}</answer><explain>{e1}</explain><explain>{e2}</explain>...``: every gold explanation is kept,
as one reference each for the ``explanation`` reward's CIDEr (``--explanation first|join|each`` for one per row).
Solutions are written once and never re-wrapped: an item that already carries a ``solution`` keeps it verbatim.
Rows get ``task_type: raw`` by default, so the prompt's own instructions are the whole prompt: the ``vqa``
template would append a think/answer instruction that contradicts ``<explain>``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlm_grpo.data.formats import IMAGE_TOKEN, RowError
from vlm_grpo.data.records import iter_records, vlm_r1_row, write_rows

DEFAULT_PROMPT = (
    "<image>You are a Visual Question Answering system. Answer the question based on the content of the image. "
    "Your response must include the tags <think> </think>, <answer> </answer> and <explain> </explain>.\n"
    "1. In the <think> tag, reason step by step.\n"
    "2. In the <answer> tag, give one word or one short phrase.\n"
    "3. In the <explain> tag, give one brief sentence that justifies your answer.\n"
    "Question: {question}"
)
EXPLANATION_MODES = ("all", "first", "join", "each")


@dataclass
class ConvertResult:
    rows: list[dict] = field(default_factory=list)
    bad: list[tuple[str, str]] = field(default_factory=list)
    path: Path | None = None


def _answer(item: dict) -> str:
    answer = item.get("answer")
    if isinstance(answer, (str, int, float)) and not isinstance(answer, bool):
        return str(answer).strip()
    answers = item.get("answers", item.get("multiple_choice_answer"))
    if isinstance(answers, str):
        return answers.strip()
    if isinstance(answers, list) and answers:
        texts = [str(a.get("answer", "") if isinstance(a, dict) else a).strip() for a in answers]
        texts = [t for t in texts if t]
        if texts:
            # the most frequent answer; ties go to the first given
            counts = Counter(texts)
            return max(texts, key=lambda t: (counts[t], -texts.index(t)))
    raise RowError("answer", "no 'answer' (or 'answers') in the item")


def _explanations(item: dict) -> list[str]:
    value = item.get("explanation", item.get("explanations"))
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not [v for v in value if isinstance(v, str) and v.strip()]:
        raise RowError("explanation", "no 'explanation' (a string or a list of strings) in the item")
    return [v.strip() for v in value if isinstance(v, str) and v.strip()]


def _image(item: dict, image_template: str | None) -> str:
    name = item.get("image_name", item.get("image"))
    if isinstance(name, str) and name:
        return name
    image_id = item.get("image_id")
    if image_id is None:
        raise RowError("image", "no 'image_name' / 'image' / 'image_id' in the item")
    if image_template is None:
        raise RowError("image", "the item has only an 'image_id': pass --image_template, e.g. '{image_id:012d}.jpg'")
    try:
        return image_template.format(image_id=int(image_id) if str(image_id).isdigit() else image_id)
    except (KeyError, ValueError) as exc:
        raise RowError(
            "image", f"--image_template {image_template!r} does not fit image_id {image_id!r}: {exc}"
        ) from None


def fill_prompt(template: str, question: str) -> str:
    if "{question}" not in template:
        raise ValueError("the prompt template needs a '{question}' placeholder")
    text = template.replace("{question}", question)
    return text if IMAGE_TOKEN in template else IMAGE_TOKEN + text


def convert_item(
    item: Any,
    index: int,
    *,
    prompt_template: str = DEFAULT_PROMPT,
    system_prompt: str | None = None,
    explanation_mode: str = "all",
    image_template: str | None = None,
    task_type: str | None = "raw",
    accu_reward_method: str | None = None,
) -> list[dict]:
    if not isinstance(item, dict):
        raise RowError("<row>", f"an item must be a JSON object, got {type(item).__name__}")
    question = item.get("question")
    if not isinstance(question, str) or not question.strip():
        raise RowError("question", "no 'question' in the item")
    image = _image(item, image_template)
    prompt = fill_prompt(prompt_template, question.strip())
    row_id = item.get("id", item.get("question_id", index + 1))
    common = {"system": system_prompt, "task_type": task_type, "accu_reward_method": accu_reward_method}
    if isinstance(item.get("solution"), str):  # pre-formatted: verbatim
        return [vlm_r1_row(prompt, item["solution"], image, row_id=row_id, **common)]
    answer = _answer(item)
    explanations = _explanations(item)
    if explanation_mode == "all":  # one row, every explanation a reference
        explained = "".join(f"<explain>{e}</explain>" for e in explanations)
        return [vlm_r1_row(prompt, f"<answer>{answer}</answer>{explained}", image, row_id=row_id, **common)]
    if explanation_mode == "first":
        explanations = explanations[:1]
    elif explanation_mode == "join":
        explanations = [" ".join(explanations)]
    elif explanation_mode != "each":
        raise ValueError(f"--explanation must be one of {EXPLANATION_MODES}, got {explanation_mode!r}")
    rows = []
    for k, explanation in enumerate(explanations):
        rid = row_id if len(explanations) == 1 else f"{row_id}-{k}"
        solution = f"<answer>{answer}</answer><explain>{explanation}</explain>"
        rows.append(vlm_r1_row(prompt, solution, image, row_id=rid, **common))
    return rows


def convert_vqa(
    input_path: str | Path,
    output_path: str | Path | None,
    *,
    prompt_template: str = DEFAULT_PROMPT,
    system_prompt: str | None = None,
    explanation_mode: str = "all",
    image_template: str | None = None,
    task_type: str | None = "raw",
    accu_reward_method: str | None = None,
    skip_bad_rows: bool = False,
    overwrite: bool = False,
) -> ConvertResult:
    result = ConvertResult()
    for index, record in enumerate(iter_records(input_path)):
        if record.error:
            result.bad.append((record.source, record.error))
            continue
        try:
            result.rows += convert_item(
                record.value,
                index,
                prompt_template=prompt_template,
                system_prompt=system_prompt,
                explanation_mode=explanation_mode,
                image_template=image_template,
                task_type=task_type,
                accu_reward_method=accu_reward_method,
            )
        except RowError as exc:
            result.bad.append((record.source, f"field '{exc.field}': {exc}"))
    if (result.bad and not skip_bad_rows) or output_path is None:
        return result
    path = Path(output_path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"Refusing to overwrite {path} (pass -y / --yes to overwrite)")
    result.path = write_rows(path, result.rows)
    return result


def read_template(template: str | None, template_file: str | Sequence[str] | None) -> str:
    if template and template_file:
        raise ValueError("pass --prompt_template or --prompt_file, not both")
    if template_file:
        return Path(str(template_file)).read_text(encoding="utf-8").strip()
    return template or DEFAULT_PROMPT
