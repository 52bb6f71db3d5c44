"""Command-line flags generated from EngineArgs and SamplingParams, so the two never drift apart."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from typing import Any

from novainfer.engine.arg_utils import EngineArgs
from novainfer.sampling_params import SamplingParams

# The engine's --seed also seeds each command-line request's sampling, so runs are repeatable.
_SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p", "max_tokens", "min_tokens",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos", "stop",
                   "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output")


def _scalar_type(annotation: Any) -> Any:
    """``int | None`` -> int; ``list[int] | None`` -> (list, int)."""
    if isinstance(annotation, str):
        annotation = eval(annotation, {"list": list, "dict": dict, "Any": Any})  # annotations are postponed strings
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = args[0]
    if typing.get_origin(annotation) is list:
        return list, typing.get_args(annotation)[0]
    if typing.get_origin(annotation) is dict:
        return json.loads  # a dict flag takes JSON: --speculative-config '{"method": "ngram", ...}'
    return annotation


def _add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, names: typing.Iterable[str],
                         defaults: dict[str, Any]) -> None:
    by_name = {f.name: f for f in dataclasses.fields(cls)}
    for name in names:
        f = by_name[name]
        flag = "--" + name.replace("_", "-")
        kind = _scalar_type(f.type)
        default = defaults.get(name, f.default if f.default is not dataclasses.MISSING else None)
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif isinstance(kind, tuple):
            parser.add_argument(flag, type=kind[1], nargs="+", default=default)
        else:
            parser.add_argument(flag, type=kind, default=default)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    names = [f.name for f in dataclasses.fields(EngineArgs) if f.name != "model"]
    _add_dataclass_flags(parser, EngineArgs, names, {})


def add_sampling_args(parser: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    _add_dataclass_flags(parser, SamplingParams, _SAMPLING_FLAGS, defaults)


def engine_args_from(ns: argparse.Namespace, model: str | None) -> EngineArgs:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs) if f.name != "model"}
    return EngineArgs(model=model, **values)


def sampling_params_from(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(seed=ns.seed, **{name: getattr(ns, name) for name in _SAMPLING_FLAGS})
