"""The hostile corpus (tests/sandbox_corpus/*.py): each program tries to reach the host, and its success would show
OUTSIDE the sandbox: a marker file created, a victim file changed or deleted, a secret (file or environment)
appearing in anything the trainer receives, a host process killed, a connection to a host socket. Each must end
with a clear tool error (the program's ``# expect:`` line), leave the host untouched, and the trainer's pool must
go on handing out working interpreters. Run as root (CI, the real hosts) and, from root, again as a normal user.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
from dataclasses import fields
from pathlib import Path

import pytest
from PIL import Image

from vlm_grpo.tools import sandbox as sandbox_module
from vlm_grpo.tools.sandbox import Sandbox, SandboxLimits, SandboxPool
from vlm_grpo.tools.sandbox_isolation import IsolationMissing, missing

CORPUS_DIR = Path(__file__).parent / "sandbox_corpus"
CORPUS = sorted(p.stem for p in CORPUS_DIR.glob("*.py"))
LIMITS = SandboxLimits(
    timeout=4.0,
    cpu_seconds=30,
    memory_mb=1024,
    file_mb=8,
    scratch_mb=32,
    max_output_chars=2000,
    pool_size=2,
    preload_matplotlib=False,  # the programs do not draw: interpreters start ~3x faster
)
SECRET_ENV = "VLM_GRPO_CORPUS_SECRET"
# Programs whose every attempt fails inside and which then end normally, printing what they tried.
EXPECTED_TO_FINISH = {
    "gc_frames",
    "fd_writes",
    "image_paths_as_values",
    "proc_environ",
    "proc_root_escape",
    "huge_image",
    "socket_families",
    "output_flood",
}
os.environ.setdefault(SECRET_ENV, secrets.token_hex(16))  # in the trainer's environment before any sandbox starts

if missing():
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"the sandbox's isolation is missing on CI: {missing()}", pytrace=False)
    pytest.skip(f"the sandbox's isolation is missing here: {missing()}", allow_module_level=True)


def expectation(name: str) -> list[str]:
    for line in (CORPUS_DIR / f"{name}.py").read_text().splitlines():
        if line.startswith("# expect:"):
            return [alt.strip() for alt in line.removeprefix("# expect:").split("|")]
    raise AssertionError(f"{name}.py has no '# expect:' line")


class Host:
    """What the programs attack, planted outside the sandbox, and the checks that nothing of it changed."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.token = secrets.token_hex(16)
        self.secret = root / "secret.txt"
        self.secret.write_text(f"SECRET {self.token}\n")
        self.secret.chmod(0o644)  # readable by everyone: only the mount namespace keeps it out of reach
        self.victim = root / "victim.txt"
        self.victim.write_text("victim\n")
        self.victim.chmod(0o666)
        self.marker = root / "marker.txt"
        self.sleeper = subprocess.Popen(["sleep", "600"])
        self.connections: list[str] = []
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.unix = socket.socket(socket.AF_UNIX)
        self.unix_path = str(root / "host.sock")
        self.unix.bind(self.unix_path)
        os.chmod(self.unix_path, 0o777)
        self.unix.listen()
        for server in (self.tcp, self.unix):
            threading.Thread(target=self._accept, args=(server,), daemon=True).start()
        self.listing = sorted(os.listdir(root))

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            self.connections.append(str(server.family))
            conn.close()

    def header(self) -> str:
        values = {
            "SECRET_FILE": str(self.secret),
            "VICTIM": str(self.victim),
            "MARKER": str(self.marker),
            "HOST_PID": self.sleeper.pid,
            "HOST_PORT": self.tcp.getsockname()[1],
            "HOST_SOCK": self.unix_path,
            "LIMITS": {"memory_mb": LIMITS.memory_mb},
        }
        return "".join(f"{k} = {v!r}\n" for k, v in values.items())

    def assert_untouched(self, received: str) -> None:
        assert not self.marker.exists(), f"the marker was created: {self.marker.read_text()[:200]!r}"
        assert self.victim.read_text() == "victim\n" and oct(self.victim.stat().st_mode)[-3:] == "666"
        assert self.token not in received, "the secret file's content reached the trainer"
        assert os.environ[SECRET_ENV] not in received, "the trainer's environment reached the sandbox"
        assert self.sleeper.poll() is None, "a host process was killed"
        assert not self.connections, f"the sandbox connected to a host socket: {self.connections}"
        assert sorted(os.listdir(self.root)) == self.listing, "files appeared next to the planted ones"

    def close(self) -> None:
        self.sleeper.kill()
        self.sleeper.wait()
        self.tcp.close()
        self.unix.close()


@pytest.fixture(scope="module")
def pool():
    pool = SandboxPool(LIMITS)
    yield pool
    pool.close()


@pytest.fixture
def host(tmp_path):
    host = Host(tmp_path)
    yield host
    host.close()


def run_program(sandbox: Sandbox, host: Host, name: str) -> str:
    code = host.header() + (CORPUS_DIR / f"{name}.py").read_text()
    result = sandbox.run(code)
    return "\n".join(part for part in (result.stdout, result.error, result.note) if part)


def test_the_corpus_is_large_and_every_program_states_what_stops_it():
    assert len(CORPUS) >= 30
    assert all(expectation(name) for name in CORPUS)


@pytest.mark.parametrize("name", CORPUS)
def test_hostile_program_is_contained(pool, host, name):
    sandbox = pool.acquire([Image.new("RGB", (16, 16), (1, 2, 3))])
    try:
        received = run_program(sandbox, host, name)
    finally:
        sandbox.close()
    host.assert_untouched(received)
    assert any(alt in received for alt in expectation(name)), received[-1500:]


def test_the_pool_still_hands_out_working_interpreters(pool):
    sandboxes = [pool.acquire([]) for _ in range(3)]
    try:
        assert [s.run("print(6 * 7)").stdout for s in sandboxes] == ["42\n"] * 3
    finally:
        for s in sandboxes:
            s.close()


def test_negative_control_the_checks_see_an_escape_without_the_namespaces(host, monkeypatch):
    """The same program, the same checks, with bubblewrap's namespaces taken away: the secret is read."""

    def no_bwrap(*args, **kwargs):
        raise IsolationMissing("bubblewrap is not installed (test)")

    monkeypatch.setattr(sandbox_module, "build_launch", no_bwrap)
    sandbox = Sandbox(SandboxLimits(allow_weak_isolation=True))
    try:
        assert sandbox.isolation == "weak"
        received = run_program(sandbox, host, "trainer_files")
    finally:
        sandbox.close()
    with pytest.raises(AssertionError, match="secret file"):
        host.assert_untouched(received)


def _as_normal_user_command(uid: int) -> list[str]:
    """bwrap as root: the host's root dir, with ``/root`` replaced by an empty one holding only this Python and
    this checkout (so a non-root user can run them), then setpriv to ``uid``."""
    repo = Path(__file__).resolve().parents[1]
    keep = sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), str(repo)})
    args = [shutil.which("bwrap"), "--dev-bind", "/", "/", "--tmpfs", "/root"]
    made = set()
    for path in keep:
        if path.startswith("/root/"):
            for parent in map(str, reversed(Path(path).parents)):
                if parent.startswith("/root/") and parent not in made and parent not in keep:
                    made.add(parent)
                    args += ["--perms", "0755", "--dir", parent]
            args += ["--ro-bind", path, path]
    setpriv = [shutil.which("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    pytest_args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", __file__]
    return args + setpriv + pytest_args + ["-k", "not normal_user and not negative_control"]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="this run already is a normal user's")
def test_the_corpus_passes_as_a_normal_user():
    here = Path(__file__).resolve()
    closed = [str(d) for d in here.parents if not d.stat().st_mode & 0o001]  # others may not enter it
    assert not closed, f"the normal user cannot read the checkout: {closed} (clone into a folder others can read)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update(HOME="/tmp", PYTHONPATH=os.pathsep.join(p for p in sys.path if p), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run(
        _as_normal_user_command(1000), env=env, cwd="/tmp", capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-500:]


@pytest.mark.slow
def test_the_command_line_reports_every_hostile_program_as_an_error(host, tmp_path_factory):
    """``python -m vlm_grpo.tools.sandbox FILE.py`` on the whole corpus (4 at a time): an error or note in the JSON
    last line, and nothing outside changed."""
    options = json.dumps({f.name: getattr(LIMITS, f.name) for f in fields(LIMITS) if f.name != "pool_size"})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    programs = tmp_path_factory.mktemp("programs")
    pending = list(CORPUS)
    running: dict[str, subprocess.Popen] = {}
    records: dict[str, dict] = {}
    while pending or running:
        while pending and len(running) < 4:
            name = pending.pop()
            path = programs / f"{name}.py"
            path.write_text(host.header() + (CORPUS_DIR / f"{name}.py").read_text())
            cmd = [sys.executable, "-m", "vlm_grpo.tools.sandbox", str(path), "--options", options]
            running[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        name = next(iter(running))
        out, err = running.pop(name).communicate(timeout=120)
        assert out.strip(), f"{name}: no output; stderr {err[-500:]}"
        records[name] = json.loads(out.strip().splitlines()[-1])
    for name, record in sorted(records.items()):
        received = "\n".join(str(v) for v in (record["stdout"], record["error"], record.get("note")) if v)
        host.assert_untouched(received)
        assert any(alt in received for alt in expectation(name)), (name, received[-500:])
        assert record["error"] or record.get("note") or name in EXPECTED_TO_FINISH, (name, record)
