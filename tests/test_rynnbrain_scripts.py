"""RynnBrain's own launch lines: its SFT script's flags (RynnScale spellings) run as they mean."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from vlm_grpo.sft_jsonl import main, parse_args

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ANSWER = "The apple is on the left.\n#### <answer><affordance><frame 1> (325, 480)</affordance></answer>"


@pytest.fixture(scope="module")
def formatted_rows(tmp_path_factory):
    """Rows as RynnBrain's format_data.py writes them (ChatML conversation, every item with all fields)."""
    root = tmp_path_factory.mktemp("rynn_sft")
    rows = []
    for i in range(4):
        image = root / f"scene_{i}.png"
        Image.new("RGB", (56 + 28 * i, 56), (40 * i, 90, 160)).save(image)

        def item(kind, text="", path=""):
            return {"type": kind, "text": text, "image": path, "video": "", "width": 0, "height": 0, "duration": 0.0}

        rows.append(
            {
                "data_source": "affordance_cot",
                "id": str(i),
                "text_sequence_length": 64,
                "conversation": [
                    {"role": "user", "content": [item("image", path=str(image)), item("text", "Where to grasp?")]},
                    {"role": "assistant", "content": [item("text", ANSWER)]},
                ],
            }
        )
    path = root / "cot_train_formatted.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sft_flag_line(model, data, output_dir, *extra):
    """train_sft.sh's flag line, paths changed, sized for one CPU step."""
    return [
        "--model_path", str(model),
        "--data_mixture", str(data),
        "--model_max_length", "16384",
        "--mm_max_length", "10240",
        "--per_device_train_batch_size", "2",
        "--num_train_epochs", "1",
        "--llm_lr", "1e-5",
        "--vision_encoder_lr", "2e-6",
        "--lr_scheduler_type", "cosine",
        "--warmup_ratio", "0.03",
        "--bf16", "False",
        "--gradient_checkpointing", "True",
        "--output_dir", str(output_dir),
        "--save_steps", "2000",
        "--use_multimodal_thinking", "False",
        "--max_steps", "1", "--report_to", "none", "--dataloader_num_workers", "0",
        *extra,
    ]  # fmt: skip


def test_sft_flag_line_means_what_rynnscale_means(tiny_models, formatted_rows, tmp_path):
    script, training, model = parse_args(sft_flag_line(tiny_models["qwen2_5_vl"], formatted_rows, tmp_path / "o"))
    assert model.model_name_or_path == str(tiny_models["qwen2_5_vl"])
    assert script.data_file_paths == str(formatted_rows)
    assert training.max_length == 16384 and script.mm_max_length == 10240
    assert (training.llm_lr, training.vision_encoder_lr) == (1e-5, 2e-6)
    assert training.gradient_checkpointing is True and training.lr_scheduler_type == "cosine"
    assert training.warmup_steps == 0.03  # transformers reads a value below 1 as that ratio of the total steps


def test_sft_flag_line_trains_one_step(tiny_models, formatted_rows, tmp_path, capsys):
    trainer = main(*parse_args(sft_flag_line(tiny_models["qwen2_5_vl"], formatted_rows, tmp_path / "o")))
    assert trainer.state.global_step == 1
    # the two learning rates reached the optimizer (the scheduler keeps each group's starting one)
    assert {g["initial_lr"] for g in trainer.optimizer.param_groups} == {1e-5, 2e-6}
    assert (tmp_path / "o" / "config.json").is_file()
    assert "[vlm-grpo-sft] step 1;" in capsys.readouterr().out


@pytest.mark.parametrize("spelling", [["--use_multimodal_thinking", "True"], ["--use_multimodal_thinking"],
                                      ["--use_multimodal_thinking=true"]])  # fmt: skip
def test_multimodal_thinking_true_is_refused_not_dropped(spelling, tmp_path):
    with pytest.raises(SystemExit, match=r"multimodal thinking .* is not supported"):
        parse_args(["--model_path", "m", "--output_dir", str(tmp_path), *spelling])


def test_multimodal_thinking_false_changes_nothing(tmp_path):
    base = ["--model_path", "m", "--output_dir", str(tmp_path)]
    assert parse_args([*base, "--use_multimodal_thinking", "false"]) == parse_args(base)
    with_bf16 = [*base, "--bf16", "false"]
    assert parse_args(["--use_multimodal_thinking=False", *with_bf16]) == parse_args(with_bf16)


def test_both_spellings_of_the_model_flag_are_an_error(tmp_path):
    with pytest.raises(SystemExit, match="--model_name_or_path and --model_path are the same option"):
        parse_args(["--model_name_or_path", "a", "--model_path", "b", "--output_dir", str(tmp_path)])


# ----------------------------------------------------------------------------- format_data.py --check / --debug
def format_line(model, rows, save, *extra):
    """format_data.py's flag line (paths changed) as ``vlm-grpo-data format``."""
    return ["format", "--ann_path", str(rows), "--save_path", str(save), "--tokenizer_path", str(model),
            "--data_root", str(rows.parent), "-y", *extra]  # fmt: skip


def test_format_check_validates_and_writes_nothing(tiny_models, formatted_rows, tmp_path, capsys):
    from vlm_grpo.data.cli import main as data_main

    save = tmp_path / "out.jsonl"
    assert data_main(format_line(tiny_models["qwen2_5_vl"], formatted_rows, save, "--check")) == 0
    out = capsys.readouterr().out
    assert "count=4" in out and "RESULT: OK" in out and not save.exists()
    broken = tmp_path / "broken.jsonl"
    lines = formatted_rows.read_text().splitlines()
    lines[2] = lines[2].replace("scene_2.png", "missing.png")
    broken.write_text("\n".join(lines) + "\n")
    assert data_main(format_line(tiny_models["qwen2_5_vl"], broken, save, "--check")) == 1
    out = capsys.readouterr()
    assert f"{broken}:3" in out.out + out.err and not save.exists()


def test_format_debug_formats_one_thread_and_writes_nothing(tiny_models, formatted_rows, tmp_path, capsys):
    from vlm_grpo.data.cli import main as data_main

    save = tmp_path / "out.jsonl"
    argv = format_line(tiny_models["qwen2_5_vl"], formatted_rows, save, "--layout", "chatml", "--debug")
    assert data_main(argv) == 0
    out = capsys.readouterr().out
    assert "formatted 4 rows; --debug: nothing written" in out and not save.exists()
    first = json.loads(out[: out.index("formatted 4 rows")])
    assert first["data_source"] == "affordance_cot" and first["text_sequence_length"] > 0
    assert data_main(format_line(tiny_models["qwen2_5_vl"], formatted_rows, save, "--layout", "chatml")) == 0
    assert json.loads(save.read_text().splitlines()[0]) == first  # --debug shows what would be written
    # an error: one line normally, the traceback with --debug
    missing = [*format_line(tiny_models["qwen2_5_vl"], tmp_path / "none.jsonl", save)]
    assert data_main(missing) == 2
    assert capsys.readouterr().err.startswith("vlm-grpo-data format: error:")
    with pytest.raises(ValueError, match="data file not found"):
        data_main([*missing, "--debug"])


def test_model_max_length_on_the_grpo_recipe_says_where_it_belongs(tmp_path):
    from vlm_grpo.grpo_jsonl import parse_args as grpo_parse_args

    with pytest.raises(ValueError, match=r"an SFT flag .*--max_prompt_length"):
        grpo_parse_args(["--model_path", "m", "--output_dir", str(tmp_path), "--model_max_length", "8"])
