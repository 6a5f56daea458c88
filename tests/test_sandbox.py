"""The python tool's sandbox: OS isolation as configured, limits just under / just over, untrusted replies,
PyVision's runtime contract, the pool replacing dead interpreters, the refusal without isolation, the CLI.
(The hostile programs are in test_sandbox_corpus.py.)"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
from PIL import Image

from vlm_grpo.cli_errors import is_user_error
from vlm_grpo.tools import TOOLS
from vlm_grpo.tools import sandbox as sandbox_module
from vlm_grpo.tools.base import ToolError
from vlm_grpo.tools.sandbox import Sandbox, SandboxLimits, SandboxPool, SandboxUnavailable
from vlm_grpo.tools.sandbox_isolation import IsolationMissing, missing
from vlm_grpo.tools.sandbox_protocol import ProtocolError

LIMITS = SandboxLimits(
    timeout=4.0, cpu_seconds=20, memory_mb=1024, max_output_chars=500, max_images=3, preload_matplotlib=False
)
RED = (200, 10, 10)

if missing():
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"the sandbox's isolation is missing on CI: {missing()}", pytrace=False)
    pytest.skip(f"the sandbox's isolation is missing here: {missing()}", allow_module_level=True)


@pytest.fixture(scope="module")
def box():
    """One session shared by the cases that leave it alive."""
    sandbox = Sandbox(LIMITS, [Image.new("RGB", (40, 30), RED)])
    yield sandbox
    sandbox.close()


def _env(options=None, images=None):
    from vlm_grpo.tools.rollouts import build_tool_environment

    env = build_tool_environment(["python"], {"python": {**(options or {}), "pool_size": 1}})()
    env.reset(images=images if images is not None else [Image.new("RGB", (40, 30), RED)])
    return env


# ---- isolation as seen from inside ----


def _tree(pid: int) -> list[int]:
    """``pid`` and every process under it, read from the host's /proc."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        ppid = int(next(line for line in status.splitlines() if line.startswith("PPid:")).split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out


def _uid(pid: int) -> tuple[int, str]:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return int(fields["Uid"].split()[0]), fields["Name"].strip()


def test_the_code_runs_as_nobody_in_its_own_namespaces(box):
    out = box.run(
        "import os\n"
        "print(os.getuid(), os.getgid(), os.getpid())\n"
        "print([l.split(':')[0].strip() for l in open('/proc/net/dev').read().splitlines()[2:]])\n"
        "print(sorted(os.listdir('/')), os.listdir('/root'), os.getcwd())\n"
        "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()), open('/proc/sys/kernel/hostname').read())"
    )
    assert out.error is None, out.error
    lines = out.stdout.splitlines()
    assert lines[0].startswith("65534 65534 ")
    assert lines[1] == "['lo']"  # no interface but a loopback of its own
    assert "home" not in lines[2] and "etc" not in lines[2] and lines[2].endswith("/tmp")
    assert len(lines[3].split("]")[0].split(",")) <= 4 and lines[3].endswith("sandbox")  # own pid and UTS ns
    # Seen from the host: every process that runs Python is the unprivileged user, never root.
    python = [_uid(p) for p in _tree(box.proc.pid) if _uid(p)[1].startswith("python")]
    want = 65534 if os.geteuid() == 0 else os.geteuid()
    assert len(python) == 2 and all(uid == want for uid, _ in python), python


def test_sandboxes_die_with_the_trainer():
    """SIGKILL the process that started a sandbox (no clean-up runs): every process of the sandbox goes too."""
    code = (
        "import time\nfrom vlm_grpo.tools.sandbox import Sandbox, SandboxLimits\n"
        "s = Sandbox(SandboxLimits(preload_matplotlib=False))\nprint(s.proc.pid, flush=True)\ntime.sleep(120)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    trainer = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    sandbox = _tree(int(trainer.stdout.readline()))
    assert len(sandbox) >= 4  # bwrap's processes, the supervisor and the runner
    trainer.kill()
    trainer.wait()

    def running(pid: int) -> bool:  # alive, not a zombie, and still one of the sandbox's (pids get reused)
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            alive = "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return False
        return alive and (b"bwrap" in cmdline or b"worker.py" in cmdline)

    deadline = time.monotonic() + 10
    while any(map(running, sandbox)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in sandbox if running(p)]


def test_parent_environment_is_not_visible(box, monkeypatch):
    monkeypatch.setenv("VLM_GRPO_SECRET_TOKEN", "hunter2")
    fresh = Sandbox(LIMITS)
    try:
        for sandbox in (box, fresh):
            out = sandbox.run("import os\nprint(dict(os.environ))").stdout
            assert "hunter2" not in out and "VLM_GRPO" not in out and "HOME" in out
    finally:
        fresh.close()


# ---- limits: just under succeeds, just over fails ----


@pytest.fixture(scope="module")
def tight():
    limits = SandboxLimits(
        timeout=10, memory_mb=768, file_mb=4, scratch_mb=16, open_files=40, max_threads=12, max_output_chars=2000
    )
    sandbox = Sandbox(limits)
    yield sandbox
    sandbox.close()


def test_memory_limit_is_the_configured_address_space(tight):
    code = (
        "vm = int([l for l in open('/proc/self/status') if l.startswith('VmSize')][0].split()[1]) * 1024\n"
        "room = 768 * 2**20 - vm\n"
        "block = bytearray(room - 24 * 2**20)\n"
        "print('under ok', len(block) > 0)\n"
        "del block\n"
        "block = bytearray(room + 4 * 2**20)\n"
    )
    result = tight.run(code)
    assert "under ok True" in result.stdout and "MemoryError" in result.error, result
    assert tight.alive


def test_file_size_limit(tight):
    ok = tight.run("open('f.bin', 'wb').write(b'x' * 4 * 2**20)\nimport os\nprint(os.path.getsize('f.bin'))")
    assert ok.error is None and ok.stdout.strip() == str(4 * 2**20)
    over = tight.run("with open('g.bin', 'wb') as f:\n    f.write(b'x' * (4 * 2**20 + 1))")
    assert "File too large" in over.error
    assert tight.run("import os\nfor f in ('f.bin', 'g.bin'):\n    os.remove(f)").error is None


def test_scratch_dir_size_limit(tight):
    chunk = "open(f'part{i}.bin', 'wb').write(b'x' * 3 * 2**20)"
    under = tight.run(f"for i in range(4):\n    {chunk}\nprint('ok')")  # 12 MiB of a 16 MiB tmpfs
    assert under.stdout == "ok\n", under
    over = tight.run(f"for i in range(4, 6):\n    {chunk}")  # 18 MiB
    assert "No space left on device" in over.error
    tight.run("import glob, os\nfor f in glob.glob('part*.bin'):\n    os.remove(f)")


def test_open_files_limit(tight):
    result = tight.run(
        "import os\nfds = []\ntry:\n    while True:\n        fds.append(os.open('/dev/null', os.O_RDONLY))\n"
        "except OSError as exc:\n    print(max(fds), exc.strerror)\nfor fd in fds:\n    os.close(fd)"
    )
    assert result.stdout == "39 Too many open files\n", result  # fd 39 (the 40th) opens, fd 40 does not


def test_threads_limit(tight):
    result = tight.run(
        "import threading, time\nstop = threading.Event()\nthreads = []\ntry:\n    while True:\n"
        "        t = threading.Thread(target=stop.wait)\n        t.start()\n        threads.append(t)\n"
        "except RuntimeError as exc:\n    print(len(threads), exc)\nstop.set()\nfor t in threads:\n    t.join()"
    )
    # 12 tasks for the sandbox's user: bwrap's init, the supervisor, the runner's main thread, 9 more threads
    assert result.stdout == "9 can't start new thread\n", result


def test_cpu_limit_kills_a_busy_session_with_a_clear_message():
    sandbox = Sandbox(SandboxLimits(timeout=20.0, cpu_seconds=1))
    try:
        result = sandbox.run("while True:\n    pass")
        assert not result.timed_out and "CPU limit of 1 s" in result.error and not sandbox.alive
    finally:
        sandbox.close()


def test_limits_must_be_positive_numbers():
    with pytest.raises(ValueError, match="memory_mb must be a positive number"):
        SandboxLimits.from_options({"memory_mb": 0})
    with pytest.raises(ValueError, match="Unknown python tool option"):
        SandboxLimits.from_options({"memory": 10})


# ---- the trainer trusts nothing the sandbox says ----


def _png_header_only(width: int, height: int) -> str:
    """A PNG whose header claims ``width`` x ``height`` but holds almost no data (a decompression bomb's start)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack("!I", len(data)) + kind + data + struct.pack("!I", zlib.crc32(kind + data))

    ihdr = struct.pack("!IIBBBBB", width, height, 8, 2, 0, 0, 0)
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    return base64.b64encode(png).decode()


def test_replies_are_untrusted_data(box):
    good = io.BytesIO()
    Image.new("RGB", (5, 4)).save(good, format="PNG")
    bmp = io.BytesIO()
    Image.new("RGB", (5, 4)).save(bmp, format="BMP")
    reply = {"stdout": "x", "error": None, "note": None}
    images = [
        base64.b64encode(good.getvalue()).decode(),
        "/etc/passwd",
        "../../victim.png",
        _png_header_only(3000, 2000),
        base64.b64encode(bmp.getvalue()).decode(),
    ]
    result = box._result({**reply, "images": images[:3]})
    assert [im.size for im in result.images] == [(5, 4)] and result.note.count("an image was refused") == 2
    result = box._result({**reply, "images": images[3:]})
    assert not result.images and "3000x2000 is over max_image_pixels" in result.note and "not a PNG" in result.note
    for bad in (
        {**reply, "images": images[:1] * 4},  # more images than max_images=3
        {**reply, "images": "x"},
        {"stdout": 3, "images": []},
        {"died": "signal SIGSEGV: a crash"},
    ):
        with pytest.raises(ProtocolError):
            box._result(bad)
    assert box.run("print('fine')").stdout == "fine\n"


def test_stray_bytes_and_forged_frames_end_the_interpreter():
    sandbox = Sandbox(LIMITS)
    try:
        sandbox._buffer = b"VGRP" + b"\0" * 40  # as if something wrote outside a reply
        result = sandbox.run("print(1)")
        assert "wrote outside a reply" in result.error and not sandbox.alive
    finally:
        sandbox.close()


# ---- PyVision's runtime contract, through the tool ----


def test_pyvision_images_and_figures_in_order_and_available_to_later_cells():
    env = _env()
    try:
        out = env.python(code="print(image_clue_0.size, image.size, len(images))")
        assert out[0]["text"] == "(40, 30) (40, 30) 1\n"
        out = env.python(
            code="display(image_clue_0.crop((0, 0, 8, 8)))\n"
            "plt.figure(figsize=(2, 1), dpi=50)\nplt.plot([1, 2])\nplt.show()\n"
            "np.zeros((5, 6, 3), dtype=np.uint8)"
        )
        assert [c["image"].size for c in out[1:]] == [(8, 8), (100, 50), (6, 5)]  # the order shown
        assert "image_clue_1, image_clue_2, image_clue_3" in out[0]["text"]
        out = env.python(code="print(image_clue_1.size, image_clue_2.size, len(images))\nfig = plt.figure()\nfig")
        assert out[0]["text"].startswith("(8, 8) (100, 50) 4\n") and out[1]["image"].size == (640, 480)
        out = env.python(code="print(image_clue_1.getpixel((1, 1)))\ny = 5")
        assert out[0]["text"] == f"{RED}\n"
        assert env.python(code="y + 1")[0]["text"] == "6\n"  # persistent state
    finally:
        env.reset()


def test_matplotlib_imported_on_first_use_still_shows_to_the_model(box):
    """preload_matplotlib=False: ``plt`` imports on first use, and so does the model's own import; both show."""
    drawn = box.run("import matplotlib.pyplot as p2\np2.figure(figsize=(1, 1), dpi=20)\np2.plot([0, 1])\np2.show()")
    assert drawn.error is None and [im.size for im in drawn.images] == [(20, 20)]
    again = box.run("plt.figure(figsize=(2, 1), dpi=10)\nplt.gcf()")
    assert again.error is None and [im.size for im in again.images] == [(20, 10)]


def test_timeout_restarts_with_a_clear_message_and_the_images_come_back():
    env = _env({"timeout": 2})
    try:
        env.python(code="x = 1\ndisplay(image.rotate(90, expand=True))")
        with pytest.raises(ToolError, match=r"timed out after 2 s: .* restarted, so variables"):
            env.python(code="while True:\n    pass")
        assert env.timeouts == 1
        out = env.python(code="print('x' in dir(), image_clue_1.size)")
        assert out[0]["text"] == "False (30, 40)\n"
    finally:
        env.reset()


def test_crashing_calls_are_tool_errors_and_the_run_goes_on():
    """1 call in 100 crashes the interpreter: it is a tool error, the pool gives a new one, every call answers."""
    env = _env()
    try:
        texts, errors = [], []
        for i in range(100):
            code = "import os\nos._exit(3)" if i == 50 else f"print({i})"
            try:
                texts.append(env.python(code=code)[0]["text"])
            except ToolError as exc:
                errors.append(str(exc))
        assert len(texts) == 99 and texts[-1] == "99\n"
        assert len(errors) == 1 and "interpreter was killed (exit status 3)" in errors[0]
    finally:
        env.reset()


def test_rollouts_run_their_cells_at_the_same_time_and_in_order():
    """TRL asks the rollouts' tools one after another, round after round; the trainer's ToolBatch starts every
    rollout's cells of a round at once (in order within a rollout)."""
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
    assert [(env.calls, env.successes) for env in envs] == [(3, 3)] * 4
    for env in envs:
        env.reset()
        assert not env._prefetched and not env.state


# ---- without the isolation: refuse, or run weak only when asked ----


def _no_bwrap(*args, **kwargs):
    raise IsolationMissing("bubblewrap is not installed (apt-get install bubblewrap, or dnf install bubblewrap)")


def test_missing_isolation_is_refused_unless_opted_in(monkeypatch, caplog):
    monkeypatch.setattr(sandbox_module, "build_launch", _no_bwrap)
    monkeypatch.setattr(sandbox_module, "_POOLS", {})  # a pool an earlier test started in this process is not asked
    with pytest.raises(SandboxUnavailable, match=r"bubblewrap is not installed .*allow_weak_isolation") as info:
        TOOLS.get("python").setup({})  # when a run starts, before any model is loaded
    assert is_user_error(info.value)  # printed as "error: ..." with exit status 2, no traceback
    with caplog.at_level(logging.WARNING, logger="vlm_grpo.tools.sandbox"):
        pool = SandboxPool(SandboxLimits(allow_weak_isolation=True, pool_size=1))
    try:
        warnings = [r.getMessage() for r in caplog.records if "WEAK ISOLATION" in r.getMessage()]
        assert len(warnings) == 1 and "\n" not in warnings[0]
        weak = pool.acquire([])
        assert weak.isolation == "weak" and weak.run("print(2 + 2)").stdout == "4\n"
        assert "Operation not permitted" in weak.run("import os\nos.fork()").error  # seccomp still holds
        own = weak._own_dir
        weak.close()
        assert not os.path.exists(own)  # the only folder it deletes is the one it made
    finally:
        pool.close()


# ---- the command line ----


def _cli(*args, env=None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})}
    cmd = [sys.executable, "-m", "vlm_grpo.tools.sandbox", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


BENIGN = {
    "crop.py": ("print('width', images[0].width)\nimages[0].crop((0, 0, 6, 5))\n", "width 12\n", [(6, 5)]),
    "numpy_stats.py": ("a = np.asarray(image)\nprint(a.shape, int(a[..., 2].mean()))\n", "(7, 12, 3) 255\n", []),
    "savefig.py": (
        "import matplotlib.pyplot as plt\nplt.figure(figsize=(1, 1), dpi=30)\nplt.plot([0, 1])\n"
        "plt.savefig('plot.png')\nprint(Image.open('plot.png').size)\nplt.show()\n",
        "(30, 30)\n",
        [(30, 30)],
    ),
}


@pytest.mark.parametrize("name", sorted(BENIGN))
def test_cli_prints_the_json_record_last(tmp_path, name):
    code, stdout, sizes = BENIGN[name]
    (tmp_path / name).write_text(code)
    Image.new("RGB", (12, 7), (0, 0, 255)).save(tmp_path / "in.png")
    proc = _cli(tmp_path / name, "--image", tmp_path / "in.png", "--out", tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record["stdout"] == stdout and record["error"] is None
    assert [Image.open(p).size for p in record["images"]] == sizes
    assert all(Path(p).parent == tmp_path / "out" for p in record["images"])


def test_cli_hostile_program_prints_an_error_and_leaves_no_trace(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("victim\n")
    bad = tmp_path / "bad.py"
    bad.write_text(f"import os\nos.remove({str(victim)!r})\n")
    proc = _cli(bad)
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "No such file or directory" in record["error"] and victim.read_text() == "victim\n"
    missing_file = _cli(tmp_path / "nope.py")
    assert missing_file.returncode == 2 and missing_file.stderr.startswith("error: cannot read")


def test_cli_without_bwrap_names_what_is_missing(tmp_path):
    (tmp_path / "ok.py").write_text("print(1)\n")
    no_path = {"PATH": str(tmp_path)}  # neither bwrap nor setpriv can be found
    refused = _cli(tmp_path / "ok.py", env=no_path)
    assert refused.returncode == 2 and refused.stderr.startswith("error: ") and "bubblewrap" in refused.stderr
    assert "apt-get install bubblewrap" in refused.stderr and "Traceback" not in refused.stderr
    weak = _cli(tmp_path / "ok.py", "--allow_weak_isolation", env=no_path)
    assert weak.returncode == 0 and json.loads(weak.stdout.splitlines()[-1])["stdout"] == "1\n"
    assert weak.stderr.count("WEAK ISOLATION") == 1
