"""CUDA graphs of whole forward steps: decode-only steps by batch size, mixed steps by token count.

A step launches a few hundred small kernels; from Python each launch costs more host time than
the GPU spends on it, so an eager step of a small model costs ~20 ms on the host for 2-3 ms of
kernels. Replaying a captured graph removes that cost. Two kinds of graph cover the steps:

* ``decode`` graphs, one per padded batch size ``B``: ``B`` sequences of one query token each.
  The extra rows are padding the attention backend ignores (no KV slot, empty context).
* ``mixed`` graphs, one per padded token count ``T``: any step of at most ``T`` tokens (prompt
  chunks, with or without decodes) over at most ``max_seqs`` sequences. Every mixed graph has
  ``max_seqs`` sequence slots; the attention kernels find each sequence's tokens from
  ``query_start_loc`` on the device, so padding sequences (no query tokens, empty context) and
  padding tokens (owned by no sequence, no KV slot) cost only programs that return at once. The
  logits are computed for ``max_seqs`` rows, the most a step samples.
* ``chain`` graphs (a draft model's), one per padded batch size ``B``: several one-token forwards
  of ``B`` sequences in a row, each fed the argmax of the one before, with the LM head inside, so
  that a draft proposes its tokens with one launch.

Graphs share one memory pool and are captured from the largest step down, so the smaller ones
reuse the larger ones' activation memory.

On a CPU there is nothing to capture, but the same steps can be *emulated*: every replay runs the
step eagerly on the same padded static inputs, which tests the bucketing and padding of captured
steps on machines without a GPU.
"""

from __future__ import annotations

import bisect
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

logger = logging.getLogger(__name__)

# Captured sizes: every small size where padding would double the work, then steps of 16 (of
# 64 past 256, where 64 extra rows cost little against the step's own work).
_SMALL_SIZES = (1, 2, 4, 8)
_SIZE_STEP = 16
_LARGE_FROM, _LARGE_STEP = 256, 64

GraphKind = Literal["decode", "mixed", "chain"]


@dataclass(frozen=True, order=True)
class GraphKey:
    kind: GraphKind
    size: int  # sequences of a decode or chain graph, tokens of a mixed graph


def cudagraph_capture_sizes(max_size: int) -> list[int]:
    """The padded sizes captured for steps of up to ``max_size`` sequences (decode) or tokens (mixed)."""
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    sizes = [s for s in _SMALL_SIZES if s < max_size]
    sizes += list(range(_SIZE_STEP, min(max_size, _LARGE_FROM), _SIZE_STEP))
    sizes += list(range(_LARGE_FROM, max_size, _LARGE_STEP))
    sizes.append(max_size)
    return sorted(set(sizes))


class StepGraphs:
    """Captured step graphs and the static head output each one writes."""

    def __init__(self) -> None:
        self._sizes: dict[GraphKind, list[int]] = {"decode": [], "mixed": [], "chain": []}
        # A captured graph and the output it writes, or (None, the step) when emulated.
        self._graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | Callable]] = {}

    def __bool__(self) -> bool:
        return bool(self._graphs)

    def sizes(self, kind: GraphKind) -> list[int]:
        return list(self._sizes[kind])

    def __contains__(self, key: GraphKey) -> bool:
        return key in self._graphs

    def padded_key(self, kind: GraphKind, size: int) -> GraphKey | None:
        """The graph a step of ``size`` (sequences or tokens) runs at, or None if none is large enough."""
        sizes = self._sizes[kind]
        index = bisect.bisect_left(sizes, size)
        return GraphKey(kind, sizes[index]) if index < len(sizes) else None

    def capture(self, keys: list[GraphKey], run_step: Callable[[GraphKey], torch.Tensor],
                device: torch.device) -> None:
        """Captures ``run_step(key)`` (which returns the step's head output) for every key.

        Each key first runs once outside the graph, so that lazy work (kernel compilation,
        workspace allocation) happens before capture.

        Capture goes through ``CUDAGraph.capture_begin`` on a stream of ``device`` rather than the
        ``torch.cuda.graph`` context, which shares one capture stream among every graph of the
        process (made on whichever device captured first) and empties the allocator cache of every
        device. In the single-process TP executor, ranks capture on their own threads at once: the
        shared stream would put two devices' captures on one stream, and emptying another rank's
        cache synchronizes its GPU while that rank may wait in a collective for this one.
        """
        started = time.perf_counter()
        if device.type != "cuda":
            self._graphs.update({key: (None, functools.partial(run_step, key)) for key in keys})
            self._index_sizes()
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)
        # Largest step first (by tokens: a mixed graph of T tokens outweighs a decode graph of T rows).
        for key in sorted(keys, key=lambda k: (k.size, k.kind == "mixed"), reverse=True):
            run_step(key)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                # thread_local: what other threads (other ranks) do meanwhile does not break this capture.
                graph.capture_begin(pool, capture_error_mode="thread_local")
                try:
                    output = run_step(key)
                finally:
                    graph.capture_end()
            self._graphs[key] = (graph, output)
        torch.cuda.synchronize(device)
        self._index_sizes()
        logger.info("captured %d CUDA graphs on %s in %.1f s: decode batch sizes %s, mixed token counts %s%s",
                    len(self._graphs), device, time.perf_counter() - started, self._sizes["decode"],
                    self._sizes["mixed"], f", chain batch sizes {self._sizes['chain']}" if self._sizes["chain"] else "")

    def _index_sizes(self) -> None:
        for kind in self._sizes:
            self._sizes[kind] = sorted(k.size for k in self._graphs if k.kind == kind)

    def replay(self, key: GraphKey) -> torch.Tensor:
        """Runs the graph of ``key`` on what its static inputs hold now; returns its head output."""
        graph, output = self._graphs[key]
        if graph is None:
            return output()
        graph.replay()
        return output

    def clear(self) -> None:
        self._graphs.clear()
        self._sizes = {"decode": [], "mixed": [], "chain": []}
