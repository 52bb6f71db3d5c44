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
would specialize on (dtypes, pointer alignment, integer values). :class:`LaunchPlans` keeps a
sequence of such launches per key, with its scratch buffers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
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

    def traced(self, enabled: bool = True) -> Any:
        """With ``enabled``, the kernel wrapped by ``torch.library.wrap_triton`` (indexed by a grid the
        same way), for the body of a ``torch.library.triton_op``: under ``torch.compile`` inductor
        traces the kernel itself into its graph and launches it from the code it generates. Else this
        launcher."""
        if not enabled:
            return self
        from torch.library import wrap_triton

        return wrap_triton(self.kernel)

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
        if not _distinct(variable):
            raise ValueError("variable arguments must be distinct objects: one that stands for two could not "
                             "take two values")
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


# A launch as a call writes it: (launcher, grid, args, kwargs).
Launch = tuple[KernelLauncher, Sequence[int], Sequence[Any], dict[str, Any]]
# Scratch buffers a sequence of launches needs: (shape, dtype) each.
ScratchSpec = list[tuple[tuple[int, ...], torch.dtype]]
# What :meth:`LaunchPlans.launch` asks for a key it has not seen: the scratch, and the launches on it.
PlanBuilder = Callable[[], tuple[ScratchSpec, Callable[[list[torch.Tensor]], list[Launch]]]]


class LaunchPlans:
    """Kernel sequences kept per call shape (:meth:`KernelLauncher.bind`): a repeated call is its
    binaries' launches, with no argument binding, size arithmetic or scratch allocation.

    The caller names each call's ``variable`` tensors (inputs and outputs that change from call to
    call, as the launches receive them; None for an absent one) and a key that holds everything else its launches' arguments
    depend on (sizes, strides, dtypes, flags); the plan's key adds the device, the current stream,
    whether direct launches are on, and each variable pointer's 16-byte alignment (which Triton
    specializes on). Scratch buffers are carved from one arena per device and stream: launches on
    one stream never overlap, so a plan per batch size holds no memory of its own. A call off CUDA or
    under stream capture, or whose launches take the plain path, launches through its launchers
    with scratch of its own.
    """

    def __init__(self) -> None:
        self._plans: dict[tuple, list[BoundLaunch] | None] = {}
        self._arenas: dict[tuple[int, int], torch.Tensor] = {}

    def launch(self, device: torch.device, key: tuple, variable: Sequence[torch.Tensor | None],
               build: PlanBuilder) -> None:
        if not self._keeps(device):
            self._plain(device, build)
            return
        stream_key = (device.index, current_stream(device.index))
        full_key = (*stream_key, _direct, *key, *(-1 if t is None else t.data_ptr() % 16 for t in variable))
        plan = self._plans.get(full_key, self)  # self: not seen
        if plan is self and _distinct(variable):
            scratch, make_launches = build()
            bound = [launcher.bind(grid, variable, *args, **kwargs)
                     for launcher, grid, args, kwargs in make_launches(self._carve(scratch, device, stream_key))]
            # A variable no launch received as it is (a copy made on the way, say) would be read
            # from this call forever after: such a plan is not kept.
            kept = None not in bound and all(t is None or any(b.slots[i] for b in bound) for i, t in enumerate(variable))
            self._plans[full_key] = bound if kept else None
        elif plan is None or plan is self:  # self: a call passing one tensor as two variables keeps nothing
            self._plain(device, build)
        else:
            stream = stream_key[1]
            for bound_launch in plan:
                bound_launch.launch(stream, *variable)

    @staticmethod
    def _keeps(device: torch.device) -> bool:
        """Whether calls on ``device`` keep plans: on CUDA, but not under stream capture (a plan's
        scratch would go into a graph that outlives the arena it came from)."""
        return device.type == "cuda" and not torch.cuda.is_current_stream_capturing()

    @staticmethod
    def _plain(device: torch.device, build: PlanBuilder) -> None:
        scratch, make_launches = build()
        for launcher, grid, args, kwargs in make_launches([torch.empty(shape, dtype=dtype, device=device)
                                                           for shape, dtype in scratch]):
            launcher[grid](*args, **kwargs)

    def _carve(self, buffers: ScratchSpec, device: torch.device, stream_key: tuple[int, int]) -> list[torch.Tensor]:
        """Views of the stream's arena for ``buffers`` (each at a 256-byte boundary). An arena too
        small is replaced by one of at least twice its size, and the plans carved from it are dropped."""
        sizes = [-(-math.prod(shape) * dtype.itemsize // 256) * 256 for shape, dtype in buffers]
        arena = self._arenas.get(stream_key)
        if arena is None or arena.numel() < sum(sizes):
            # list(): one copy under the GIL (ranks run as threads may add plans meanwhile).
            for key in [key for key in list(self._plans) if key[:2] == stream_key]:
                del self._plans[key]
            arena = self._arenas[stream_key] = torch.empty(
                max(sum(sizes), 0 if arena is None else 2 * arena.numel()), dtype=torch.uint8, device=device)
        views, offset = [], 0
        for (shape, dtype), size in zip(buffers, sizes):
            views.append(arena[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape))
            offset += size
        return views


def _distinct(variable: Sequence[torch.Tensor | None]) -> bool:
    present = [t for t in variable if t is not None]
    return len({id(t) for t in present}) == len(present)
