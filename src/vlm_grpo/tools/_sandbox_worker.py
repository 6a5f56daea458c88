"""Sandbox worker: one persistent interpreter per rollout (run by vlm_grpo.tools.sandbox, never imported).

Started as ``python -I _sandbox_worker.py CONFIG_JSON`` in its private temp dir with a scrubbed
environment. It cuts itself off the network (new user + network namespace), sets rlimits, preloads
numpy, PIL and the row's images, arms an audit hook, then answers one JSON request per stdin line with
one JSON line on its private copy of stdout. Only the standard library, numpy and PIL are used here.
"""

import ast
import io
import json
import os
import resource
import signal
import sys
import traceback

CONFIG = json.loads(sys.argv[1])
TMP = os.path.realpath(CONFIG["tmp_dir"])
RESPONSES = os.fdopen(os.dup(1), "w", buffering=1)  # our channel; fd 1 and 2 go to /dev/null below
_devnull = os.open(os.devnull, os.O_WRONLY)
os.dup2(_devnull, 1)
os.dup2(_devnull, 2)
BLOCKED_MODULES = ("vlm_grpo", "torch", "transformers", "trl", "accelerate", "deepspeed", "peft", "datasets")


def send(obj):
    RESPONSES.write(json.dumps(obj) + "\n")
    RESPONSES.flush()


def isolate_network():
    """New user + network namespace: only a down loopback, no route anywhere."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newuser, clone_newnet = 0x10000000, 0x40000000
    flags = clone_newnet if os.geteuid() == 0 else clone_newuser | clone_newnet
    if libc.unshare(flags) != 0 and libc.unshare(clone_newuser | clone_newnet) != 0:
        return os.strerror(ctypes.get_errno())
    return None


isolation = {"network_namespace": False, "rlimits": [], "audit_hook": False}
if CONFIG["network_namespace"]:
    problem = isolate_network()
    if problem is None:
        isolation["network_namespace"] = True
    elif CONFIG["require_network_namespace"]:
        send({"fatal": f"unshare(CLONE_NEWUSER | CLONE_NEWNET) failed: {problem}"})
        sys.exit(3)

# Imports the model's code may use, done before the limits (numpy maps large areas at import).
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

LIMITS = {
    "RLIMIT_CPU": (CONFIG["cpu_seconds"], CONFIG["cpu_seconds"]),
    "RLIMIT_AS": (CONFIG["memory_bytes"], CONFIG["memory_bytes"]),
    "RLIMIT_FSIZE": (CONFIG["file_bytes"], CONFIG["file_bytes"]),
    "RLIMIT_NOFILE": (CONFIG["open_files"], CONFIG["open_files"]),
    "RLIMIT_NPROC": (0, 0),  # no new processes (root ignores it: the audit hook blocks fork and exec)
    "RLIMIT_CORE": (0, 0),
}
for name, value in LIMITS.items():
    try:
        resource.setrlimit(getattr(resource, name), value)
        isolation["rlimits"].append(name)
    except (ValueError, OSError):
        pass

IMAGES = []


def load_images(paths):
    """The rollout's images, written into the working dir by the parent; read, then removed."""
    IMAGES[:] = [Image.open(p).convert("RGB") for p in paths]
    for p in paths:
        os.remove(p)
    NAMESPACE["images"] = IMAGES
    NAMESPACE["image"] = IMAGES[0] if IMAGES else None
    for i, img in enumerate(IMAGES):
        NAMESPACE[f"image_{i}"] = img


def arm(tmp, allowed_read):
    """Install the audit hook and import blocker. Their state lives in this closure only: the hook cannot be
    removed, and the introspection that could reach it (gc, frames) is refused by the hook itself."""
    realpath, fsdecode, write_flags = os.path.realpath, os.fsdecode, os.O_WRONLY | os.O_RDWR | os.O_CREAT
    write_flags |= os.O_APPEND | os.O_TRUNC
    read_files = frozenset({os.devnull, "/dev/urandom", "/etc/localtime"})
    blocked = BLOCKED_MODULES
    denied = {
        "os.system": "running shell commands",
        "os.exec": "starting programs",
        "os.posix_spawn": "starting programs",
        "os.fork": "creating processes",
        "os.forkpty": "creating processes",
        "subprocess.Popen": "starting programs",
        "pty.spawn": "starting programs",
        "os.kill": "signalling processes",
        "os.killpg": "signalling processes",
        "resource.setrlimit": "changing resource limits",
        "resource.prlimit": "changing resource limits",
        "sys.addaudithook": "adding audit hooks",
        "socket.__new__": "network access",
        "socket.connect": "network access",
        "socket.bind": "network access",
        "socket.getaddrinfo": "network access",
        "socket.gethostbyname": "network access",
        "socket.sendto": "network access",
        "urllib.Request": "network access",
        "webbrowser.open": "opening a browser",
        "os.chdir": "changing directory",
        "gc.get_objects": "introspecting the interpreter",
        "gc.get_referrers": "introspecting the interpreter",
        "gc.get_referents": "introspecting the interpreter",
        "sys._current_frames": "introspecting the interpreter",
    }
    path_events = frozenset({
        "os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.symlink", "os.link",
        "os.truncate", "os.utime", "os.listdir", "os.scandir", "shutil.rmtree", "shutil.copyfile", "shutil.move",
    })  # fmt: skip

    def inside(path, roots):
        real = realpath(path)
        return any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots)

    def check_open(path, mode, flags):
        if isinstance(path, int):
            return
        path = fsdecode(path)
        writes = (mode and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & write_flags)
        if inside(path, (tmp,)):
            return
        if writes:
            raise PermissionError(f"sandbox: writing '{path}' is not allowed; only the working directory is writable")
        if realpath(path) in read_files or inside(path, allowed_read):
            return
        raise PermissionError(f"sandbox: reading '{path}' is not allowed (working directory and Python libraries only)")

    def audit(event, args):
        if event == "open":
            check_open(*args[:3])
        elif event.startswith("ctypes."):
            raise PermissionError("sandbox: ctypes is not allowed")
        elif event == "import" and args[0].split(".")[0] in blocked:
            raise ImportError(f"sandbox: module '{args[0]}' is not available here (numpy and PIL are)")
        elif event in denied:
            raise PermissionError(f"sandbox: {denied[event]} is not allowed ({event})")
        elif event in path_events:
            for path in args:
                if not isinstance(path, (str, bytes, os.PathLike)) or inside(fsdecode(path), (tmp,)):
                    continue
                if event in ("os.listdir", "os.scandir") and inside(fsdecode(path), allowed_read):
                    continue
                raise PermissionError(f"sandbox: {event} on '{fsdecode(path)}' is not allowed outside the working dir")

    class BlockImports:
        """Meta-path finder refusing the trainer's packages, whatever sys.path holds."""

        blocked = tuple(BLOCKED_MODULES)  # its own copy: the audit hook's closure is not reachable from here

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.blocked:
                raise ImportError(f"sandbox: module '{name}' is not available here (numpy and PIL are)")
            return None

    sys.meta_path.insert(0, BlockImports())
    sys.addaudithook(audit)


class Capped(io.TextIOBase):
    """stdout / stderr that keeps the first ``limit`` characters and counts the rest."""

    def __init__(self, limit):
        self.limit, self.parts, self.size, self.dropped = limit, [], 0, 0

    def write(self, s):
        s = str(s)
        room = self.limit - self.size
        if room > 0:
            self.parts.append(s[:room])
            self.size += min(room, len(s))
        self.dropped += max(0, len(s) - max(room, 0))
        return len(s)

    def text(self):
        out = "".join(self.parts)
        if self.dropped:
            out += f"\n[... {self.dropped} more characters of output were cut]"
        return out


shown = []


def display(*objs):
    """Show an image (PIL image or numpy array) to the model; other objects are printed."""
    for obj in objs:
        if isinstance(obj, np.ndarray) and obj.ndim in (2, 3):
            obj = Image.fromarray(obj.astype(np.uint8) if obj.dtype != np.uint8 else obj)
        if isinstance(obj, Image.Image):
            shown.append(obj)
        else:
            print(repr(obj))


Image.Image.show = lambda self, *a, **k: display(self)  # img.show() shows to the model
NAMESPACE = {
    "__name__": "__main__",
    "np": np,
    "Image": Image,
    "display": display,
}
load_images(CONFIG["images"])


def is_image_list(value):
    return isinstance(value, (list, tuple)) and value and all(isinstance(v, Image.Image) for v in value)


def run(code, call):
    del shown[:]
    out = Capped(CONFIG["max_output_chars"])
    error = None
    old = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = out
    try:
        tree = ast.parse(code, "<code>")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<code>", "exec"), NAMESPACE)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<code>", "eval"), NAMESPACE)
            if isinstance(value, Image.Image) or is_image_list(value):
                display(*(value if isinstance(value, (list, tuple)) else [value]))
            elif value is not None:
                print(repr(value))
    except BaseException as exc:  # SystemExit, KeyboardInterrupt and MemoryError included: the session goes on
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        lines = [line for line in lines if "_sandbox_worker.py" not in line]
        error = "".join(lines[-6:]).strip()
    finally:
        sys.stdout, sys.stderr = old
    paths, note = [], ""
    keep = shown[: CONFIG["max_images"]]
    if len(shown) > len(keep):
        note = f"{len(shown) - len(keep)} more images were dropped (at most {CONFIG['max_images']} per call)"
    for j, img in enumerate(keep):
        img = img.convert("RGB")
        limit = CONFIG["max_image_pixels"]
        if img.width * img.height > limit:
            scale = (limit / (img.width * img.height)) ** 0.5
            img = img.resize((max(1, int(img.width * scale)), max(1, int(img.height * scale))))
        path = os.path.join(TMP, f".out_{call}_{j}.png")
        try:
            img.save(path)
            paths.append(path)
        except BaseException as exc:
            note = (note + "; " if note else "") + f"an image could not be returned: {type(exc).__name__}"
    del shown[:]
    return {"stdout": out.text(), "images": paths, "error": error, "note": note or None}


signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-large file fails the write instead of killing us
arm(TMP, tuple({os.path.realpath(p) for p in [sys.prefix, sys.base_prefix, *sys.path] if p and os.path.exists(p)}))
del arm
isolation["audit_hook"] = True
send({"ready": True, "isolation": isolation})
call = 0
REQUESTS = sys.stdin
sys.stdin = io.StringIO("")  # input() in the model's code gets EOF, not our next request
for line in REQUESTS:
    call += 1
    try:
        request = json.loads(line)
    except ValueError:
        send({"stdout": "", "images": [], "error": "sandbox: malformed request", "note": None})
        continue
    if "images" in request:  # a pooled worker receives its rollout's images once, before any code
        try:
            load_images(request["images"])
            send({"loaded": len(IMAGES)})
        except Exception as exc:
            send({"fatal": f"could not load the images: {type(exc).__name__}: {exc}"})
        continue
    send(run(request.get("code", ""), call))
