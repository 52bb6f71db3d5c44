"""Batched next-token sampling."""

from novainfer.sample.metadata import SamplingMetadata
from novainfer.sample.sampler import LogprobsTensors, Sampler, SamplerOutput
from novainfer.sample.state import SamplingStateTable

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingStateTable",
]
