from novainfer.attention.backends.abstract import AttentionBackend, AttentionMetadata
from novainfer.attention.backends.selector import BACKEND_NAMES, get_attn_backend
from novainfer.attention.backends.torch_ref import TorchReferenceBackend, TorchSDPABackend

__all__ = ["BACKEND_NAMES", "AttentionBackend", "AttentionMetadata", "TorchReferenceBackend", "TorchSDPABackend",
           "TritonAttentionBackend", "get_attn_backend"]


def __getattr__(name: str):
    # Triton is imported on first use only: CPU-only installs do not have it.
    if name == "TritonAttentionBackend":
        from novainfer.attention.backends.triton_attn import TritonAttentionBackend

        return TritonAttentionBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
