"""The wire between the front-end and an engine-core process: ZMQ frames of msgpack (msgspec).

Front-end -> core: :class:`AddRequests`, :class:`AbortRequests` (each a batch), :class:`ResetPrefixCache`,
:class:`Shutdown`. Core -> front-end: :class:`CoreReady` once, then one :class:`EngineCoreOutputs` per
step, a :class:`PrefixCacheReset` per ResetPrefixCache, or :class:`CoreFailed` as its last word. Only
plain data crosses: no pickling on the hot path.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from novainfer.core.messages import EngineCoreOutputs, EngineCoreRequest
from novainfer.engine.core import EngineCoreInfo
from novainfer.sampling_params import RequestOutputKind, SamplingParams


class AddRequests(msgspec.Struct, tag="add", array_like=True):
    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache", array_like=True):
    pass


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class CoreReady(msgspec.Struct, tag="ready", array_like=True):
    info: EngineCoreInfo


class CoreFailed(msgspec.Struct, tag="failed", array_like=True):
    error: str  # "TypeName: message"
    traceback: str = ""


class StepOutputs(msgspec.Struct, tag="step", array_like=True):
    outputs: EngineCoreOutputs


class PrefixCacheReset(msgspec.Struct, tag="prefix_cache_reset", array_like=True):
    done: bool  # False: requests still held blocks, nothing was reset


CoreInput = AddRequests | AbortRequests | ResetPrefixCache | Shutdown
CoreMessage = CoreReady | CoreFailed | StepOutputs | PrefixCacheReset

_PARAM_FIELDS = [f.name for f in dataclasses.fields(SamplingParams) if f.init and f.name != "output_kind"]


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """What the core needs of a SamplingParams (it never reads ``output_kind``), with its stop ids."""
    wire = {name: getattr(params, name) for name in _PARAM_FIELDS}
    wire["all_stop_token_ids"] = sorted(params.all_stop_token_ids)
    return wire


def params_from_wire(wire: dict[str, Any]) -> SamplingParams:
    wire = dict(wire)
    stop_ids = wire.pop("all_stop_token_ids")
    params = SamplingParams(**wire, output_kind=RequestOutputKind.FINAL_ONLY)
    params.update_from_generation_config(stop_ids)
    return params


class InputEncoder:
    """Front-end side: encodes batches of requests and aborts."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def add(self, requests: list[EngineCoreRequest]) -> bytes:
        wire = [msgspec.structs.replace(r, sampling_params=params_to_wire(r.sampling_params)) for r in requests]
        return self._encoder.encode(AddRequests(wire))

    def abort(self, request_ids: list[str]) -> bytes:
        return self._encoder.encode(AbortRequests(request_ids))

    def reset_prefix_cache(self) -> bytes:
        return self._encoder.encode(ResetPrefixCache())

    def shutdown(self) -> bytes:
        return self._encoder.encode(Shutdown())


class InputDecoder:
    """Core side."""

    def __init__(self) -> None:
        self._decoder = msgspec.msgpack.Decoder(CoreInput)

    def decode(self, frame: bytes) -> CoreInput:
        message = self._decoder.decode(frame)
        if isinstance(message, AddRequests):
            for request in message.requests:
                request.sampling_params = params_from_wire(request.sampling_params)
        return message


core_message_encoder = msgspec.msgpack.Encoder()
core_message_decoder = msgspec.msgpack.Decoder(CoreMessage)
