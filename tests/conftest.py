"""Shared fixtures."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
#: The benchmarks (``kaisoku_bench``) live beside the library; the tests import them from the checkout, installed
#: or not, and so do the processes the tests start.
BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(BENCHMARKS), os.environ.get("PYTHONPATH", "")) if p
    )


@pytest.fixture(autouse=True)
def _no_leftover_process_group() -> Iterator[None]:
    """Destroy a process group a failed in-process test left behind."""
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def mnist_path() -> Path:
    """The shared MNIST archive (``$KAISOKU_MNIST``, as the benchmarks take it, else ``../shared``); tests
    that need it skip where it is absent."""
    path = Path(os.environ.get("KAISOKU_MNIST") or SHARED_DATA / "mnist.npz")
    if not path.exists():
        pytest.skip(f"{path} not present")
    return path
