"""One generic registry for every pluggable kind of object (VLM modules, rewards).

Entries are either objects registered with ``@registry.register("name")``, lazy ``"module:attr"``
strings resolved on first use (so importing the package stays cheap), or plugins advertised by
installed packages under an entry-point group. Unknown names fail with the list of known ones.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from collections.abc import Callable, Iterator, Mapping
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Generic, TypeVar

from vlm_grpo.cli_errors import UserError

T = TypeVar("T")


def load_object(spec: str) -> object:
    """Resolve ``"package.module:attr"`` or ``"path/to/file.py:attr"`` to the object it names."""
    if ":" not in spec:
        raise ValueError(f"'{spec}' is not of the form 'module:attr' or 'file.py:attr'")
    target, _, attr = spec.rpartition(":")
    if target.endswith(".py"):
        path = Path(target).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"Plugin file '{target}' (from '{spec}') does not exist")
        module_name = f"vlm_grpo_plugin_{path.stem}_{abs(hash(str(path)))}"
        module = sys.modules.get(module_name)
        if module is None:
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            try:
                module_spec.loader.exec_module(module)
            except ImportError as exc:
                sys.modules.pop(module_name, None)
                raise PluginImportError(cannot_import(target, exc)) from None
            except BaseException:
                # Don't leave a half-initialised module behind for the next lookup to pick up.
                sys.modules.pop(module_name, None)
                raise
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise PluginImportError(cannot_import(target, exc)) from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise PluginError(f"'{target}' has no attribute '{attr}' (from '{spec}')") from None


#: modules EasyR1's example rewards import -> the extra that installs them
EXTRA_OF = {"mathruler": "easyr1", "pylatexenc": "easyr1"}


def cannot_import(target: str, exc: ImportError) -> str:
    """One line: the plugin, the module it could not import, and how to install it."""
    missing = exc.name or str(exc)
    top = missing.split(".")[0]
    extra = EXTRA_OF.get(top)
    hint = f"pip install {top}" + (f" / pip install 'vlm-grpo[{extra}]'" if extra else "")
    if exc.name is None or target == missing:
        return f"{target}: cannot import it ({exc})"
    return f"{target}: cannot import {missing} ({hint})"


class PluginImportError(UserError, ImportError):
    """A plugin whose module (or a module it imports) cannot be imported."""


class PluginError(UserError, AttributeError):
    """A ``file.py:fn`` / ``module:fn`` spec whose module has no such attribute."""


class UnknownEntryError(UserError, KeyError):
    """KeyError whose message prints without the quotes KeyError adds."""

    def __str__(self) -> str:
        return str(self.args[0])


class Registry(Generic[T]):
    """Name -> object map with decorators, lazy entries and entry-point plugins."""

    def __init__(self, kind: str, entry_point_group: str | None = None) -> None:
        self.kind = kind
        self.entry_point_group = entry_point_group
        self._entries: dict[str, T | str] = {}
        self._plugins_loaded = False

    def register(self, name: str, obj: T | str | None = None) -> Callable[[T], T] | None:
        """``@registry.register("name")`` or ``registry.register("name", "module:attr")``."""
        if obj is not None:
            self._add(name, obj)
            return None

        def decorator(target: T) -> T:
            self._add(name, target)
            return target

        return decorator

    def _add(self, name: str, obj: T | str) -> None:
        existing = self._entries.get(name)
        if existing is not None and existing is not obj and not self._replaces_lazy(existing, obj):
            raise ValueError(f"{self.kind} '{name}' is already registered (as {existing!r})")
        self._entries[name] = obj

    @staticmethod
    def _replaces_lazy(existing: object, obj: object) -> bool:
        """A lazy ``"module:attr"`` entry may be replaced by the same spec, or by an object defined in that very
        module (the module registering itself when imported); anything else is a duplicate."""
        if not isinstance(existing, str):
            return False
        if isinstance(obj, str):
            return obj == existing
        target = existing.rpartition(":")[0]
        return not target.endswith(".py") and getattr(obj, "__module__", None) == target

    def _load_plugins(self) -> None:
        if self._plugins_loaded or self.entry_point_group is None:
            return
        self._plugins_loaded = True
        for ep in entry_points(group=self.entry_point_group):
            self._entries.setdefault(ep.name, ep.value)

    def names(self) -> list[str]:
        self._load_plugins()
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        self._load_plugins()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def get(self, name: str) -> T:
        """Look ``name`` up; a ``module:attr`` / ``file.py:attr`` spec not registered is loaded directly."""
        self._load_plugins()
        if name not in self._entries:
            if ":" in name:
                return load_object(name)  # type: ignore[return-value]
            raise UnknownEntryError(f"Unknown {self.kind} '{name}'. Available: {', '.join(self.names())}")
        entry = self._entries[name]
        if isinstance(entry, str):
            entry = load_object(entry)  # type: ignore[assignment]
            self._entries[name] = entry
        return entry  # type: ignore[return-value]


def parse_kwargs_by_name(value: str | Mapping[str, Any] | None, flag: str, example: str) -> dict[str, dict[str, Any]]:
    """``--reward_kwargs`` / ``--tool_kwargs``: JSON text (command line) or a mapping (YAML), entry name ->
    keyword arguments; ``example`` shows the shape in the error."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag} is not valid JSON ({exc.msg}): {value!r}") from None
    if not isinstance(value, Mapping) or not all(isinstance(v, Mapping) for v in value.values()):
        raise ValueError(f"{flag} must map names to keyword arguments, e.g. {example}")
    return {str(k): dict(v) for k, v in value.items()}
