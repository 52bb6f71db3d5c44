"""All-reduce latency between the GPUs of one host: NCCL against NovaInfer's custom kernels.

Ranks are threads of this process, one GPU each, as in the ``uni`` executor (CuPy's NCCL
communicators; the custom kernels read their peers' buffers directly). Each case captures 56
in-place sums of a ``rows x hidden`` bfloat16 tensor (two per decoder layer of a 28-layer model) in
a CUDA graph on every rank; the time is the mean over replays, per all-reduce, as rank 0 sees it.
Both custom kernels, one-shot and two-shot, are timed at every world size (the engine never runs
the two-shot at two ranks; its column there is for comparison) in variants (elements per program,
warps, programs per multiprocessor), to pick the defaults and the size from which the two-shot
runs. One row per world size and row count: ``nccl_us``, then ``{one,two}_shot_us_b*_w*_p*``.

    python benchmarks/all_reduce.py [--world-sizes 2 4] [--rows 1 16 64 256 512] [--output NAME]
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import add_output_arguments, command_line, git_commit, machine_info, write_results

CALLS_PER_GRAPH = 56
REPLAYS = 20
# (elements per program and iteration, warps, programs per multiprocessor)
VARIANTS = [(1024, 4, 1), (2048, 8, 1), (4096, 16, 1), (2048, 8, 2), (1024, 4, 4)]
# Each kernel, by the two_shot_min_bytes that forces it.
KERNELS = {"one_shot": math.inf, "two_shot": 0}


def time_all_reduces(group, tensor: torch.Tensor, barrier: threading.Barrier) -> float:
    """Microseconds per all-reduce of ``tensor`` captured CALLS_PER_GRAPH times in one graph."""
    device = group.device
    group.all_reduce(tensor)  # warm-up: NCCL connects, Triton compiles
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(torch.cuda.Stream(device)):
        graph.capture_begin(capture_error_mode="thread_local")
        for _ in range(CALLS_PER_GRAPH):
            group.all_reduce(tensor)
        graph.capture_end()
    graph.replay()
    torch.cuda.synchronize(device)
    barrier.wait()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    barrier.wait()
    return 1000 * start.elapsed_time(end) / (REPLAYS * CALLS_PER_GRAPH)


def rank_main(rank: int, world: int, init_method: str, rows: list[int], hidden: int,
              barrier: threading.Barrier) -> list[dict[str, Any]]:
    from novainfer.distributed import ProcessGroupFactory

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    factory = ProcessGroupFactory.instance()
    group = factory.get_or_create("bench", backend="cupy-nccl", rank=rank, world_size=world, device=device,
                                  init_method=init_method)
    try:
        if not group.enable_custom_all_reduce():
            raise RuntimeError(f"no custom all-reduce between GPUs 0..{world - 1}")
        custom, rows_out = group.custom_all_reduce, []
        sms = custom.max_programs
        for n in rows:
            tensor = torch.zeros(n, hidden, dtype=torch.bfloat16, device=device)
            group.custom_all_reduce = None
            row = {"world_size": world, "rows": n, "bytes": tensor.nbytes,
                   "nccl_us": round(time_all_reduces(group, tensor, barrier), 2)}
            group.custom_all_reduce = custom
            # Every rank is idle between timings (time_all_reduces ends at a barrier after a
            # synchronize), which changing the grid and the kernel needs.
            for kernel, two_shot_min_bytes in KERNELS.items():
                custom.two_shot_min_bytes = two_shot_min_bytes
                for block, warps, per_sm in VARIANTS:
                    custom.block, custom.num_warps, custom.max_programs = block, warps, sms * per_sm
                    row[f"{kernel}_us_b{block}_w{warps}_p{per_sm}"] = round(
                        time_all_reduces(group, tensor, barrier), 2)
            custom.max_programs = sms
            rows_out.append(row)
        return rows_out
    finally:
        factory.destroy(group)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 512])
    p.add_argument("--hidden", type=int, default=3584, help="Qwen2-7B's hidden size")
    add_output_arguments(p, "all_reduce_cuda")
    args = p.parse_args(argv)
    results = []
    for world in args.world_sizes:
        if torch.cuda.device_count() < world:
            print(f"skipping world size {world}: {torch.cuda.device_count()} GPUs")
            continue
        barrier = threading.Barrier(world)
        init_method = f"inproc://bench-{uuid.uuid4().hex}"
        with ThreadPoolExecutor(world) as pool:
            futures = [pool.submit(rank_main, r, world, init_method, args.rows, args.hidden, barrier)
                       for r in range(world)]
            rows = futures[0].result()
            for f in futures[1:]:
                f.result()
        for row in rows:
            print(row, flush=True)
        results.extend(rows)
    write_results(args.output or "all_reduce_cuda",
                  {"benchmark": "all-reduce latency (CUDA graph replays)", "machine": machine_info("cuda"),
                   "commit": git_commit(), "command": command_line(argv), "calls_per_graph": CALLS_PER_GRAPH,
                   "replays": REPLAYS, "dtype": "bfloat16", "results": results},
                  args.results_dir)


if __name__ == "__main__":
    main()
