"""compile_cache_dir: compiled artifacts persist in one folder, and a second process loads them instead of compiling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vlm_grpo.fastpath.compile_cache import JOB, use_compile_cache, version_key

# A process of its own: point the caches with use_compile_cache (the default setting, after torch._dynamo has written
# torch's own default folder into TORCHINDUCTOR_CACHE_DIR), compile and run a small function on three row counts (a
# cold process traces it static, then again with the row count dynamic), report the start-up counters.
# argv[2] "no_profile": dynamo's profile of dynamic dimensions is not kept (the control).
SCRIPT = """
import json, os, sys
import torch
import torch._dynamo  # as transformers does before any trainer: torch writes its own default folder into the env
import torch.compiler.config
from vlm_grpo.fastpath import startup
from vlm_grpo.fastpath.compile_cache import use_compile_cache

assert os.environ.get("TORCHINDUCTOR_CACHE_DIR")
os.environ["VLM_GRPO_COMPILE_CACHE"] = sys.argv[1]
folder = use_compile_cache(None)  # the default setting: the documented folder, over torch's own default
if sys.argv[2] == "no_profile":
    torch.compiler.config.job_id = None
f = torch.compile(lambda x, w: torch.nn.functional.silu(x @ w).softmax(-1) * 3)
for rows in (8, 9, 10):
    f(torch.randn(rows, 16), torch.randn(16, 16))
print(json.dumps({"folder": str(folder), **startup.report()}))
"""


def _compile_in_a_new_process(folder: Path, tmp_path: Path, profile: bool = True) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "VLM_GRPO_COMPILE_CACHE"):
        env.pop(name, None)
    argv = [sys.executable, "-c", SCRIPT, str(folder), "profile" if profile else "no_profile"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_process_loads_the_compiled_graphs_instead_of_compiling(tmp_path):
    cache = tmp_path / "cache"
    first = _compile_in_a_new_process(cache, tmp_path)
    # Control: an empty folder compiles (so nothing is found in torch's default folder or in memory), twice: static,
    # then with the row count dynamic.
    assert first["fxgraph_cache_miss"] == 2 and first["fxgraph_cache_hit"] == 0 and first["dynamo_graphs"] == 2, first
    assert first["dynamo_seconds"] > 0 and first["decode_warmups"] == 0
    assert Path(first["folder"]) == cache / version_key("cpu") and any(Path(first["folder"]).iterdir())
    assert list((Path(first["folder"]) / "dynamo").glob("code_state_*.pkl"))  # dynamo's profile, in the folder
    second = _compile_in_a_new_process(cache, tmp_path)
    # Nothing compiled, and one trace: the profile says the row count is dynamic from the first call.
    assert second["fxgraph_cache_miss"] == 0 and second["fxgraph_cache_hit"] == 1 and second["dynamo_graphs"] == 1
    assert second["autograd_cache_miss"] == 0 and second["autograd_cache_hit"] == 1, second
    # Control: without the profile the warm folder still loads every graph, but dynamo traces twice.
    unprofiled = _compile_in_a_new_process(cache, tmp_path, profile=False)
    assert unprofiled["fxgraph_cache_miss"] == 0 and unprofiled["dynamo_graphs"] == 2, unprofiled


def test_the_folder_follows_the_setting_the_env_and_the_compilers_own_variables(tmp_path, monkeypatch):
    import torch.compiler.config

    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.compiler.config, "job_id", None)
    monkeypatch.setenv("VLM_GRPO_COMPILE_CACHE", str(tmp_path / "env"))
    folder = use_compile_cache(None, "cpu")  # the default: the env's folder, under the version key
    assert folder == tmp_path / "env" / version_key("cpu") and folder.is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    assert os.environ["TRITON_CACHE_DIR"] == str(folder / "triton")
    assert torch.__version__.replace("+", "") in version_key("cpu").replace("+", "")
    assert torch.compiler.config.job_id == JOB  # dynamo keeps its profile of dynamic dimensions there too
    monkeypatch.setattr(torch.compiler.config, "job_id", "theirs")
    use_compile_cache(None, "cpu")
    assert torch.compiler.config.job_id == "theirs"  # a job the process named stays

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


def test_the_folders_torch_writes_itself_are_not_a_users_choice(tmp_path, monkeypatch):
    """Inductor writes its default folder into TORCHINDUCTOR_CACHE_DIR the first time it needs one (importing
    torch._dynamo does; transformers imports it before any trainer exists), and a folder under it into
    TRITON_CACHE_DIR when it builds its first Triton kernel: the documented folder still wins over those. A folder a
    user chose, even one beside the default, still wins over the documented one."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("VLM_GRPO_COMPILE_CACHE", str(tmp_path / "env"))
    folder = tmp_path / "env" / version_key("cpu")
    torch_default = os.path.abspath(default_cache_dir())
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", torch_default)
    monkeypatch.setenv("TRITON_CACHE_DIR", os.path.join(torch_default, "triton", "0"))
    assert use_compile_cache(None, "cpu") == folder and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    assert os.environ["TRITON_CACHE_DIR"] == str(folder / "triton")
    for name, chosen in (("TORCHINDUCTOR_CACHE_DIR", torch_default + "_mine"), ("TRITON_CACHE_DIR", "triton_mine")):
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
        monkeypatch.setenv(name, chosen)
        assert use_compile_cache(None, "cpu") is None and os.environ[name] == chosen, name


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
