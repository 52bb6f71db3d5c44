"""``get_attn_backend``: which backend a device gets, and errors that name the allowed values."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from novainfer.attention import BACKEND_NAMES, TorchReferenceBackend, TorchSDPABackend, get_attn_backend


def test_cpu_gets_fused_attention_and_the_reference_on_request():
    assert isinstance(get_attn_backend(torch.device("cpu")), TorchSDPABackend)
    reference = get_attn_backend(torch.device("cpu"), "torch")
    assert type(reference) is TorchReferenceBackend and reference.name == "torch"


def test_unknown_name_lists_the_allowed_values():
    with pytest.raises(ValueError, match="'flash'.*" + ", ".join(BACKEND_NAMES)):
        get_attn_backend(torch.device("cpu"), "flash")


def test_triton_backend_needs_cuda():
    with pytest.raises(ValueError, match="triton.*CUDA.*cpu"):
        get_attn_backend(torch.device("cpu"), "triton")


def test_importing_the_engine_does_not_import_triton():
    """CPU-only installs have no Triton: only choosing the Triton backend (or a CUDA layer) imports it."""
    code = ("import sys, novainfer.attention, novainfer.models.qwen2, novainfer.worker.model_runner; "
            "sys.exit('triton' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
