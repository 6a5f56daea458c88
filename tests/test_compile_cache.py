"""compile_cache_dir: compiled artifacts persist in one folder, and a second process loads them instead of compiling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vlm_grpo.fastpath.compile_cache import use_compile_cache, version_key

# A second process: point the caches with use_compile_cache, compile and run a small function, report inductor's
# and AOTAutograd's cache counters (a miss is a compilation, a hit a load from the folder).
SCRIPT = """
import json, sys
import torch
from torch._dynamo.utils import counters
from vlm_grpo.fastpath.compile_cache import use_compile_cache

folder = use_compile_cache(sys.argv[1])
f = torch.compile(lambda x, w: torch.nn.functional.silu(x @ w).softmax(-1) * 3)
f(torch.randn(8, 16), torch.randn(16, 16))
print(json.dumps({"folder": str(folder), **counters["inductor"], **counters["aot_autograd"]}))
"""


def _compile_in_a_new_process(folder: Path, tmp_path: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "VLM_GRPO_COMPILE_CACHE"):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(folder)], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_process_loads_the_compiled_graphs_instead_of_compiling(tmp_path):
    cache = tmp_path / "cache"
    first = _compile_in_a_new_process(cache, tmp_path)
    # Control: an empty folder compiles (so nothing is found in torch's default folder or in memory).
    assert first["fxgraph_cache_miss"] >= 1 and first.get("fxgraph_cache_hit", 0) == 0, first
    assert Path(first["folder"]) == cache / version_key("cpu") and any(Path(first["folder"]).iterdir())
    second = _compile_in_a_new_process(cache, tmp_path)
    assert second.get("fxgraph_cache_miss", 0) == 0 and second["fxgraph_cache_hit"] == first["fxgraph_cache_miss"]
    assert second.get("autograd_cache_miss", 0) == 0 and second["autograd_cache_hit"] >= 1, second


def test_the_folder_follows_the_setting_the_env_and_the_compilers_own_variables(tmp_path, monkeypatch):
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VLM_GRPO_COMPILE_CACHE", str(tmp_path / "env"))
    folder = use_compile_cache(None, "cpu")  # the default: the env's folder, under the version key
    assert folder == tmp_path / "env" / version_key("cpu") and folder.is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    assert os.environ["TRITON_CACHE_DIR"] == str(folder / "triton")
    assert torch.__version__.replace("+", "") in version_key("cpu").replace("+", "")

    monkeypatch.delenv("VLM_GRPO_COMPILE_CACHE")  # then compile/ in the package's cache folder
    monkeypatch.setenv("VLM_GRPO_CACHE", str(tmp_path / "pkg"))
    assert use_compile_cache(None, "cpu") == tmp_path / "pkg" / "compile" / version_key("cpu")

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # a user's own variable wins the default
    assert use_compile_cache(None, "cpu") is None and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    given = use_compile_cache(str(tmp_path / "given"), "cpu")  # ... and an explicit setting wins over it
    assert given == tmp_path / "given" / version_key("cpu") and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(given)

    assert use_compile_cache("off", "cpu") is None  # off: a fresh temporary folder per process
    off = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert Path(off).is_dir() and not off.startswith(str(tmp_path)) and "vlm_grpo_compile_" in off

    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"cannot create .*file.*--compile_cache_dir off"):
        use_compile_cache(str(tmp_path / "file"), "cpu")


def test_a_folder_that_cannot_be_made_is_refused_by_the_config_before_any_model_loads(tmp_path):
    from vlm_grpo.configs import VLMGRPOConfig

    (tmp_path / "file").write_text("")
    common = {"output_dir": str(tmp_path / "out"), "use_cpu": True, "bf16": False, "report_to": "none"}
    with pytest.raises(ValueError, match=r"cannot create .*file/cc \(.*file is a file\).*--compile_cache_dir off"):
        VLMGRPOConfig(**common, compile_cache_dir=str(tmp_path / "file" / "cc"))
    assert VLMGRPOConfig(**common, compile_cache_dir=str(tmp_path / "new" / "cc")).compile_cache_dir  # just under
    assert not (tmp_path / "new").exists()  # checking creates nothing
    assert VLMGRPOConfig(**common, compile_cache_dir="off").compile_cache_dir == "off"


def test_the_trainer_points_the_caches_at_compile_cache_dir(tiny_models, tmp_path, monkeypatch):
    from datasets import Dataset

    from vlm_grpo.configs import VLMGRPOConfig
    from vlm_grpo.modules import get_vlm_module
    from vlm_grpo.trainer import VLMGRPOTrainer

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    model_dir = str(tiny_models["qwen2_5_vl"])
    module = get_vlm_module(model_dir)
    args = VLMGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2, max_steps=1, use_cpu=True,
        bf16=False, report_to="none", compile_cache_dir=str(tmp_path / "cc"),
    )  # fmt: skip
    trainer = VLMGRPOTrainer(
        model=module.load_model(model_dir, dtype=torch.float32),
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=args,
        vlm_module=module,
        processing_class=module.load_processor(model_dir),
        train_dataset=Dataset.from_dict({"prompt": ["hi", "ho"]}),
    )
    assert trainer.compile_cache == tmp_path / "cc" / version_key("cpu")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(trainer.compile_cache)
