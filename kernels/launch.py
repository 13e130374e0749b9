"""A Triton launch as a value, and the key Triton compiles it under.

Triton compiles a kernel once per key: its constexprs, the dtypes of its arguments, and what it
specializes of the rest (a pointer 16-byte aligned, an integer equal to 1 or a multiple of 16,
unless the kernel lists the argument in `do_not_specialize`). A launcher that builds its launches
as values lets a test read those keys for a GPU that is not here, from tensors on the meta
device (always "aligned"), with Triton's own binder: the number of variants a step log produces
is then counted, not guessed (tests/kernels/test_kernel_variants.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Launch:
    """One kernel launch: `kernel[grid](*args, **kwargs)`."""

    kernel: Any  # a triton JITFunction
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.kwargs)

    def compile_key(self, arch: int = 90) -> tuple[str, str]:
        """(kernel name, the key Triton's JIT cache would file this launch under on a CUDA
        device of compute capability `arch`); no GPU needed."""
        bound, specialization, options = _binder(self.kernel, arch)(*self.args, **self.kwargs)
        del bound
        return self.kernel.fn.__name__, repr((specialization, sorted(options.items())))


_BINDERS: dict[tuple[int, int], tuple[Any, Any]] = {}  # (id(kernel), arch) -> (kernel, binder)


def _binder(kernel: Any, arch: int) -> Any:
    # The function Triton's JITFunction.create_binder builds, for a named target instead of the
    # current device's. Cached by identity: a JITFunction's hash is its source's, which the
    # interpreter's helpers cannot give.
    cached = _BINDERS.get((id(kernel), arch))
    if cached is not None:
        return cached[1]
    _BINDERS[(id(kernel), arch)] = (kernel, _make_binder(kernel, arch))
    return _BINDERS[(id(kernel), arch)][1]


def _make_binder(kernel: Any, arch: int) -> Any:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    if not hasattr(kernel, "params"):  # TRITON_INTERPRET: the same function, as the JIT sees it
        from triton.runtime.jit import JITFunction

        kernel = JITFunction(kernel.fn, **kernel.kwargs)
    backend = make_backend(GPUTarget("cuda", arch, 32))
    return create_function_from_signature(kernel.signature, kernel.params, backend)
