"""Launching a Triton kernel straight to its compiled binary.

``kernel[grid](*args)`` runs ``JITFunction.run`` on every call: it looks up the device and stream,
binds the arguments, turns the specialization and the options into a string key, checks the
kernel's globals, builds launch metadata and only then calls the binary's launcher, tens of
microseconds of Python for a kernel that may run for a few. An eager decode step launches several
such kernels per layer.

:class:`KernelLauncher` keeps what a call needs from one specialization to the next. Each call
still binds its arguments with the kernel's own Triton binder, so it sees exactly the
specialization Triton would compute (argument dtypes, 16-byte alignment of pointers, integers
equal to 1 or divisible by 16, 32- or 64-bit integers, every constexpr) and, with the options
(``num_warps``, ``num_stages``, ...) and the device, that is the key of its table of binaries. A
key seen before launches its binary directly; a new one goes through ``kernel[grid]``, which
compiles if needed and launches, and its binary is kept. Triton's interpreter, a launch hook
(profilers such as proton install one), a pre-run hook on the kernel and ``direct_launches(False)``
take the plain path always.

What the direct path skips is assumed fixed for the life of the process: Triton's debug and
instrumentation knobs, and the kernel's globals.

:meth:`KernelLauncher.bind` goes one step further for a caller that launches the same shapes
again and again: it keeps one launch (binary, grid, every argument) as a :class:`BoundLaunch`, which
repeats it with new values for the arguments named variable, with no binding at all. The caller
owns the specialization then: the key under which it keeps a bound launch must hold what Triton
would specialize on (dtypes, pointer alignment, integer values).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

_direct = True


@contextmanager
def direct_launches(enabled: bool) -> Iterator[None]:
    """Within the block, every :class:`KernelLauncher` launches directly (True) or through
    ``kernel[grid]`` (False); for comparing the two."""
    global _direct
    previous, _direct = _direct, enabled
    try:
        yield
    finally:
        _direct = previous


def launches_direct() -> bool:
    """Whether launches go to kept binaries (see :func:`direct_launches`)."""
    return _direct


def current_stream(device: int) -> int:
    """The handle of CUDA device ``device``'s current stream, as Triton's launches read it."""
    return _device_and_stream()[1](device)


@functools.cache
def _device_and_stream() -> tuple[Callable[[], int], Callable[[int], int]]:
    """The active driver's current-device and current-stream functions (what ``JITFunction.run`` uses)."""
    active = driver.active
    return active.get_current_device, active.get_current_stream


def _launch_hooked() -> bool:
    """Whether a launch hook is installed (Triton 3.6 keeps empty hook chains where none is)."""
    runtime = knobs.runtime
    return any(hook is not None and getattr(hook, "calls", True)
               for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook))


@dataclass
class BoundLaunch:
    """One launch of a compiled binary kept by :meth:`KernelLauncher.bind`: its grid and arguments,
    with the variable ones' places (``slots``, one tuple of positions per variable) emptied."""

    binary: Any
    grid: tuple[int, int, int]
    args: list[Any]
    slots: tuple[tuple[int, ...], ...]

    def launch(self, stream: int, *values: Any) -> None:
        """Launches on ``stream`` with ``values`` for the variable arguments, in their order."""
        args = self.args.copy()
        for positions, value in zip(self.slots, values):
            for position in positions:
                args[position] = value
        binary = self.binary
        binary.run(*self.grid, stream, binary.function, binary.packed_metadata, None, None, None, *args)


class KernelLauncher:
    """``KernelLauncher(kernel)[grid](*args, **kwargs)`` launches as ``kernel[grid](*args, **kwargs)``."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        # An interpreted kernel (TRITON_INTERPRET=1) is not a JITFunction and has no binary.
        self._compiled = isinstance(kernel, JITFunction)
        self._binaries: dict[tuple, Any] = {}

    def __getitem__(self, grid: Sequence[int]) -> Callable[..., None]:
        return functools.partial(self.launch, grid)

    def launch(self, grid: Sequence[int], *args: Any, **kwargs: Any) -> None:
        if not (_direct and self._compiled) or self.kernel.pre_run_hooks or _launch_hooked():
            self.kernel[grid](*args, **kwargs)
            return
        current_device, current_stream = _device_and_stream()
        device = current_device()
        binder = self.kernel.device_caches[device][-1]
        bound, specialization, options = binder(*args, **kwargs)
        key = (device, *specialization, *options.items())
        binary = self._binaries.get(key)
        if binary is None:
            self._first_launch(key, grid, args, kwargs)
            return
        binary.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                   current_stream(device), binary.function, binary.packed_metadata, None, None, None,
                   *bound.values())

    def bind(self, grid: Sequence[int], variable: Sequence[Any], *args: Any, **kwargs: Any) -> BoundLaunch | None:
        """Launches as ``self[grid](*args, **kwargs)``, and returns that launch kept for repeating with
        new values of the ``variable`` arguments (objects among ``args``: each of their occurrences
        is replaced; a None variable stands for nothing); None where launches take the plain path
        (see the module's docstring), which the caller then keeps taking. A kept launch passes no
        launch hook: one installed later does not see it."""
        self.launch(grid, *args, **kwargs)
        if not (_direct and self._compiled) or self.kernel.pre_run_hooks or _launch_hooked():
            return None
        current_device, _ = _device_and_stream()
        device = current_device()
        bound, specialization, options = self.kernel.device_caches[device][-1](*args, **kwargs)
        binary = self._binaries.get((device, *specialization, *options.items()))
        if binary is None:
            return None
        values = list(bound.values())
        slots = tuple(() if var is None else tuple(i for i, value in enumerate(values) if value is var)
                      for var in variable)
        for positions in slots:  # the kept launch must not keep the first call's tensors alive
            for position in positions:
                values[position] = None
        grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        return BoundLaunch(binary, grid3, values, slots)

    def _first_launch(self, key: tuple, grid: Sequence[int], args: tuple, kwargs: dict[str, Any]) -> None:
        binary = self.kernel[grid](*args, **kwargs)
        if hasattr(binary, "result"):  # Triton's asynchronous compilation mode
            binary = binary.result()
        if binary is not None:  # None: a cache hook stopped the launch; nothing to keep
            self._binaries[key] = binary
