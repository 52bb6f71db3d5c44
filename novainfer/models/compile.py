"""``torch.compile`` (inductor) of a model's forward, for the steps that do not replay a CUDA graph.

Eager steps pay the host cost of every small op and launch; inductor fuses the elementwise work
(residual adds, norms, activations) into a few generated kernels launched from lean generated
code. With the Triton attention backend, attention is traced too (its kernels become part of the
graph, see :mod:`novainfer.attention.ops.traced_attention`); with the others it is one opaque
custom op (see :mod:`novainfer.attention.layer`). The token and sequence dimensions are dynamic, so
one compilation serves every step size of one kind: with traced attention, a decode-only step or
any other, with one decode split or several (and inductor's own size guards); a step of one token
is compiled once more, since sizes 0 and 1 are always specialised. The worker runs a step of each
kind at start-up (``Worker._warm_up_compiled``), so that none compiles mid-run.

Level 2 adds inductor's C++ wrapper: the generated code that calls the kernels is C++, not Python.
Its first compilation of a graph takes longer (a 24-layer model's decode step on one H200 host: 109 s
against 40 s, most of it compiling C++) and it needs a C++ compiler at run time.

Compiled artifacts go to inductor's cache under the NovaInfer cache directory
(``$NOVAINFER_CACHE/torchinductor`` unless ``TORCHINDUCTOR_CACHE_DIR`` is set), so a second start
skips inductor's code generation and kernel builds; only Dynamo's tracing runs again.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from novainfer.attention.backends.abstract import TracedAttentionInputs
from novainfer.tiny_model import cache_root

logger = logging.getLogger(__name__)

# Graphs one compiled forward may hold (dynamo's default of 8 could be reached by the kinds of step
# above times inductor's size guards; past the limit dynamo would run the forward uncompiled).
RECOMPILE_LIMIT = 32


def inductor_cache_dir() -> Path:
    """``TORCHINDUCTOR_CACHE_DIR`` when the user set it, else ``torchinductor`` in the NovaInfer cache."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # Inductor writes its default into the variable once it has used it: that one is not a choice.
    configured = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if configured and os.path.abspath(configured) != os.path.abspath(default_cache_dir()):
        return Path(configured)
    return cache_root() / "torchinductor"


# The dynamic dimensions of a traced step's attention inputs (TracedAttentionInputs' tensor fields):
# tokens, sequences, block-table width and decode splits.
_TRACED_DYNAMIC_DIMS = {"slot_mapping": (0,), "seq_lens": (0,), "block_tables": (0, 1), "query_start_loc": (0,),
                        "split_out": (0, 2), "split_lse": (0, 2)}


class CompiledForward:
    """``forward(input_ids, positions[, attention_inputs])`` compiled once per kind of step (see the
    module docstring); logs each compilation."""

    def __init__(self, forward: Callable[..., torch.Tensor], name: str, cpp_wrapper: bool = False) -> None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir())
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        self.name = name
        self.num_compilations = 0
        self._compiled = torch.compile(forward, fullgraph=True, dynamic=False,
                                       options={"cpp_wrapper": True} if cpp_wrapper else None)
        self._wrapper = "C++" if cpp_wrapper else "Python"

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 attention_inputs: TracedAttentionInputs | None = None) -> torch.Tensor:
        # Marked on every call: each step passes new views of the step buffers.
        torch._dynamo.maybe_mark_dynamic(input_ids, 0)
        torch._dynamo.maybe_mark_dynamic(positions, 0)
        args: tuple = (input_ids, positions)
        if attention_inputs is not None:
            for field, dims in _TRACED_DYNAMIC_DIMS.items():
                torch._dynamo.maybe_mark_dynamic(getattr(attention_inputs, field), dims)
            args += (attention_inputs,)
        stats = torch._dynamo.utils.counters["stats"]
        graphs = stats["unique_graphs"]
        if self.num_compilations == 0:
            logger.info("compiling the %s forward with torch.compile (inductor, %s wrapper, cache %s) ...", self.name,
                        self._wrapper, inductor_cache_dir())
        started = time.perf_counter()
        out = self._compiled(*args)
        if stats["unique_graphs"] != graphs:
            self.num_compilations += 1
            logger.info("compiled the %s forward for %s in %.1f s (graph %d)", self.name,
                        _step_kind(input_ids.shape[0], attention_inputs), time.perf_counter() - started,
                        self.num_compilations)
        return out


def _step_kind(num_tokens: int, attention_inputs: TracedAttentionInputs | None) -> str:
    if attention_inputs is None:
        return "steps of any number of tokens" if num_tokens > 1 else "steps of 1 token"
    kind = "decode-only steps" if attention_inputs.decode_only else "steps with prompt tokens"
    splits = attention_inputs.split_lse.shape[2]
    return f"{kind} like this one ({num_tokens} tokens, {'one decode split' if splits == 1 else 'split decodes'})"


def compile_model(model: nn.Module, level: int) -> None:
    """Applies compilation ``level`` (see ``novainfer.config.COMPILATION_LEVELS``) to a loaded model."""
    from novainfer.config import COMPILATION_LEVELS  # (imported here: the config module imports the models)

    if level not in COMPILATION_LEVELS:
        raise ValueError(f"compilation_level must be one of {COMPILATION_LEVELS}, got {level}")
    if level == 0:
        return
    compile_forward = getattr(model, "compile_forward", None)
    if compile_forward is None:
        raise ValueError(f"{type(model).__name__} does not support compilation_level {level}")
    compile_forward(cpp_wrapper=level == 2)
