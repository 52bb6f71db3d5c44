"""Per-request sampling parameters, with vLLM's field names, defaults and ranges."""

from __future__ import annotations

import copy
import enum
import numbers
from dataclasses import dataclass, field

# Temperatures below this are treated as 0, i.e. greedy decoding (same cut-off as vLLM).
SAMPLING_EPS = 1e-5

# Most top alternatives a request may ask for per generated token.
MAX_LOGPROBS = 20


class RequestOutputKind(enum.Enum):
    """Which outputs a request produces while it runs (vLLM's names)."""

    CUMULATIVE = 0  # after every step, the whole output so far (plus the step's delta fields)
    DELTA = 1  # after every step, only what is new: text, token ids and logprobs of that step
    FINAL_ONLY = 2  # only when it finishes: nothing is built for it on the steps before


class SamplingType(enum.IntEnum):
    """How the next token of a request is chosen."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _is_int(value: object) -> bool:
    # bool is an int subclass, but `top_k=True` is a caller mistake, not a number.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _as_int(name: str, value: object) -> int:
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    return float(value)


def _as_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


@dataclass
class SamplingParams:
    """How to sample the continuation of one prompt.

    Range checks use `not (lo <= x <= hi)` forms so that NaN is rejected too.
    Type errors raise TypeError, range errors ValueError; both name the field.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 and -1 both disable top-k; -1 is normalized to 0.
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # None means "until the context is full"; the engine replaces it with a number.
    max_tokens: int | None = 16
    min_tokens: int = 0
    # Number of top alternatives returned besides the sampled token.
    logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # False: outputs carry token ids only (no text), which saves the per-token detokenization.
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    # stop_token_ids plus the model's EOS ids (see update_from_generation_config).
    _all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        self.n = _as_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)

        self.repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

        self.temperature = _as_float("temperature", self.temperature)
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

        self.top_p = _as_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

        self.top_k = _as_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or >= 0 (-1 and 0 disable it), got {self.top_k}")
        if self.top_k == -1:
            self.top_k = 0

        self.min_p = _as_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

        if self.seed is not None:
            self.seed = _as_int("seed", self.seed)
            # Seeds key the sampler's noise as 64-bit values (negative ones wrap, as torch's manual_seed does).
            if not (-(2**63) <= self.seed < 2**64):
                raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")

        self.stop = self._normalize_stop(self.stop)
        self.stop_token_ids = self._normalize_stop_token_ids(self.stop_token_ids)

        self.ignore_eos = _as_bool("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _as_bool("skip_special_tokens", self.skip_special_tokens)
        self.spaces_between_special_tokens = _as_bool(
            "spaces_between_special_tokens", self.spaces_between_special_tokens
        )
        self.include_stop_str_in_output = _as_bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )

        self.detokenize = _as_bool("detokenize", self.detokenize)
        if not self.detokenize and self.stop:
            raise ValueError(f"stop strings need detokenize=True (got stop={self.stop!r} with detokenize=False)")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise TypeError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

        if self.max_tokens is not None:
            self.max_tokens = _as_int("max_tokens", self.max_tokens)
            if self.max_tokens < 1:
                raise ValueError(f"max_tokens must be None or >= 1, got {self.max_tokens}")

        self.min_tokens = _as_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )

        if self.logprobs is not None:
            self.logprobs = _as_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

        if self.is_greedy:
            # Truncation cannot change an argmax; resetting these lets the sampler
            # skip its top-k/top-p/min-p stages for greedy rows.
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

        self._all_stop_token_ids = set(self.stop_token_ids)

    @staticmethod
    def _normalize_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise TypeError(f"stop must be a str, a list of str or None, got {type(stop).__name__}")
        for s in stop:
            if not isinstance(s, str):
                raise TypeError(f"stop must be a list of str, got an element {s!r}")
            if not s:
                raise ValueError(f"stop strings must be non-empty, got {s!r}")
        return list(stop)

    @staticmethod
    def _normalize_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise TypeError(
                f"stop_token_ids must be a list of int or None, got {type(ids).__name__}"
            )
        out = []
        for token_id in ids:
            token_id = _as_int("stop_token_ids", token_id)
            if token_id < 0:
                raise ValueError(f"stop_token_ids must contain only ids >= 0, got {token_id}")
            out.append(token_id)
        return out

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether sampling reads the tokens generated so far (presence, frequency, repetition)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def all_stop_token_ids(self) -> set[int]:
        """Token ids that end generation: stop_token_ids plus EOS ids (unless ignore_eos)."""
        return self._all_stop_token_ids

    def update_from_generation_config(self, eos_token_ids: list[int]) -> None:
        """Add the model's EOS ids to the stop set; called once by the engine per request."""
        if not self.ignore_eos:
            self._all_stop_token_ids.update(eos_token_ids)

    def clone(self) -> SamplingParams:
        """A copy whose containers (stop strings, stop ids) are copies too, so that per-request edits
        (EOS ids, max_tokens) do not leak; their items are immutable. (``copy.deepcopy`` took a
        server about 30 us per request.)"""
        clone = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, (list, set, dict)):
                setattr(clone, name, copy.copy(value))
        return clone
