"""Host time per call of what an eager step issues: the floor under an eager decoder layer.

An eager step's wall time is its host's time wherever the host issues work more slowly than the
device runs it (a decode step of the 0.5B shape: about 4x its 1.6 ms of kernels on an H200). This
times, per call and without the device in the way (small work, queued without synchronising),
each kind of call a decoder layer makes: the matrix product (``torch.mm``), an allocation, a
module call, a split, and, on CUDA with Triton, one of the model's own kernels (the RMSNorm at the
decode step's shape) launched five ways: ``kernel[grid]``; the project's ``KernelLauncher``; and
its parts (Triton's argument binder alone; the compiled binary's launcher given the tensors, and
given their device addresses). The floor of a layer is its calls (``--products`` matrix products
and ``--triton-kernels`` Triton launches, as ``step_time.py`` counts them) at these costs, with no
other Python at all, times ``--layers``.

    python benchmarks/launch_cost.py                     # CPU: the torch rows only
    python benchmarks/launch_cost.py --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import add_output_arguments, load_average, run_facts, scrub_path, write_results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--tokens", type=int, default=256, help="rows of the activations (a decode step's batch)")
    p.add_argument("--hidden", type=int, default=896, help="hidden size (the 0.5B shape's)")
    p.add_argument("--qkv", type=int, default=1152, help="columns of the timed product (the 0.5B shape's QKV)")
    p.add_argument("--calls", type=int, default=2000, help="calls per timed repeat")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats; the median is reported")
    g = p.add_argument_group("floor of a layer")
    g.add_argument("--layers", type=int, default=24)
    g.add_argument("--products", type=int, default=4, help="matrix products per layer")
    g.add_argument("--triton-kernels", type=int, default=5, help="Triton launches per layer")
    add_output_arguments(p, "launch_cost_<device>")
    args = p.parse_args(argv)
    if min(args.tokens, args.hidden, args.qkv, args.calls, args.repeats, args.layers) < 1:
        p.error("--tokens, --hidden, --qkv, --calls, --repeats and --layers must be >= 1")
    return args


def time_call(fn: Callable[[], Any], calls: int, repeats: int, synchronize: Callable[[], None]) -> float:
    """Median over ``repeats`` of the host's microseconds per call of ``fn`` over ``calls`` calls."""
    for _ in range(min(calls, 50)):
        fn()
    synchronize()
    per_call = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - started) / calls * 1e6)
        synchronize()
    return statistics.median(per_call)


def torch_calls(args: argparse.Namespace, device) -> dict[str, Callable[[], Any]]:
    import torch

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(args.tokens, args.hidden, dtype=dtype, device=device)
    weight_t = torch.randn(args.qkv, args.hidden, dtype=dtype, device=device).t()
    module = torch.nn.Identity()
    sizes = [args.qkv // 3, args.qkv // 3, args.qkv - 2 * (args.qkv // 3)]
    qkv = torch.randn(args.tokens, args.qkv, dtype=dtype, device=device)
    return {"torch.mm": lambda: torch.mm(x, weight_t),
            "torch.empty": lambda: torch.empty(x.shape, dtype=dtype, device=device),
            "nn.Module call": lambda: module(x),
            "Tensor.split (3)": lambda: qkv.split(sizes, dim=-1)}


def triton_calls(args: argparse.Namespace, device) -> dict[str, Callable[[], Any]]:
    """The RMSNorm kernel of a decoder layer launched five ways (CUDA)."""
    import torch

    from novainfer.layers.ops.common import next_power_of_2
    from novainfer.layers.ops.launcher import KernelLauncher
    from novainfer.layers.ops.rms_norm import _rms_norm_kernel

    x = torch.randn(args.tokens, args.hidden, dtype=torch.bfloat16, device=device)
    weight = torch.ones(args.hidden, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(x)
    block = next_power_of_2(args.hidden)
    kernel_args = (x, None, weight, out, None, x.stride(0), 0, out.stride(0), 0, args.hidden, 1e-6)
    options = dict(HAS_RESIDUAL=False, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    grid = (args.tokens,)
    launcher = KernelLauncher(_rms_norm_kernel)
    binary = _rms_norm_kernel[grid](*kernel_args, **options)
    binder = _rms_norm_kernel.device_caches[device.index or 0][-1]
    values = tuple(binder(*kernel_args, **options)[0].values())
    addresses = tuple(v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values)
    stream = torch.cuda.current_stream(device).cuda_stream

    def run(launch_values):
        return lambda: binary.run(grid[0], 1, 1, stream, binary.function, binary.packed_metadata, None, None, None,
                                  *launch_values)

    return {"Triton kernel[grid]": lambda: _rms_norm_kernel[grid](*kernel_args, **options),
            "KernelLauncher": lambda: launcher[grid](*kernel_args, **options),
            "Triton binder alone": lambda: binder(*kernel_args, **options),
            "compiled launcher, tensors": run(values),
            "compiled launcher, addresses": run(addresses)}


def layer_floor(rows: dict[str, float], args: argparse.Namespace) -> dict[str, Any]:
    """Milliseconds per step that a layer's products and Triton launches cost at these rates alone."""
    floor = {}
    for name in ("KernelLauncher", "compiled launcher, addresses"):
        if name in rows:
            per_layer_us = args.products * rows["torch.mm"] + args.triton_kernels * rows[name]
            floor[f"products + Triton via {name}"] = {"us_per_layer": round(per_layer_us, 1),
                                                      "ms_per_step": round(per_layer_us * args.layers / 1e3, 3)}
    return floor


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    import torch

    from novainfer.config import resolve_device

    device = resolve_device(args.device)
    load_at_start = load_average()

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    calls = torch_calls(args, device)
    if device.type == "cuda":
        calls.update(triton_calls(args, device))
    rows = {}
    with torch.inference_mode():
        for name, fn in calls.items():
            rows[name] = round(time_call(fn, args.calls, args.repeats, synchronize), 2)
            print(f"{name:32s} {rows[name]:8.2f} us per call", flush=True)
    floor = layer_floor(rows, args)
    for name, row in floor.items():
        print(f"floor, {name}: {row['us_per_layer']} us per layer, {row['ms_per_step']} ms per step of "
              f"{args.layers} layers")
    results = {"benchmark": "host time per call of an eager layer's calls, and the floor they put under a step",
               **run_facts(device, load_at_start, argv, __file__),
               "workload": {"tokens": args.tokens, "hidden": args.hidden, "qkv": args.qkv, "calls": args.calls,
                            "repeats": args.repeats, "layers": args.layers, "products": args.products,
                            "triton_kernels": args.triton_kernels},
               "us_per_call": rows, "floor": floor}
    path = write_results(args.output or f"launch_cost_{device.type}", results, args.results_dir)
    print(f"results: {scrub_path(str(path))}")
    return results


if __name__ == "__main__":
    main()
