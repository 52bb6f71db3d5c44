from novainfer.attention.backends.abstract import AttentionBackend, AttentionMetadata
from novainfer.attention.backends.torch_ref import TorchReferenceBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchReferenceBackend"]
