"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest


class TinyModels(Mapping[str, Path]):
    """family -> folder of a tiny random checkpoint, built on first access and kept for the session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._built: dict[str, Path] = {}

    def __getitem__(self, family: str) -> Path:
        from vlm_grpo.testing.tiny import FAMILIES, build_tiny_model

        if family not in FAMILIES:
            raise KeyError(family)
        if family not in self._built:
            self._built[family] = build_tiny_model(family, self.root / family, seed=0)
        return self._built[family]

    def __iter__(self) -> Iterator[str]:
        from vlm_grpo.testing.tiny import FAMILIES

        return iter(FAMILIES)

    def __len__(self) -> int:
        from vlm_grpo.testing.tiny import FAMILIES

        return len(FAMILIES)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModels:
    """Tiny checkpoints of every family (``tiny_models["qwen2_5_vl"]`` is a folder), built lazily once."""
    return TinyModels(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one thread, and do not slow down when the machine is busy
    (use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Code under test may set process-wide switches (``WANDB_MODE=offline`` for a wandb run without a key):
    each test starts from the environment the session started with."""
    import os

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
