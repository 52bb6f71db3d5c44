"""CUDA graphs of decode-only steps, one per padded batch size.

A decode step launches a few hundred small kernels; replaying them as one captured graph
removes the launch cost that otherwise dominates small batches. A step of ``n`` sequences runs
the graph of the smallest captured size >= ``n``; the extra rows are padding the attention
backend ignores (no KV slot, empty context). Graphs share one memory pool and are captured from
the largest size down, so the smaller ones reuse the larger ones' activation memory.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

# Captured sizes: every small size where padding would double the work, then steps of 16.
_SMALL_SIZES = (1, 2, 4, 8)
_SIZE_STEP = 16


def cudagraph_batch_sizes(max_batch_size: int) -> list[int]:
    """The padded batch sizes captured for steps of up to ``max_batch_size`` sequences."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = [s for s in _SMALL_SIZES if s < max_batch_size]
    sizes += list(range(_SIZE_STEP, max_batch_size, _SIZE_STEP))
    sizes.append(max_batch_size)
    return sorted(set(sizes))


class DecodeGraphs:
    """Captured decode graphs and the static logits each one writes."""

    def __init__(self) -> None:
        self._sizes: list[int] = []
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def __bool__(self) -> bool:
        return bool(self._graphs)

    @property
    def sizes(self) -> list[int]:
        return list(self._sizes)

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a step of ``num_seqs`` decodes runs at, or None if none is large enough."""
        index = bisect.bisect_left(self._sizes, num_seqs)
        return self._sizes[index] if index < len(self._sizes) else None

    def capture(self, sizes: list[int], run_step: Callable[[int], torch.Tensor], device: torch.device) -> None:
        """Captures ``run_step(size)`` (which returns the step's logits) for every size.

        Each size first runs once outside the graph, so that lazy work (kernel compilation,
        workspace allocation) happens before capture.

        Capture goes through ``CUDAGraph.capture_begin`` on a stream of ``device`` rather than the
        ``torch.cuda.graph`` context, which shares one capture stream among every graph of the
        process (made on whichever device captured first) and empties the allocator cache of every
        device. In the single-process TP executor, ranks capture on their own threads at once: the
        shared stream would put two devices' captures on one stream, and emptying another rank's
        cache synchronizes its GPU while that rank may wait in a collective for this one.
        """
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        for size in sorted(sizes, reverse=True):
            run_step(size)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                # thread_local: what other threads (other ranks) do meanwhile does not break this capture.
                graph.capture_begin(pool, capture_error_mode="thread_local")
                try:
                    logits = run_step(size)
                finally:
                    graph.capture_end()
            self._graphs[size] = (graph, logits)
        torch.cuda.synchronize(device)
        self._sizes = sorted(self._graphs)
        logger.info("captured %d CUDA graphs for decode batch sizes %s on %s in %.1f s", len(self._sizes),
                    self._sizes, device, time.perf_counter() - started)

    def replay(self, size: int) -> torch.Tensor:
        """Runs the graph of ``size`` on what its static inputs hold now; returns its logits [size, V]."""
        graph, logits = self._graphs[size]
        graph.replay()
        return logits

    def clear(self) -> None:
        self._graphs.clear()
        self._sizes = []
