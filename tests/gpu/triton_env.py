"""Where the Triton kernel tests run.

On a CUDA machine they run on the GPU (marked ``gpu``, so they skip where there is none). With
``TRITON_INTERPRET=1`` they run on CPU tensors under Triton's interpreter instead, on smaller
shapes, which checks the kernels without a GPU. The interpreter holds bfloat16 as raw 16-bit
integers and gets bf16 dot products wrong, so interpreted runs cover float16 and float32; Triton
3.6's interpreter also needs NumPy < 2.4 (newer NumPy refuses its scalar conversions).
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
MARKS = [] if INTERPRET else [pytest.mark.gpu]
# Low-precision dtypes every kernel is checked in.
DTYPES = [torch.float16, torch.float32] if INTERPRET else [torch.bfloat16, torch.float16]
