"""Compiled-with-eager-fallback wrapper shared by the compiled decode step and the compiled decoder layers."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vlm_grpo.utils import warn_once


class EagerOnFailure:
    """Calls ``compiled`` until it raises one of ``errors``; then warns once and calls ``eager`` from there on.

    Compilation happens on the first call, before the function has written anything, so a machine whose
    compiler toolchain is broken still trains, with the eager numbers.
    """

    def __init__(
        self,
        compiled: Callable,
        eager: Callable,
        log: logging.Logger,
        what: str,
        errors: type[BaseException] | tuple[type[BaseException], ...] = Exception,
    ) -> None:
        self.fn, self.eager, self.log, self.what, self.errors = compiled, eager, log, what, errors

    @property
    def compiled(self) -> bool:
        return self.fn is not self.eager

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.compiled:
            try:
                return self.fn(*args, **kwargs)
            except self.errors as err:
                warn_once(self.log, f"{self.what} ({type(err).__name__}: {err}); eager")
                self.fn = self.eager
        return self.eager(*args, **kwargs)
