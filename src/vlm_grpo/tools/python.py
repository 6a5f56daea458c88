"""The ``python`` tool (PyVision): the model's code runs in a sandboxed interpreter kept for its rollout.

Call interface (stable, what protocol parsers produce): ``python(code=<str>)``. Images in: every image of the
conversation so far (the prompt's, then each one a tool returned, in order) is available to the code as
``image_clue_0, image_clue_1, ...`` (PyVision's names), ``images[i]`` / ``image_i`` and ``image`` (the first).
Images out: what the code shows (``plt.show()``, ``display(x)``, ``img.show()``, or a last expression that is
a PIL image, a matplotlib Figure or an RGB uint8 array) comes back as image content blocks, in the order shown,
and gets the next conversation index, so a later cell reads it as ``image_clue_N``.
"""

from __future__ import annotations

from typing import Any

from vlm_grpo.tools.base import ToolEnvironment, ToolError
from vlm_grpo.tools.sandbox import SandboxLimits, get_pool


def python(env: ToolEnvironment, code: str) -> list:
    """Run Python code in a notebook-like interpreter that keeps its variables for this conversation.

    The conversation's images are preloaded as `image_clue_0`, `image_clue_1`, ... (also `images`, a list,
    and `image`, the first one); numpy is `np`, PIL's Image class is `Image`, matplotlib.pyplot is `plt`.
    Printed output comes back; to look at an image, call `plt.show()` or `display(img)`, or end the code with
    an expression that is an image or a figure.

    Args:
        code: The Python code to run.
    """
    if not isinstance(code, str) or not code.strip():
        raise ToolError("code must be a non-empty string of Python code")
    limits = SandboxLimits.from_options(env._tool_options("python"))
    interp = env.state.get("python")
    if interp is None or not interp.alive:
        if interp is not None:
            interp.close()
        try:
            interp = env.state["python"] = get_pool(limits).acquire([])
        except RuntimeError as exc:
            raise ToolError(f"the Python sandbox could not start: {exc}") from None
    try:
        result = interp.run(code, new_images=env.images[interp.images_sent :])
    except RuntimeError as exc:  # an image of the conversation that cannot be encoded
        raise ToolError(str(exc)) from None
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
        text += f"[{len(indices)} image(s) shown: {', '.join(f'image_clue_{i}' for i in indices)}]"
    content.append({"type": "text", "text": text or "(no output)"})
    content += [{"type": "image", "image": image} for image in result.images]
    return content


def _setup(options: dict[str, Any]) -> None:
    """Start the sandbox pool when the run starts: a missing isolation layer fails here, not mid-rollout."""
    get_pool(SandboxLimits.from_options(options))


python.setup = _setup  # type: ignore[attr-defined]
python.parallel = True  # type: ignore[attr-defined]  # a batch's rollouts run their cells at the same time
