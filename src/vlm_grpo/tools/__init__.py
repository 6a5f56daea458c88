"""Tool registry: tools the policy can call during multi-turn rollouts (``--tools zoom_in python``).

A tool is a plain function whose first parameter is the rollout's :class:`ToolEnvironment` (the row's
images, per-tool options, per-rollout state) and whose other parameters, type hints and Google-style
docstring become the JSON schema the chat template shows the model (transformers' ``get_json_schema``).
It returns text, or a list of content blocks (``{"type": "image", "image": PIL}``, ``{"type": "text", ...}``);
it raises :class:`ToolError` for bad arguments, which the model receives as an error message.

Register one with ``@register_tool("name")``; users can also name ``path/to/file.py:fn`` or
``package.module:fn``, and installed packages can advertise tools under the ``vlm_grpo.tools`` entry point.
"""

from __future__ import annotations

from vlm_grpo.registry import Registry
from vlm_grpo.tools.base import (
    ToolEnvironment,
    ToolError,
    ToolFunc,
    make_environment_factory,
    parse_tool_kwargs,
)

TOOLS: Registry[ToolFunc] = Registry("tool", entry_point_group="vlm_grpo.tools")


def register_tool(name: str):
    """Decorator: ``@register_tool("zoom_in")``."""
    return TOOLS.register(name)


# Lazy: importing vlm_grpo does not start sandboxes or import PIL until a run asks for a tool.
TOOLS.register("zoom_in", "vlm_grpo.tools.image:zoom_in")
TOOLS.register("crop", "vlm_grpo.tools.image:crop")
TOOLS.register("rotate", "vlm_grpo.tools.image:rotate")
TOOLS.register("image_zoom_in_tool", "vlm_grpo.tools.image:image_zoom_in_tool")
TOOLS.register("python", "vlm_grpo.tools.python:python")

__all__ = [
    "TOOLS",
    "ToolEnvironment",
    "ToolError",
    "ToolFunc",
    "make_environment_factory",
    "parse_tool_kwargs",
    "register_tool",
]
