"""The ``python`` tool (PyVision): the model's code runs in a sandboxed interpreter kept for its rollout."""

from __future__ import annotations

from typing import Any

from vlm_grpo.tools.base import ToolEnvironment, ToolError
from vlm_grpo.tools.sandbox import SandboxLimits, get_pool


def python(env: ToolEnvironment, code: str) -> list:
    """Run Python code in a notebook-like session that keeps its variables for this conversation.

    The conversation's images are preloaded: `images` (a list of PIL images), `image` (the first one),
    `image_0`, `image_1`, ...; numpy is `np` and PIL's Image class is `Image`. Printed output comes back;
    to look at an image, call `display(img)` or end the code with an expression that is an image.

    Args:
        code: The Python code to run.
    """
    if not isinstance(code, str) or not code.strip():
        raise ToolError("code must be a non-empty string of Python code")
    limits = SandboxLimits.from_options(env._tool_options("python"))
    session = env.state.get("python")
    if session is None or not session.alive:
        session = env.state["python"] = get_pool(limits).acquire(env.images)
    result = session.run(code)
    if result.timed_out:
        env.timeouts += 1
    if result.error is not None:
        printed = f"{result.stdout}\n" if result.stdout else ""
        raise ToolError(f"{printed}{result.error}")
    content: list[dict[str, Any]] = []
    text = result.stdout
    if result.note:
        text = f"{text}\n[{result.note}]" if text else f"[{result.note}]"
    if result.images:
        indices = [env._add_image(image) for image in result.images]
        text = f"{text}\n" if text else ""
        text += f"[{len(indices)} image(s) shown: image {', '.join(map(str, indices))}]"
    content.append({"type": "text", "text": text or "(no output)"})
    content += [{"type": "image", "image": image} for image in result.images]
    return content


def _setup(options: dict[str, Any]) -> None:
    """Start the sandbox pool when the run starts: a missing isolation layer fails here, not mid-rollout."""
    get_pool(SandboxLimits.from_options(options))


python.setup = _setup  # type: ignore[attr-defined]
python.parallel = True  # type: ignore[attr-defined]  # a batch's rollouts run their cells at the same time
