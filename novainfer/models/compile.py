"""``torch.compile`` (inductor) of a model's forward, for the steps that do not replay a CUDA graph.

Eager steps pay the host cost of every small op and launch; inductor fuses the elementwise work
(residual adds, norms, activations) into a few generated kernels launched from lean generated
code. Attention stays outside what inductor traces: it is one custom op (see
:mod:`novainfer.attention.layer`). The token dimension is dynamic, so one compilation serves
every step size (a step of one token is compiled once more: sizes 0 and 1 are always specialised).

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

from novainfer.tiny_model import cache_root

logger = logging.getLogger(__name__)

# vLLM's levels: 0 runs the model as written; 1 compiles its forward with torch.compile (inductor).
COMPILATION_LEVELS = (0, 1)


def inductor_cache_dir() -> Path:
    """``TORCHINDUCTOR_CACHE_DIR`` when the user set it, else ``torchinductor`` in the NovaInfer cache."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # Inductor writes its default into the variable once it has used it: that one is not a choice.
    configured = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if configured and os.path.abspath(configured) != os.path.abspath(default_cache_dir()):
        return Path(configured)
    return cache_root() / "torchinductor"


class CompiledForward:
    """``forward(input_ids, positions)`` compiled once for any number of tokens; logs each compilation."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], name: str) -> None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache_dir())
        self.name = name
        self.num_compilations = 0
        self._compiled = torch.compile(forward, fullgraph=True, dynamic=False)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Marked on every call: each step passes new views of the step buffers.
        torch._dynamo.maybe_mark_dynamic(input_ids, 0)
        torch._dynamo.maybe_mark_dynamic(positions, 0)
        stats = torch._dynamo.utils.counters["stats"]
        graphs = stats["unique_graphs"]
        if self.num_compilations == 0:
            logger.info("compiling the %s forward with torch.compile (inductor, cache %s) ...", self.name,
                        inductor_cache_dir())
        started = time.perf_counter()
        out = self._compiled(input_ids, positions)
        if stats["unique_graphs"] != graphs:
            self.num_compilations += 1
            logger.info("compiled the %s forward for steps of %s tokens in %.1f s", self.name,
                        "any number of" if input_ids.shape[0] > 1 else "1", time.perf_counter() - started)
        return out


def compile_model(model: nn.Module, level: int) -> None:
    """Applies compilation ``level`` (see COMPILATION_LEVELS) to a loaded model."""
    if level not in COMPILATION_LEVELS:
        raise ValueError(f"compilation_level must be one of {COMPILATION_LEVELS}, got {level}")
    if level == 0:
        return
    compile_forward = getattr(model, "compile_forward", None)
    if compile_forward is None:
        raise ValueError(f"{type(model).__name__} does not support compilation_level {level}")
    compile_forward()
