"""``KernelLauncher``'s bookkeeping on a CPU: which calls reuse a kept binary, and what they pass it.

There is no GPU here, so the kernel's binder is Triton's own (built for the base backend) and the
binaries are stand-ins that record their launches. A call whose specialization Triton would
compile separately (a pointer off 16-byte alignment, an integer equal to 1 or not divisible by 16,
another dtype, constexpr or option) must go through ``kernel[grid]``; a repeated one must reach its
binary with the arguments ``JITFunction.run`` passes a binary: the grid padded to three
dimensions, the stream, the binary's function and metadata, no launch hooks, then every argument
in the kernel's order (constexprs included). ``bind`` keeps such a launch with its variable
arguments emptied, and ``LaunchPlans`` (made to keep plans for CPU tensors here) repeat a kept
shape without binding, and keep nothing where that would be wrong (a variable the launches got a
copy of, one tensor passed as two variables) or stale (plans carved from an arena that grew).
tests/gpu/test_kernel_launcher.py runs real kernels.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

import novainfer.layers.ops.launcher as launcher_module  # noqa: E402
from novainfer.layers.ops.launcher import KernelLauncher, LaunchPlans, direct_launches  # noqa: E402

DEVICE, STREAM = 3, 1234


def _kernel(x_ptr, out_ptr, n, scale, BLOCK: "tl.constexpr"):  # noqa: F821 - never compiled here
    pass


class FakeBinary:
    function, packed_metadata = "function", "metadata"

    def __init__(self, launches: list) -> None:
        self.launches = launches

    def run(self, *args) -> None:
        self.launches.append(args)


@pytest.fixture
def launcher(monkeypatch):
    """A launcher of a never-compiled kernel: ``.plain`` records the calls that take ``kernel[grid]``
    and ``.launches`` every binary launch (``JITFunction.run``'s arguments to the binary for those)."""
    kernel = JITFunction(_kernel, do_not_specialize=["scale"])
    binder = create_function_from_signature(kernel.signature, kernel.params, BaseBackend)
    kernel.device_caches[DEVICE] = ({}, {}, None, BaseBackend, binder)
    monkeypatch.setattr(launcher_module, "_device_and_stream", lambda: (lambda: DEVICE, lambda device: STREAM))
    launches, plain = [], []
    binary = FakeBinary(launches)

    def run(*args, grid, warmup, **kwargs):
        plain.append((grid, args, kwargs))
        bound = binder(*args, **kwargs)[0]
        binary.run(*grid, *[1] * (3 - len(grid)), STREAM, binary.function, binary.packed_metadata, None, None,
                   None, *bound.values())
        return binary

    monkeypatch.setattr(kernel, "run", run)
    result = KernelLauncher(kernel)
    result.plain, result.launches = plain, launches
    return result


def test_a_repeated_specialization_launches_its_binary_with_the_plain_arguments(launcher):
    x, out = torch.zeros(64), torch.zeros(64)
    launcher[(5,)](x, out, 64, 0.5, BLOCK=32, num_warps=2)
    assert len(launcher.plain) == 1
    launcher[(5,)](x, out, 64, 0.5, BLOCK=32, num_warps=2)
    launcher[(7, 2)](out, x, 32, 2.0, BLOCK=32, num_warps=2)  # other tensors, values, grid: same specialization
    assert len(launcher.plain) == 1
    first, again, other = launcher.launches
    assert again == first == (5, 1, 1, STREAM, "function", "metadata", None, None, None, x, out, 64, 0.5, 32)
    assert other == (7, 2, 1, STREAM, "function", "metadata", None, None, None, out, x, 32, 2.0, 32)


@pytest.mark.parametrize("change", ["unaligned pointer", "dtype", "int equal to 1", "int not divisible by 16",
                                    "64-bit int", "constexpr", "option"])
def test_another_specialization_takes_the_plain_path_once(launcher, change):
    x, out = torch.zeros(64), torch.zeros(64)
    args, kwargs = [x, out, 64, 0.5], {"BLOCK": 32, "num_warps": 2}
    launcher[(1,)](*args, **kwargs)
    if change == "unaligned pointer":
        args[0] = x[1:]
    elif change == "dtype":
        args[1] = out.half()
    elif change == "int equal to 1":
        args[2] = 1
    elif change == "int not divisible by 16":
        args[2] = 65
    elif change == "64-bit int":
        args[2] = 2 ** 33
    elif change == "constexpr":
        kwargs["BLOCK"] = 64
    else:
        kwargs["num_warps"] = 4
    for _ in range(2):
        launcher[(1,)](*args, **kwargs)
    assert len(launcher.plain) == 2, "the new specialization must be compiled by Triton, once"
    assert launcher.launches[-1] == (1, 1, 1, STREAM, "function", "metadata", None, None, None, *args,
                                     kwargs["BLOCK"])


def test_a_float_argument_is_not_a_specialization(launcher):
    x = torch.zeros(64)
    for scale in (0.5, 1.0, 3.0):
        launcher[(1,)](x, x, 64, scale, BLOCK=32)
    assert len(launcher.plain) == 1


def test_plain_launches_when_disabled_or_hooked(launcher):
    x = torch.zeros(64)
    launcher[(1,)](x, x, 64, 0.5, BLOCK=32)
    with direct_launches(False):
        launcher[(1,)](x, x, 64, 0.5, BLOCK=32)
    assert len(launcher.plain) == 2
    hooks = triton.knobs.runtime.launch_exit_hook

    def hook(*args):
        pass

    hooks.add(hook)
    try:
        launcher[(1,)](x, x, 64, 0.5, BLOCK=32)  # a profiler's hook sees every launch
    finally:
        hooks.remove(hook)
    assert len(launcher.plain) == 3
    launcher.kernel.add_pre_run_hook(lambda *args, **kwargs: None)
    launcher[(1,)](x, x, 64, 0.5, BLOCK=32)  # a pre-run hook of the kernel runs too
    assert len(launcher.plain) == 4
    launcher.kernel.pre_run_hooks.clear()
    launcher[(1,)](x, x, 64, 0.5, BLOCK=32)
    assert len(launcher.plain) == 4


def test_a_bound_launch_repeats_with_new_values_of_its_variable_arguments(launcher):
    x, out, other = torch.zeros(64), torch.zeros(64), torch.ones(64)
    bound = launcher.bind((5, 2), (out, None), x, out, 64, 0.5, BLOCK=32, num_warps=2)
    assert len(launcher.plain) == 1 and len(launcher.launches) == 1, "bind launches once, as a call does"
    assert bound.args[1] is None and not any(arg is out for arg in bound.args), "the variable tensor is not kept"
    bound.launch(99, other)
    assert launcher.launches[-1] == (5, 2, 1, 99, "function", "metadata", None, None, None, x, other, 64, 0.5, 32)
    assert len(launcher.plain) == 1


def test_bind_keeps_nothing_where_launches_take_the_plain_path(launcher):
    x = torch.zeros(64)
    with direct_launches(False):
        assert launcher.bind((1,), (x,), x, x, 64, 0.5, BLOCK=32) is None
    assert len(launcher.plain) == 1


def test_bind_refuses_one_tensor_standing_for_two_variables(launcher):
    x = torch.zeros(64)
    with pytest.raises(ValueError, match="distinct"):
        launcher.bind((1,), (x, x), x, x, 64, 0.5, BLOCK=32)


class KeepingPlans(LaunchPlans):
    """LaunchPlans that keep plans for CPU tensors (on CUDA only, otherwise), to test their bookkeeping here."""

    @staticmethod
    def _keeps(device: torch.device) -> bool:
        return True


@pytest.fixture
def binds(launcher):
    """The number of times the kernel's binder ran (every call that is not a kept plan's runs it)."""
    count = [0]
    *cache, binder = launcher.kernel.device_caches[DEVICE]

    def counting(*args, **kwargs):
        count[0] += 1
        return binder(*args, **kwargs)

    launcher.kernel.device_caches[DEVICE] = (*cache, counting)
    return count


def plan_call(plans, launcher, x, rows=4, alias=False, copy_x=False):
    """One call through ``plans``: the kernel on the variable ``x`` and a scratch buffer of ``rows``
    rows (passed as ``out``); ``alias`` names x as a second variable too, ``copy_x`` passes the launch
    a copy of x (a variable that does not reach it as it is). Returns the launch's scratch."""
    def build():
        return [((rows, 8), torch.float32)], lambda scratch: [
            (launcher, (rows,), (x.clone() if copy_x else x, scratch[0], 64, 0.5), {"BLOCK": 32})]
    plans.launch(x.device, (rows,), (x, x) if alias else (x,), build)
    return launcher.launches[-1][10]


def test_launch_plans_repeat_a_shape_with_new_tensors_and_the_same_scratch(launcher, binds):
    plans = KeepingPlans()
    x, x2 = torch.zeros(64), torch.ones(64)
    scratch = plan_call(plans, launcher, x)
    assert plan_call(plans, launcher, x2) is scratch and binds[0] == 2, "a kept plan binds nothing"
    assert launcher.launches[-1] == (4, 1, 1, STREAM, "function", "metadata", None, None, None, x2, scratch, 64,
                                     0.5, 32)
    plan_call(plans, launcher, torch.zeros(65)[1:])  # a pointer off alignment: a plan of its own
    assert binds[0] == 4


@pytest.mark.parametrize("case, num_binds", [("copy", 3), ("alias", 2)])
def test_launch_plans_keep_nothing_where_a_kept_launch_would_be_wrong(launcher, binds, case, num_binds):
    """A variable the launch got a copy of (a plan would read its first call's copy forever: each
    call binds, and bind itself binds again), or one tensor passed as two variables (which could not
    take two values: each call is a plain launch, one bind)."""
    plans = KeepingPlans()
    x = torch.zeros(64)
    for _ in range(2):
        plan_call(plans, launcher, x, copy_x=case == "copy", alias=case == "alias")
    assert binds[0] == num_binds


def test_launch_plans_drop_their_plans_when_the_arena_grows(launcher, binds):
    plans = KeepingPlans()
    x = torch.zeros(64)
    small = plan_call(plans, launcher, x, rows=4)
    plan_call(plans, launcher, x, rows=400)  # more scratch than the arena holds: a new arena
    again = plan_call(plans, launcher, x, rows=4)  # its plan was carved from the old arena: made again
    assert binds[0] == 6 and again.data_ptr() != small.data_ptr()
    plan_call(plans, launcher, x, rows=4)
    plan_call(plans, launcher, x, rows=400)
    assert binds[0] == 6
