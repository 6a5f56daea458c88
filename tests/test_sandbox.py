"""The python tool's sandbox: the bad-code corpus is stopped or contained, state persists, the CLI works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from vlm_grpo.tools.sandbox import Sandbox, SandboxLimits, SandboxUnavailable

LIMITS = SandboxLimits(timeout=3.0, cpu_seconds=20, memory_mb=1024, max_output_chars=500, max_images=3)


@pytest.fixture(scope="module")
def box():
    """One session shared by the cases that leave it alive (each case checks it still answers)."""
    sandbox = Sandbox(LIMITS, [Image.new("RGB", (40, 30), (200, 10, 10))])
    yield sandbox
    sandbox.close()


def test_state_persists_and_images_are_preloaded(box):
    assert box.run("x = 41\nprint(image.size, len(images))").stdout == "(40, 30) 1\n"
    result = box.run("x += 1\nx")
    assert result.stdout.strip() == "42" and result.error is None
    shown = box.run("display(image.crop((0, 0, 8, 8)))\nImage.fromarray(np.zeros((5, 6, 3), dtype=np.uint8))")
    assert [im.size for im in shown.images] == [(8, 8), (6, 5)]
    assert shown.images[0].getpixel((1, 1)) == (200, 10, 10)


CONTAINED = {
    "passwd": ("print(open('/etc/passwd').read())", "reading '/etc/passwd' is not allowed"),
    "parent_environ": ("open(f'/proc/{os.getppid()}/environ').read()", "is not allowed"),
    "write_outside": ("open('/tmp/vlm_grpo_escape.txt', 'w').write('x')", "writing '/tmp/vlm_grpo_escape.txt'"),
    "socket": ("import socket; socket.create_connection(('1.1.1.1', 80), timeout=1)", "network access"),
    "os_system": ("os.system('touch /tmp/vlm_grpo_escape.txt')", "running shell commands"),
    "subprocess": ("import subprocess; subprocess.run(['id'])", "not allowed"),
    "fork_bomb": ("while True:\n    os.fork()", "creating processes"),
    "ctypes": ("import ctypes; ctypes.CDLL(None).system(b'id')", "ctypes is not allowed"),
    "import_trainer": ("import vlm_grpo.trainer", "module 'vlm_grpo.trainer' is not available"),
    "import_torch": ("import torch", "module 'torch' is not available"),
    "memory_bomb": ("b = bytearray(8 * 2**30)", "MemoryError"),
    "stdin": ("input()", "EOFError"),
    "rlimit_raise": ("import resource; resource.setrlimit(resource.RLIMIT_AS, (-1, -1))", "not allowed"),
}


@pytest.mark.parametrize("case", sorted(CONTAINED))
def test_corpus_is_contained_with_a_clear_error(box, case):
    code, message = CONTAINED[case]
    result = box.run("import os\n" + code)
    assert result.error is not None and message in result.error, result
    assert box.alive and box.run("print('still here')").stdout == "still here\n"
    assert not Path("/tmp/vlm_grpo_escape.txt").exists()


def test_parent_environment_is_not_visible(box, monkeypatch):
    monkeypatch.setenv("VLM_GRPO_SECRET_TOKEN", "hunter2")  # set after the sandbox started: also check a fresh one
    fresh = Sandbox(LIMITS)
    try:
        for sandbox in (box, fresh):
            out = sandbox.run("import os\nprint(dict(os.environ))").stdout
            assert "hunter2" not in out and "VLM_GRPO" not in out and "HOME" in out
    finally:
        fresh.close()


def test_huge_output_and_many_images_are_cut(box):
    result = box.run("print('y' * 10**6)")
    assert len(result.stdout) < 600 and "more characters of output were cut" in result.stdout
    many = box.run("for i in range(1000):\n    display(Image.new('RGB', (4, 4)))")
    assert len(many.images) == 3 and "997 more images were dropped" in many.note


def test_infinite_loop_is_killed_and_the_next_session_starts_clean():
    sandbox = Sandbox(LIMITS)
    try:
        result = sandbox.run("while True:\n    pass")
        assert result.timed_out and "timed out after 3 s" in result.error
        assert not sandbox.alive
    finally:
        sandbox.close()


def test_own_network_namespace_or_a_clear_refusal():
    try:
        sandbox = Sandbox(LIMITS)
    except SandboxUnavailable as exc:  # machines without user namespaces must refuse, not run unisolated
        assert "allow_weak_isolation" in str(exc)
        return
    try:
        assert sandbox.isolation["network_namespace"] and sandbox.isolation["audit_hook"]
        assert {"RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE"} <= set(sandbox.isolation["rlimits"])
        inner = sandbox.run("import os\nprint(os.readlink('/proc/self/ns/net'))")
        assert inner.error is None and inner.stdout.strip() != os.readlink("/proc/self/ns/net")
    finally:
        sandbox.close()


def test_temp_dir_is_the_only_writable_place_and_is_removed(box):
    result = box.run("open('notes.txt', 'w').write('ok')\nprint(open('notes.txt').read(), os.getcwd())")
    assert result.error is None and result.stdout.startswith("ok ")
    assert result.stdout.split()[1] == os.path.realpath(box.tmp)
    sandbox = Sandbox(LIMITS)
    tmp = sandbox.tmp
    sandbox.close()
    assert not os.path.exists(tmp)


def test_cli_prints_the_json_record_last(tmp_path):
    code = tmp_path / "cell.py"
    code.write_text("print('width', images[0].width)\nimages[0].rotate(90, expand=True)\n")
    img = tmp_path / "in.png"
    Image.new("RGB", (12, 7), (0, 0, 255)).save(img)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "vlm_grpo.tools.sandbox", str(code), "--image", str(img), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["stdout"] == "width 12\n" and record["error"] is None
    assert [Image.open(p).size for p in record["images"]] == [(7, 12)]
    bad = tmp_path / "bad.py"
    bad.write_text("open('/etc/passwd').read()\n")
    record = json.loads(subprocess.run([*cmd[:3], str(bad)], capture_output=True, text=True, env=env).stdout)
    assert "reading '/etc/passwd' is not allowed" in record["error"]
    missing = subprocess.run([*cmd[:3], str(tmp_path / "nope.py")], capture_output=True, text=True, env=env)
    assert missing.returncode == 2 and missing.stderr.startswith("error: cannot read")


def test_rollouts_run_their_cells_at_the_same_time_and_in_order():
    """TRL asks the rollouts' tools one after another, round after round; the trainer's ToolBatch starts every
    rollout's cells of a round at once (in order within a rollout)."""
    import time

    from vlm_grpo.tools.rollouts import ToolBatch, build_tool_environment

    env_class = build_tool_environment(["python"], {"python": {"timeout": 20, "pool_size": 4}})
    envs = [env_class() for _ in range(4)]
    for env in envs:
        env.reset(images=[Image.new("RGB", (8, 8))])

    def turn(*codes):
        calls = [{"type": "function", "function": {"name": "python", "arguments": {"code": c}}} for c in codes]
        return {"role": "assistant", "content": "", "tool_calls": calls}

    slow = "import time\ntime.sleep(1.5)\n"
    first = [slow + "x = 41", "x += 1\nprint(x)"]
    completions = [[turn(*first)] for _ in envs]
    start = time.monotonic()
    with ToolBatch(envs, completions):
        outputs = [[env.python(code=c)[0]["text"] for c in first] for env in envs]  # in TRL's order
        assert outputs == [["(no output)", "42\n"]] * 4
        for turns in completions:  # what TRL appends before its next round
            turns += [{"role": "tool", "content": "..."}, turn(slow + "print(x * 2)")]
        second = [env.python(code=slow + "print(x * 2)")[0]["text"] for env in envs]
    elapsed = time.monotonic() - start
    assert second == ["84\n"] * 4
    assert elapsed < 7.5, f"2 rounds x 4 rollouts x 1.5 s took {elapsed:.1f} s: not run at the same time"
    assert [(env.calls, env.successes) for env in envs] == [(3, 3)] * 4  # each cell ran once
    assert all(env._batch is None for env in envs)
    for env in envs:
        env.reset()  # closes the rollout's interpreter
        assert not env._prefetched and not env.state


def test_cpu_limit_kills_a_busy_session_with_a_clear_message():
    sandbox = Sandbox(SandboxLimits(timeout=20.0, cpu_seconds=1))
    try:
        result = sandbox.run("while True:\n    pass")
        assert not result.timed_out and "CPU limit of 1 s" in result.error and not sandbox.alive
    finally:
        sandbox.close()
