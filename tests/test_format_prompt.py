"""--format_prompt: sandboxed Jinja templates render the user prompt (EasyR1's templates unchanged)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from vlm_grpo.data import prepare_rows
from vlm_grpo.data.formats import RowError
from vlm_grpo.data.jsonl import LazyImageTransform
from vlm_grpo.data.sources import read_sources
from vlm_grpo.data.templates import TemplateError

REPO = Path(__file__).resolve().parents[1]
R1V = REPO / "configs" / "templates" / "r1v.jinja"
MATH = REPO / "configs" / "templates" / "math.jinja"


@pytest.fixture
def rows_file(tmp_path) -> Path:
    Image.new("RGB", (56, 56), (10, 200, 10)).save(tmp_path / "g.png")
    rows = [
        {"problem": "  What colour is it?  ", "answer": "green", "images": ["g.png"], "level": 2},
        {
            "data_source": "geo3k",
            "prompt": [{"role": "user", "content": "Find x in <image>."}],
            "images": ["g.png"],
            "reward_model": {"ground_truth": "3"},
            "level": 5,
        },
        {
            "id": "v1",
            "conversations": [{"from": "human", "value": "How many?"}, {"from": "gpt", "value": "<answer>0</answer>"}],
            "level": 1,
        },
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_easyr1_templates_render_three_row_formats_as_expected(rows_file):
    rows, bad = read_sources(str(rows_file), format_prompt=str(MATH))
    assert bad == []
    tail = (
        " You FIRST think about the reasoning process as an internal monologue and then provide the final answer."
        " The reasoning process MUST BE enclosed within <think> </think> tags."
        " The final answer MUST BE put in \\boxed{}."
    )
    assert [r["question"] for r in rows] == [
        "<image>  What colour is it?" + tail,  # EasyR1 puts the image in front, then `content | trim`
        "Find x in <image>." + tail,
        "How many?" + tail,
    ]
    rows, _ = read_sources(str(rows_file), format_prompt=str(R1V))
    assert rows[2]["question"].startswith("How many? A conversation between User and Assistant.")
    assert rows[2]["question"].endswith("<think> reasoning process here </think><answer> answer here </answer>")


def test_template_sees_answer_images_and_any_column(rows_file, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("[{{ level }}|{{ images | length }} image(s)|{{ answer }}] {{ prompt }}\n")
    rows, bad = read_sources(str(rows_file), format_prompt=str(template))
    assert bad == []
    assert [r["question"] for r in rows] == [
        "[2|1 image(s)|green] <image>  What colour is it?",
        "[5|1 image(s)|3] Find x in <image>.",
        "[1|0 image(s)|<answer>0</answer>] How many?",
    ]


def test_template_errors_name_file_line_and_row(rows_file, tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("line one\n{{ content | trim }\n")
    with pytest.raises(TemplateError, match=rf"{broken}:2: template syntax error"):
        read_sources(str(rows_file), format_prompt=str(broken))

    partial = tmp_path / "partial.jinja"
    partial.write_text("{{ content }}\n{% if data_source %}{{ data_source }}{% endif %}\n{{ difficulty }}\n")
    rows, bad = read_sources(str(rows_file), format_prompt=str(partial))
    assert rows == []
    assert str(bad[0]) == (
        f"{rows_file}:1: field 'format_prompt': {partial}:2: UndefinedError: 'data_source' is undefined"
    )
    assert [b.source for b in bad] == [f"{rows_file}:{i}" for i in (1, 2, 3)]
    assert f"{partial}:3: UndefinedError: 'difficulty' is undefined" in bad[1].reason


def test_sandbox_refuses_python_internals(rows_file, tmp_path):
    sneaky = tmp_path / "sneaky.jinja"
    sneaky.write_text("{{ content.__class__.__mro__[1].__subclasses__() }}")
    rows, bad = read_sources(str(rows_file), format_prompt=str(sneaky))
    assert rows == [] and len(bad) == 3
    assert all("__class__" in b.reason and b.field == "format_prompt" for b in bad)


def test_rendered_prompt_is_what_trains_and_what_max_prompt_length_counts(rows_file, tmp_path, tiny_models):
    from vlm_grpo.configs import VLMModelConfig
    from vlm_grpo.recipe import pick_module

    module, processor = pick_module(VLMModelConfig(model_name_or_path=str(tiny_models["qwen2_5_vl"])))
    long = tmp_path / "long.jinja"
    long.write_text("{{ content }}" + " please answer" * 60)
    plain, _ = read_sources(str(rows_file))
    assert len(prepare_rows(plain, [], module, processor, max_prompt_length=110)) == 3  # the raw prompts fit
    rendered, bad = read_sources(str(rows_file), format_prompt=str(long))
    with pytest.raises(ValueError, match=r"prompt is \d+ tokens .* longer than --max_prompt_length 110"):
        prepare_rows(rendered, bad, module, processor, max_prompt_length=110)

    rows, _ = read_sources(str(rows_file), format_prompt=str(MATH))
    sample = LazyImageTransform(module)({k: [r.get(k) for r in rows] for k in ("question", "system", "task_type",
                                         "format_prompt", "image_path")})  # fmt: skip
    texts = [[c["text"] for c in p[-1]["content"] if c["type"] == "text"] for p in sample["prompt"]]
    # the family's own task template (<think>/<answer> instructions) is not added on top of the rendered text
    assert texts[2] == [rows[2]["question"]]


def test_template_sees_the_system_prompt_and_the_task_type(tmp_path):
    """``system`` (the row's system turn) and ``task_type`` (the row's, else --task_type) are rendered."""
    rows = [
        {
            "conversations": [
                {"from": "system", "value": "You count things."},
                {"from": "human", "value": "How many?"},
                {"from": "gpt", "value": "3"},
            ],
            "task_type": "counting",
        },
        {"conversations": [{"from": "human", "value": "Why?"}, {"from": "gpt", "value": "because"}]},
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = tmp_path / "t.jinja"
    template.write_text("{{ system or 'no system' }} | {{ task_type }} | {{ content }}\n")
    good, bad = read_sources(str(path), format_prompt=str(template), task_type="explain")
    assert bad == []
    assert [r["question"] for r in good] == [
        "You count things. | counting | How many?",
        "no system | explain | Why?",
    ]
    assert good[0]["system"] == "You count things." and [r["task_type"] for r in good] == ["counting", "explain"]


def test_a_missing_template_and_a_bytes_column_are_handled(tmp_path):
    from vlm_grpo.data.templates import PromptTemplate

    with pytest.raises(TemplateError, match=rf"^--format_prompt: template file not found: {tmp_path / 'none.jinja'}$"):
        PromptTemplate(tmp_path / "none.jinja")
    template = tmp_path / "t.jinja"
    template.write_text("{{ blob is defined }} {{ content }}  \n\n")
    row = {"question": "Q", "solution": "A", "image_path": []}
    # bytes columns (image bytes of a table) are not handed to the template; the text is stripped
    assert PromptTemplate(template).render(row, {"blob": b"\x89PNG", "level": 1}) == "False Q"
    failing = tmp_path / "f.jinja"
    failing.write_text("ok\n{{ content }}\n{{ 1 // level }}\n")
    with pytest.raises(RowError) as info:
        PromptTemplate(failing).render(row, {"level": 0})
    assert info.value.field == "format_prompt"
    assert str(info.value) == f"{failing}:3: ZeroDivisionError: integer division or modulo by zero"


def test_a_row_the_template_call_itself_refuses_is_a_bad_row_without_a_template_line(tmp_path):
    """A column named ``self`` clashes with the render call (no template line to name): still a bad row."""
    path = tmp_path / "odd.jsonl"
    path.write_text(json.dumps({"problem": "Q?", "answer": "a", "self": 1}) + "\n")
    template = tmp_path / "t.jinja"
    template.write_text("{{ content }}\n")
    rows, bad = read_sources(str(path), format_prompt=str(template))
    assert rows == [] and [b.field for b in bad] == ["format_prompt"]
    assert bad[0].reason.startswith(f"{template}: TypeError: ")
