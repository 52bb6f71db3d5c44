from novainfer.attention.backends import AttentionBackend, AttentionMetadata, TorchReferenceBackend
from novainfer.attention.layer import Attention

__all__ = ["Attention", "AttentionBackend", "AttentionMetadata", "TorchReferenceBackend"]
