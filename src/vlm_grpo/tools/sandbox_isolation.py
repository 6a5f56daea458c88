"""Operating-system isolation of the python tool's interpreters: the bubblewrap command line and seccomp filters.

Each interpreter runs under ``bwrap`` (Debian/Ubuntu package ``bubblewrap``) in its own user, mount, pid,
network, IPC and UTS namespaces, as uid/gid 65534 both inside and outside its user namespace, with a read-only
view of only the Python installation and the packages it may import, a size-limited tmpfs as its scratch dir,
and two seccomp filters generated with libseccomp (``pyseccomp``): the first, loaded by bwrap before Python
starts, refuses ``ptrace``, ``mount``, namespaces, ``bpf``, ``perf_event_open``, keyrings, io_uring and every
socket family but ``AF_UNIX``; the second, loaded by the interpreter once it has started, refuses ``execve``,
``execveat`` and any ``clone`` that is not a thread.

Run as root (the usual training host), a first bwrap as root only builds the read-only view (so paths under
``/root``, e.g. a pyenv or conda Python, can be shown), drops to uid 65534 with ``setpriv`` and starts the
unprivileged bwrap that makes every namespace: the code never runs as uid 0 anywhere.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

NOBODY = 65534
SCRATCH = "/tmp"  # the interpreter's working dir inside the sandbox: a size-limited tmpfs
WORKER_PATH = "/opt/vlm_grpo_sandbox/worker.py"
# What the code may import, and what those import (matplotlib's own dependencies included).
PACKAGES = (
    "numpy", "PIL", "matplotlib", "mpl_toolkits", "contourpy", "cycler", "fontTools", "kiwisolver", "dateutil",
    "pyparsing", "packaging", "six", "cv2", "scipy",
)  # fmt: skip

# Refused for the whole life of the interpreter (loaded by bwrap before Python starts).
DENIED_ALWAYS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "mount", "umount2", "pivot_root", "chroot", "move_mount",
    "open_tree", "fsopen", "fsmount", "fsconfig", "fspick", "mount_setattr", "unshare", "setns", "bpf",
    "perf_event_open", "keyctl", "add_key", "request_key", "kexec_load", "kexec_file_load", "init_module",
    "finit_module", "delete_module", "reboot", "swapon", "swapoff", "acct", "settimeofday", "clock_settime",
    "clock_adjtime", "adjtimex", "quotactl", "userfaultfd", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "open_by_handle_at", "name_to_handle_at", "personality", "lookup_dcookie",
    "fanotify_init", "syslog", "vhangup", "iopl", "ioperm", "pidfd_getfd", "kcmp", "process_madvise",
)  # fmt: skip
# Refused once the interpreter has started (loaded by the interpreter itself, after its one fork).
DENIED_AFTER_START = ("execve", "execveat", "fork", "vfork")
CLONE_THREAD = 0x00010000
CLONE_NEW = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)
AF_UNIX = 1


class IsolationMissing(RuntimeError):
    """A layer of the isolation is unavailable here; the message says what to install or enable."""


def _problems() -> list[str]:
    """Everything missing for the full isolation, each with how to get it (empty: all there)."""
    problems = []
    if not sys.platform.startswith("linux"):
        return [f"the sandbox needs Linux namespaces; this is {sys.platform}"]
    if shutil.which("bwrap") is None:
        problems.append("bubblewrap is not installed (apt-get install bubblewrap, or dnf install bubblewrap)")
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        problems.append("setpriv is not installed (apt-get install util-linux)")
    for path, want, fix in (
        ("/proc/sys/kernel/unprivileged_userns_clone", "1", "sysctl -w kernel.unprivileged_userns_clone=1"),
        ("/proc/sys/user/max_user_namespaces", None, "sysctl -w user.max_user_namespaces=15000"),
    ):  # fmt: skip
        try:
            value = Path(path).read_text().strip()
        except OSError:
            continue
        if (want is None and value == "0") or (want is not None and value != want):
            problems.append(f"user namespaces are off ({path} = {value}; enable them: {fix})")
    try:
        import pyseccomp  # noqa: F401
    except ImportError:
        problems.append("the seccomp binding is missing (pip install pyseccomp)")
    except (OSError, AttributeError) as exc:  # the binding is there, libseccomp is not
        problems.append(f"libseccomp is missing ({exc}; apt-get install libseccomp2)")
    return problems


@functools.cache
def seccomp_filters() -> tuple[bytes, bytes]:
    """The two BPF programs (always, after start-up), built by libseccomp for this machine's architecture."""
    import pyseccomp as sc

    eperm = sc.ERRNO(1)
    always = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED_ALWAYS:
        try:
            always.add_rule(eperm, name)
        except (ValueError, RuntimeError):  # a syscall this architecture does not have
            continue
    always.add_rule(sc.ERRNO(38), "clone3")  # ENOSYS: its flags are behind a pointer; libc falls back to clone
    always.add_rule(sc.ERRNO(97), "socket", sc.Arg(0, sc.NE, AF_UNIX))  # EAFNOSUPPORT: no network family
    for flag in CLONE_NEW:  # a new namespace of any kind, thread or not
        always.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    after = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED_AFTER_START:
        try:
            after.add_rule(eperm, name)
        except (ValueError, RuntimeError):
            continue
    after.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, 0))  # a process, not a thread
    return _export(always), _export(after)


def _export(filt) -> bytes:
    read, write = os.pipe()
    try:
        with open(write, "wb", closefd=False) as stream:
            filt.export_bpf(stream)
    finally:
        os.close(write)
    with open(read, "rb") as stream:
        return stream.read()


@functools.cache
def _package_dirs() -> tuple[str, ...]:
    """The importable packages' folders (and the ``*.libs`` folders of their bundled shared libraries)."""
    dirs = []
    for name in PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue
        if spec.submodule_search_locations:
            dirs += [os.path.realpath(p) for p in spec.submodule_search_locations]
        elif spec.origin:
            dirs.append(os.path.realpath(spec.origin))
    for site in {os.path.dirname(d) for d in dirs}:
        dirs += [os.path.join(site, e) for e in sorted(os.listdir(site)) if e.endswith(".libs")]
    return tuple(sorted(set(dirs)))


@dataclass
class Launch:
    """How to start one isolated interpreter: the command line and the fds it must inherit."""

    argv: list[str]
    pass_fds: tuple[int, ...]
    scratch: str
    site_dirs: list[str]
    filters_to_load: list[bytes]  # loaded by the worker itself (bwrap loaded the first one already)
    closers: list[int]

    def close_fds(self) -> None:
        for fd in self.closers:
            try:
                os.close(fd)
            except OSError:
                pass


def _view(packages: tuple[str, ...], worker: str) -> list[str]:
    """bwrap arguments for the read-only view: system libraries, the Python installation, the packages."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    prefix = os.path.realpath(sys.base_prefix)
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    base_site = os.path.join(stdlib, "site-packages")
    made: set[str] = {"/"}
    bound = ["/usr", prefix]

    def parents(path: str) -> list[str]:
        """Make the missing folders above ``path`` readable by all (bwrap would copy a 0700 ``/root``)."""
        out = []
        for parent in map(str, reversed(Path(path).parents)):
            if parent not in made and not any(parent == b or parent.startswith(b + "/") for b in bound):
                made.add(parent)
                out += ["--perms", "0755", "--dir", parent]
        return out

    if not prefix.startswith("/usr/"):
        args += [*parents(prefix), "--ro-bind", prefix, prefix]
    if os.path.isdir(base_site):
        args += ["--tmpfs", base_site]  # the base Python's own site-packages: hidden, only PACKAGES come back
    for path in packages:
        args += [*parents(path), "--ro-bind", path, path]
    args += [*parents(WORKER_PATH), "--ro-bind", worker, WORKER_PATH]
    return args


def _rebound_under_scratch(paths: list[str]) -> list[str]:
    """bwrap arguments binding again, read-only, the view's folders that lie under the scratch dir (a venv or a
    checkout under ``/tmp``): the scratch tmpfs mounted over ``/tmp`` would hide them."""
    args: list[str] = []
    made: set[str] = set()
    for path in paths:
        if not path.startswith(SCRATCH + "/"):
            continue
        for parent in map(str, reversed(Path(path).parents)):
            if parent.startswith(SCRATCH + "/") and parent not in made:
                made.add(parent)
                args += ["--dir", parent]
        args += ["--ro-bind", path, path]
    return args


def build_launch(worker: str, request_fd: int, reply_fd: int, scratch_mb: int) -> Launch:
    """The command for one interpreter under the full isolation, or :class:`IsolationMissing` saying why not."""
    problems = _problems()
    if problems:
        raise IsolationMissing("; ".join(problems))
    always, after = seccomp_filters()
    filter_fd = os.memfd_create("vlm_grpo_seccomp", 0)
    os.write(filter_fd, always)
    os.lseek(filter_fd, 0, io.SEEK_SET)
    packages = _package_dirs()
    python = os.path.realpath(sys.executable)
    if not os.path.exists(python) or os.path.realpath(sys.base_prefix) not in python:
        python = os.path.join(os.path.realpath(sys.base_prefix), "bin", os.path.basename(python))
    bwrap = shutil.which("bwrap")
    inner = [
        bwrap, "--unshare-all", "--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY), "--hostname",
        "sandbox", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--seccomp", str(filter_fd),
    ]  # fmt: skip
    tail = [
        "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
        "--size", str(int(scratch_mb) * 2**20), "--tmpfs", SCRATCH,
        *_rebound_under_scratch([os.path.realpath(sys.base_prefix), *packages]), "--chdir", SCRATCH,
        python, "-I", "-S", "-B", WORKER_PATH, str(request_fd), str(reply_fd),
    ]  # fmt: skip
    if os.geteuid() == 0:
        # Root builds the view in a mount + pid namespace of its own, then gives up root before the namespaces
        # the code lives in are made: bwrap run by root would map the code's uid to 0 outside.
        outer = [
            bwrap,
            "--unshare-pid",
            "--die-with-parent",
            "--bind",
            "/proc",
            "/proc",
            "--dev",
            "/dev",
            "--dir",
            SCRATCH,
        ]
        setpriv = [shutil.which("setpriv"), f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        argv = outer + _view(packages, worker) + setpriv + inner + ["--ro-bind", "/", "/"] + tail
    else:
        argv = inner + _view(packages, worker) + tail
    return Launch(
        argv=argv,
        pass_fds=(request_fd, reply_fd, filter_fd),
        scratch=SCRATCH,
        site_dirs=sorted({os.path.dirname(p) for p in packages}),
        filters_to_load=[after],
        closers=[filter_fd],
    )


def build_weak_launch(worker: str, request_fd: int, reply_fd: int, scratch: str) -> Launch:
    """The opt-in fallback: a plain interpreter in a temp dir, with rlimits and whatever seccomp is available."""
    try:
        filters = list(seccomp_filters())
    except (ImportError, OSError):
        filters = []
    packages = _package_dirs()
    return Launch(
        argv=[sys.executable, "-I", "-S", "-B", worker, str(request_fd), str(reply_fd)],
        pass_fds=(request_fd, reply_fd),
        scratch=scratch,
        site_dirs=sorted({os.path.dirname(p) for p in packages}),
        filters_to_load=filters,
        closers=[],
    )


def missing() -> list[str]:
    """What is missing for the full isolation on this machine (empty when nothing is)."""
    return _problems()
