"""The per-rollout tool environment handed to TRL's ``environment_factory``, and tool options.

TRL's experimental tool loop makes one environment instance per rollout, calls ``reset(**row)`` before the
rollout and exposes the instance's public methods as tools. :func:`make_environment_factory` builds such a
class from the chosen tool functions, so every tool sees the row's images (by index), its own
``--tool_kwargs`` options and state that lives for one rollout (the Python sandbox's interpreter).
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future, wait
from typing import Any, ClassVar

from vlm_grpo.registry import parse_kwargs_by_name

logger = logging.getLogger(__name__)

ToolFunc = Callable[..., Any]
CoordSize = Callable[[int, int], tuple[int, int]]

# The hidden tool that answers a malformed ``<tool_call>`` block with an error (see vlm_grpo.tools.rollouts).
MALFORMED_CALL = "malformed_tool_call"
_RESERVED = {"reset", "get_reward", MALFORMED_CALL}


class ToolError(Exception):
    """A bad argument or a failed call: its message goes back to the model as the tool result."""


def parse_tool_kwargs(value: str | Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """``--tool_kwargs``: tool name -> options."""
    return parse_kwargs_by_name(value, "--tool_kwargs", '{"python": {"timeout": 10}}')


class ToolEnvironment:
    """State of one rollout: the row's images (tools may add more), per-tool state and call counters.

    Images are numbered in order: the prompt's images first (0, 1, ...), then every image a tool returned.
    """

    _options: ClassVar[dict[str, dict[str, Any]]] = {}
    _coord_size: ClassVar[CoordSize | None] = None
    _tool_order: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self.images: list[Any] = []
        self.prompt_images = 0
        self.coord_sizes: list[tuple[int, int]] = []
        self.row: dict[str, Any] = {}
        self.state: dict[str, Any] = {}
        self.calls = 0
        self.errors = 0
        self.successes = 0
        self.timeouts = 0
        self._prefetched: dict[str, list[Future]] = {}
        self._batch: Any = None  # the trainer's ToolBatch while TRL's tool loop runs
        self._ahead = False  # the calls of its last turn started as the turn ended (vlm_grpo.tools.early_calls)

    def reset(self, **row: Any) -> None:
        """Start a rollout: drop the previous rollout's state, take this row's images."""
        wait([f for futures in self._prefetched.values() for f in futures])  # calls TRL never collected
        self._close_state()
        self.row = row
        self.images = list(row.get("images") or [])
        self.prompt_images = len(self.images)
        sizes = row.get("coord_sizes") or []
        self.coord_sizes = [tuple(s) for s in sizes] if len(sizes) == len(self.images) else []
        if not self.coord_sizes:
            self.coord_sizes = [self._frame(img) for img in self.images]
        self.calls = self.errors = self.successes = self.timeouts = 0
        self._prefetched = {}
        self._ahead = False
        return None

    def _prefetch(self, calls: Sequence[tuple[str, dict[str, Any]]], executor: Executor) -> bool:
        """Start this rollout's calls now, in order, in one thread; the method calls TRL makes later collect
        the results. Lets the rollouts of a batch run slow tools (the sandbox) at the same time."""
        jobs = []
        for name, arguments in calls:
            future: Future = Future()
            self._prefetched.setdefault(call_key(name, arguments), []).append(future)
            jobs.append((getattr(type(self), name).tool_function, arguments, future))

        def run_in_order() -> None:
            for fn, arguments, future in jobs:
                try:
                    future.set_result(run_tool(self, fn, arguments))
                except BaseException as exc:
                    future.set_exception(exc)

        executor.submit(run_in_order)
        return bool(jobs)

    def _frame(self, image: Any) -> tuple[int, int]:
        width, height = image.size
        coord = type(self)._coord_size
        return tuple(coord(width, height)) if coord is not None else (width, height)

    def _tool_options(self, name: str) -> dict[str, Any]:
        return self._options.get(name, {})

    def _image(self, index: Any) -> Any:
        """The image the model names by index, or a ToolError listing the valid ones."""
        if isinstance(index, bool) or not isinstance(index, (int, float)) or int(index) != index:
            raise ToolError(f"image_index must be an integer, got {index!r}")
        index = int(index)
        if not self.images:
            raise ToolError("this conversation has no images")
        if not 0 <= index < len(self.images):
            raise ToolError(f"image_index {index} does not exist: valid indices are 0 to {len(self.images) - 1}")
        return self.images[index]

    def _add_image(self, image: Any) -> int:
        """Record an image a tool returns; later calls can address it by the returned index."""
        self.images.append(image)
        self.coord_sizes.append(self._frame(image))
        return len(self.images) - 1

    def _close_state(self) -> None:
        for value in self.state.values():
            close = getattr(value, "close", None)
            if callable(close):
                close()
        self.state = {}


def call_key(name: str, arguments: Mapping[str, Any]) -> str:
    """Identity of a call (tool name + arguments), to match a prefetched result with TRL's call."""
    return name + json.dumps(arguments, sort_keys=True, default=str)


def run_tool(env: ToolEnvironment, fn: ToolFunc, kwargs: Mapping[str, Any]) -> Any:
    """Run a tool for ``env``: count the call and its outcome; unexpected exceptions become a ToolError."""
    name = fn.__name__
    env.calls += 1
    try:
        result = fn(env, **kwargs)
    except ToolError:
        env.errors += 1
        raise
    except TypeError as exc:  # the model named arguments the tool does not have, or left one out
        env.errors += 1
        raise ToolError(f"bad arguments for {name}: {exc}") from None
    except Exception as exc:
        env.errors += 1
        logger.debug("tool %s failed", name, exc_info=True)
        raise ToolError(f"{name} failed: {type(exc).__name__}: {exc}") from None
    env.successes += 1
    return result


def _as_method(fn: ToolFunc) -> Callable[..., Any]:
    """The tool as an environment method; a result started ahead (:meth:`ToolEnvironment._prefetch`) is used."""
    name = fn.__name__
    positional = list(inspect.signature(fn).parameters)[1:]

    @functools.wraps(fn)
    def method(self: ToolEnvironment, *args: Any, **kwargs: Any) -> Any:
        if args:  # TRL passes keywords; Python callers may not
            if len(args) > len(positional):
                raise ToolError(f"{name} takes {len(positional)} arguments, got {len(args)}")
            kwargs = {**dict(zip(positional, args, strict=False)), **kwargs}
        key = call_key(name, kwargs)
        if not self._prefetched.get(key) and self._batch is not None and getattr(fn, "parallel", False):
            self._batch.prefetch()  # a new round of TRL's loop: start every rollout's calls together
        pending = self._prefetched.get(key)
        if pending:
            return pending.pop(0).result()
        return run_tool(self, fn, kwargs)

    method.tool_function = fn  # type: ignore[attr-defined]

    # The schema shown to the model comes from the bound method: leave the environment parameter out of it.
    receiver = next(iter(inspect.signature(fn).parameters), None)
    method.__annotations__ = {k: v for k, v in fn.__annotations__.items() if k != receiver}
    return method


def make_environment_factory(
    tools: Sequence[ToolFunc],
    tool_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    coord_size: CoordSize | None = None,
) -> type[ToolEnvironment]:
    """A :class:`ToolEnvironment` subclass with ``tools`` as methods (the class itself is the factory).

    ``tool_kwargs`` maps a tool's name to its options; ``coord_size(w, h)`` gives the frame in which the
    model writes box coordinates for an image of that size (the model family's; default: pixels).
    """
    methods: dict[str, Any] = {}
    for fn in tools:
        name = getattr(fn, "__name__", None)
        if not callable(fn) or not name or not name.isidentifier() or name.startswith("_") or name in _RESERVED:
            raise ValueError(
                f"{fn!r} cannot be a tool: it needs a public function name other than {', '.join(sorted(_RESERVED))}"
            )
        if name in methods:
            raise ValueError(f"Two tools are named '{name}'")
        methods[name] = _as_method(fn)
    options = {k: dict(v) for k, v in (tool_kwargs or {}).items()}
    unknown = set(options) - set(methods)
    if unknown:
        raise ValueError(f"--tool_kwargs names tools that are not in --tools: {', '.join(sorted(unknown))}")
    for fn in tools:  # a tool may check its options and start its resources once, when the run starts
        setup = getattr(fn, "setup", None)
        if callable(setup):
            setup(options.get(fn.__name__, {}))
    attrs: dict[str, Any] = {"_options": options, "__doc__": ToolEnvironment.__doc__, **methods}
    attrs["_tool_order"] = tuple(methods)  # the order given: the order the model is shown the tools in
    if coord_size is not None:
        attrs["_coord_size"] = staticmethod(coord_size)
    return type("VLMToolEnvironment", (ToolEnvironment,), attrs)
