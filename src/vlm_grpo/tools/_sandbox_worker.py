"""Sandbox worker: one persistent interpreter per rollout (started by vlm_grpo.tools.sandbox, never imported).

Started as ``python -I -S _sandbox_worker.py REQUEST_FD REPLY_FD`` inside the isolation of
``sandbox_isolation``. It reads its configuration from REQUEST_FD, imports numpy, PIL (and matplotlib unless
told not to), then forks once, before the seccomp filter that forbids processes is loaded:

- the *supervisor* keeps the trainer's two fds, makes itself undumpable (its memory cannot be read by its
  sibling) and relays: each request frame from the trainer goes to the runner, the runner's answer goes back in
  a frame carrying the request's random nonce and sequence number; a runner that dies is reported as such;
- the *runner* closes every fd but its two pipes to the supervisor, sets the rlimits, then runs the model's
  code cells in one persistent namespace. Model code can reach neither the trainer's fds nor the nonces.

Only the standard library, numpy, PIL and matplotlib are used here.
"""

import ast
import base64
import ctypes
import io
import json
import os
import resource
import signal
import struct
import sys
import traceback

HEADER = struct.Struct("!4s16sQI")  # magic, nonce, sequence number, body length
SMALL = struct.Struct("!I")
REQUEST_FD, REPLY_FD = int(sys.argv[1]), int(sys.argv[2])


def read_exact(fd, n):
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def read_request():
    magic, nonce, seq, size = HEADER.unpack(read_exact(REQUEST_FD, HEADER.size))
    if magic != b"VGRQ":
        raise EOFError
    return nonce, seq, read_exact(REQUEST_FD, size)


def load_filters(filters):
    """Load seccomp BPF programs (built by libseccomp in the trainer) on this process."""
    if not filters:
        return
    libc = ctypes.CDLL(None, use_errno=True)

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    for program in filters:
        code = base64.b64decode(program)
        buf = ctypes.create_string_buffer(code, len(code))
        prog = Prog(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
        if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")


nonce, seq, body = read_request()
CONFIG = json.loads(body)
sys.path.extend(CONFIG["site_dirs"])
os.chdir(CONFIG["scratch"])
import numpy as np  # noqa: E402  (imported before the limits: numpy maps large areas at import)
from PIL import Image  # noqa: E402


def pyplot():
    """matplotlib.pyplot, imported on first use unless preloaded (MPLBACKEND=Agg: nothing opens a window)."""
    import matplotlib.pyplot

    return matplotlib.pyplot


def figure_class():
    """matplotlib's Figure class once matplotlib is imported (None before: no object can be a Figure yet)."""
    module = sys.modules.get("matplotlib.figure")
    return getattr(module, "Figure", None)


class PatchPyplot:
    """Meta-path finder: however pyplot gets imported (by us or the model's code), its ``show`` shows to the model."""

    def find_spec(self, name, path=None, target=None):
        if name != "matplotlib.pyplot":
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module.show = lambda *args, **kwargs: show()  # show and display: defined in the runner below
            sys.modules["matplotlib.figure"].Figure.show = lambda self, *a, **k: display(self)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, PatchPyplot())
if CONFIG.get("preload_matplotlib"):
    try:
        pyplot()
    except ImportError:  # matplotlib is optional
        pass

to_runner_r, to_runner_w = os.pipe()
to_super_r, to_super_w = os.pipe()
RUNNER = os.fork()


def describe(status):
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        why = {
            signal.SIGXCPU: f"its CPU limit of {CONFIG['cpu_seconds']} s for this conversation",
            signal.SIGKILL: "killed, most likely its CPU or memory limit",
            signal.SIGSEGV: "a crash",
            signal.SIGSYS: "a forbidden system call",
        }.get(sig, "a signal")
        return f"signal {signal.Signals(sig).name}: {why}"
    return f"exit status {os.WEXITSTATUS(status)}"


def supervise(request):
    """Relay frames between the trainer and the runner; only this process holds the trainer's fds."""
    os.close(to_runner_r)
    os.close(to_super_w)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: the runner cannot read our memory
    load_filters(CONFIG["filters"])
    cap = int(CONFIG["max_reply_bytes"])
    while True:
        over, answer = False, None
        try:
            (size,) = SMALL.unpack(read_exact(to_super_r, SMALL.size))
            over = size > cap
            answer = None if over else read_exact(to_super_r, size)
        except EOFError:
            pass
        dead = answer is None
        if dead:  # the runner died or broke the protocol: say why, then end the sandbox
            os.kill(RUNNER, signal.SIGKILL)  # a zombie keeps its first cause of death
            _, status = os.waitpid(RUNNER, 0)
            why = f"its reply was over {cap} bytes" if over else describe(status)
            answer = json.dumps({"died": why}).encode()
        write_all(REPLY_FD, HEADER.pack(b"VGRP", request[0], request[1], len(answer)) + answer)
        if dead:
            os._exit(0)
        try:
            got_nonce, got_seq, message = read_request()
        except EOFError:
            os.kill(RUNNER, signal.SIGKILL)
            os._exit(0)
        request = (got_nonce, got_seq)
        write_all(to_runner_w, SMALL.pack(len(message)) + message)


if RUNNER:
    supervise((nonce, seq))

# ---- the runner: everything below runs with the model's code ----
os.close(to_runner_w)
os.close(to_super_r)
for entry in os.listdir("/proc/self/fd"):
    fd = int(entry)
    if fd > 2 and fd not in (to_runner_r, to_super_w):
        try:
            os.close(fd)
        except OSError:
            pass
_devnull = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(_devnull, fd)
os.close(_devnull)
del nonce, seq, body

LIMITS = {
    "RLIMIT_CPU": CONFIG["cpu_seconds"],
    "RLIMIT_AS": CONFIG["memory_bytes"],
    "RLIMIT_FSIZE": CONFIG["file_bytes"],
    "RLIMIT_NOFILE": CONFIG["open_files"],
    "RLIMIT_CORE": 0,
}
if CONFIG.get("max_threads"):
    LIMITS["RLIMIT_NPROC"] = CONFIG["max_threads"]
for name, value in LIMITS.items():
    # The CPU limit's hard value one second later: SIGXCPU (reported as the CPU limit) comes before SIGKILL.
    resource.setrlimit(getattr(resource, name), (value, value + 1 if name == "RLIMIT_CPU" else value))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-large file fails the write instead of killing us
load_filters(CONFIG["filters"])


def answer(obj):
    data = json.dumps(obj).encode()
    write_all(to_super_w, SMALL.pack(len(data)) + data)


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


def figure_image(fig):
    """A matplotlib figure rendered as PyVision renders it (PNG at the figure's dpi), then closed."""
    width, height = fig.get_figwidth() * fig.dpi, fig.get_figheight() * fig.dpi
    if max(width, height) / max(1e-9, min(width, height)) >= 200:
        raise RuntimeError(f"figure aspect ratio too extreme: {width:.0f}x{height:.0f} px (must be under 200:1)")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    pyplot().close(fig)
    buf.seek(0)
    return Image.open(buf).convert("RGB")


def as_image(obj):
    """A PIL image for what the code shows, or None when it is not an image."""
    if isinstance(obj, Image.Image):
        return obj
    if figure_class() is not None and isinstance(obj, figure_class()):
        return figure_image(obj)
    if isinstance(obj, np.ndarray) and (obj.ndim == 2 or (obj.ndim == 3 and obj.shape[2] in (1, 3, 4))):
        array = obj[..., 0] if obj.ndim == 3 and obj.shape[2] == 1 else obj
        if array.dtype != np.uint8:
            array = np.clip(array * (255 if array.dtype.kind == "f" and array.max() <= 1 else 1), 0, 255)
        return Image.fromarray(array.astype(np.uint8))
    return None


def display(*objs):
    """Show images to the model (PIL images, numpy arrays, matplotlib figures); other objects are printed."""
    for obj in objs:
        image = as_image(obj)
        if image is None:
            print(repr(obj))
        else:
            shown.append(image)


def show(*args, **kwargs):
    """``plt.show()``: every open figure is shown to the model, in order, then closed."""
    plt = pyplot()
    for number in plt.get_fignums():
        shown.append(figure_image(plt.figure(number)))


Image.Image.show = lambda self, *a, **k: display(self)


class LazyModule:
    """``plt`` / ``matplotlib`` in the code's namespace: the module itself, imported on first attribute."""

    def __init__(self, name, key):
        self._name, self._key = name, key

    def __getattr__(self, attr):
        import importlib

        module = importlib.import_module(self._name)
        NAMESPACE[self._key] = module
        return getattr(module, attr)


NAMESPACE = {"__name__": "__main__", "np": np, "Image": Image, "display": display, "io": io, "base64": base64}
NAMESPACE.update(plt=LazyModule("matplotlib.pyplot", "plt"), matplotlib=LazyModule("matplotlib", "matplotlib"))
IMAGES = []
NAMESPACE["images"] = IMAGES


def add_images(encoded):
    """The conversation's images, in order: image_clue_0, image_clue_1, ... (and images[i], image_i, image)."""
    for data in encoded:
        index = len(IMAGES)
        img = Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")
        IMAGES.append(img)
        NAMESPACE[f"image_clue_{index}"] = NAMESPACE[f"image_{index}"] = img
    NAMESPACE["image"] = IMAGES[0] if IMAGES else None


def looks_like_image(value):
    if isinstance(value, np.ndarray):
        return value.dtype == np.uint8 and value.ndim == 3 and value.shape[2] in (3, 4)
    if isinstance(value, (list, tuple)):
        return bool(value) and all(isinstance(v, Image.Image) for v in value)
    return isinstance(value, Image.Image) or (figure_class() is not None and isinstance(value, figure_class()))


def run(code):
    del shown[:]
    out = Capped(CONFIG["max_output_chars"])
    error = None
    old = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = out
    try:
        tree = ast.parse(code, "<cell>")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<cell>", "exec"), NAMESPACE)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), NAMESPACE)
            if looks_like_image(value):
                display(*(value if isinstance(value, (list, tuple)) else [value]))
            elif value is not None:
                print(repr(value))
    except BaseException as exc:  # SystemExit, KeyboardInterrupt and MemoryError included: the interpreter goes on
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        lines = [line for line in lines if "worker.py" not in line]
        error = "".join(lines[-6:]).strip()
        if "matplotlib.pyplot" in sys.modules:
            pyplot().close("all")  # as PyVision: a failed cell leaves no half-drawn figure behind
    finally:
        sys.stdout, sys.stderr = old
    encoded, note = [], ""
    keep = shown[: CONFIG["max_images"]]
    if len(shown) > len(keep):
        note = f"{len(shown) - len(keep)} more images were dropped (at most {CONFIG['max_images']} per call)"
    for img in keep:
        try:
            img = img.convert("RGB")
            limit = CONFIG["max_image_pixels"]
            if img.width * img.height > limit:
                scale = (limit / (img.width * img.height)) ** 0.5
                img = img.resize((max(1, int(img.width * scale)), max(1, int(img.height * scale))))
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            encoded.append(base64.b64encode(buf.getvalue()).decode())
        except BaseException as exc:
            note = (note + "; " if note else "") + f"an image could not be returned: {type(exc).__name__}"
    del shown[:]
    return {"stdout": out.text(), "images": encoded, "error": error, "note": note or None}


sys.stdin = io.StringIO("")  # input() in the model's code gets EOF
answer({"ready": True, "threads_limit": CONFIG.get("max_threads")})
while True:
    try:
        (size,) = SMALL.unpack(read_exact(to_runner_r, SMALL.size))
        request = json.loads(read_exact(to_runner_r, size))
    except (EOFError, ValueError):
        os._exit(0)
    if "images" in request:
        try:
            add_images(request["images"])
        except Exception as exc:
            answer({"stdout": "", "images": [], "error": f"an image could not be loaded: {exc}", "note": None})
            continue
    if "code" in request:
        answer(run(request["code"]))
    else:
        answer({"loaded": len(IMAGES)})
