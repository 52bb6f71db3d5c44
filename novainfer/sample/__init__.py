"""Batched next-token sampling."""

from novainfer.sample.metadata import SamplingMetadata, make_generator
from novainfer.sample.sampler import LogprobsTensors, Sampler, SamplerOutput

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "make_generator",
]
