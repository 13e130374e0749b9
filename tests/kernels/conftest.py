"""Kernel tests run the Triton kernels on CPU under the interpreter.

`make test` runs this folder in its own pytest process (tests/run_all.py), so a crash inside the
interpreter (an unmasked out-of-bounds load segfaults) fails this group without taking the
others down. The variable must be set before triton is first imported.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
# The interpreter's tiles are small numpy arrays: extra BLAS threads only burn a shared CPU.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded generator per test: fresh random inputs, reproducible failures."""
    return torch.Generator().manual_seed(1234)
