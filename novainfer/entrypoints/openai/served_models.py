"""The models a server serves: one AsyncLLMEngine per model, looked up by the request's ``model``.

Engines load in a background thread after the HTTP server is already listening, so ``/health``
can answer 503 (loading) instead of refusing connections. A load failure is fatal: it is logged
and reported through ``on_failure`` (the CLI stops the server).
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from novainfer.engine.arg_utils import EngineArgs
from novainfer.engine.async_llm_engine import AsyncLLMEngine
from novainfer.engine.core_client import CoreHandle
from novainfer.engine.llm_engine import EngineStats
from novainfer.entrypoints.openai.errors import OpenAIError
from novainfer.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)

T = TypeVar("T")


# The most characters (or tokens to decode) tokenized on the event loop itself.
INLINE_TOKENIZER_SIZE = 4096
# How often an API server process that has its models looks whether the others have theirs.
_PEER_POLL_S = 0.02


@dataclass(frozen=True)
class ModelSpec:
    """What to serve: the served name and the engine arguments (``model`` is the directory)."""

    name: str
    engine_args: EngineArgs


@dataclass
class ServedModel:
    name: str
    engine: AsyncLLMEngine
    tokenizer: Any  # the server's own instance: the engine thread's one is never shared
    # The smaller of the configured context and what the KV cache holds for one request.
    max_model_len: int
    vocab_size: int
    # Tokenizing a long prompt or rendering a long chat runs on this one thread (one at a time, so
    # the tokenizer is never used concurrently), not on the event loop. Its queue is bounded in
    # effect: prompts are bounded in characters before they get here, and admission bounds how many
    # requests wait.
    tokenizer_thread: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        1, thread_name_prefix="novainfer-tokenizer"))
    # Texts waiting for the tokenizer thread's next batch (see encode), and whether a drain of them
    # is queued or running there.
    _encode_jobs: list[tuple[list[str], asyncio.Future]] = field(default_factory=list)
    _encode_lock: threading.Lock = field(default_factory=threading.Lock)
    _draining: bool = False

    async def run_tokenizer(self, fn: Callable[..., T], *args: Any, size: int, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, where ``size`` is the characters it encodes (or tokens it decodes).
        Small work runs right here: handing it to the thread costs the thread a wait for the GIL,
        up to the interpreter's switch interval (5 ms) while the loop is busy streaming, which
        capped a burst's admission at about 200 requests/s; encoding a few thousand characters
        takes about a millisecond."""
        if size <= INLINE_TOKENIZER_SIZE:
            return fn(*args, **kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizer_thread, functools.partial(fn, *args, **kwargs))

    async def encode(self, texts: list[str]) -> list[list[int]]:
        """The token ids of each text as ``tokenizer.encode(text, add_special_tokens=False)`` gives them,
        from the tokenizer thread, which encodes every text waiting at that moment in one batch call.
        A fast tokenizer encodes a batch in parallel without holding the GIL, so prompts cost the event
        loop next to nothing (encoded on the loop, they took about 40% of its time admitting a
        500-request burst, and the loop ran one 200 ms turn after another), and a burst pays the
        thread's wait for the GIL behind a busy loop (up to the switch interval) once per batch."""
        if not texts:
            return []
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._encode_lock:
            self._encode_jobs.append((texts, future))
            start, self._draining = not self._draining, True
        if start:
            loop.run_in_executor(self.tokenizer_thread, self._drain_encode_jobs, loop)
        return await future

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]

    def _drain_encode_jobs(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the tokenizer thread: the waiting jobs' texts in one call, until no job waits."""
        while True:
            with self._encode_lock:
                jobs, self._encode_jobs = self._encode_jobs, []
                if not jobs:
                    self._draining = False
                    return
            results: list[list[list[int]] | BaseException] = []
            try:
                ids = self._encode_batch([text for texts, _ in jobs for text in texts])
                start = 0
                for texts, _ in jobs:
                    results.append(ids[start:start + len(texts)])
                    start += len(texts)
            except Exception:
                # A text the tokenizer refuses fails its own request only.
                results = [self._encode_alone(texts) for texts, _ in jobs]
            try:
                loop.call_soon_threadsafe(_resolve_encode_jobs, [future for _, future in jobs], results)
            except RuntimeError:  # the loop closed (shutdown): no one waits for these
                pass

    def _encode_alone(self, texts: list[str]) -> list[list[int]] | BaseException:
        try:
            return self._encode_batch(texts)
        except Exception as exc:
            return exc


def _resolve_encode_jobs(futures: list[asyncio.Future], results: list[list[list[int]] | BaseException]) -> None:
    for future, result in zip(futures, results):
        if future.done():  # the request was cancelled (its client went away)
            continue
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)


@dataclass(frozen=True)
class ReadyBarrier:
    """Makes the API server processes of one server ready together. They share one listening socket,
    so any of them may take any connection: one still attaching to its engine core answered 503
    ("loading") right after another had answered /health with 200. Each marks itself ready with a
    file in ``directory``, and counts as ready once all ``count`` have."""

    directory: str
    index: int
    count: int

    def arrive(self) -> None:
        Path(self.directory, str(self.index)).touch()

    def all_arrived(self) -> bool:
        return all(Path(self.directory, str(i)).exists() for i in range(self.count))


class LoadState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    STOPPED = "stopped"


class ModelRegistry:
    """The served models by name. With ``cores`` (one of several API server processes) each
    model's engine core was started by the supervisor process, and loading attaches to it."""

    def __init__(self, specs: list[ModelSpec], cores: dict[str, CoreHandle] | None = None,
                 ready_barrier: ReadyBarrier | None = None) -> None:
        if not specs:
            raise ValueError("at least one model must be served")
        names = [s.name for s in specs]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"served model names must be unique, got {duplicates} more than once")
        self.specs = specs
        self.cores = cores
        self.ready_barrier = ready_barrier
        self.names = names
        self._models: dict[str, ServedModel] = {}
        self.state = LoadState.LOADING
        self.error: str | None = None
        self._thread: threading.Thread | None = None
        self.stall_timeout_s = 60.0  # a busy engine without a finished step for longer is unhealthy
        self._finish_counters: dict[str, Callable[[str], None]] = {}

    # ---- loading ------------------------------------------------------------------------------
    @classmethod
    def from_engines(cls, engines: dict[str, AsyncLLMEngine]) -> ModelRegistry:
        """A registry around engines built elsewhere (tests, embedding the app)."""
        registry = cls([ModelSpec(name, EngineArgs()) for name in engines])
        for name, engine in engines.items():
            registry._models[name] = registry._serve(name, engine)
        registry.state = LoadState.READY
        return registry

    def count_finishes_with(self, counters: dict[str, Callable[[str], None]]) -> None:
        """Has each model's engine, loaded or still to load, report every finished sequence's finish
        reason to ``counters[model name]``."""
        self._finish_counters = counters
        for model in self._models.values():
            model.engine.output_processor.on_finished = counters.get(model.name)

    def _serve(self, name: str, engine: AsyncLLMEngine) -> ServedModel:
        engine.output_processor.on_finished = self._finish_counters.get(name)
        config = engine.model_config
        tokenizer = get_tokenizer(config.tokenizer)
        kv = engine.core.info
        capacity = kv.kv_capacity
        max_model_len = min(config.max_model_len, capacity)
        logger.info("model '%s': max_model_len=%d (configured %d; the KV cache holds %d blocks x %d = %d tokens)",
                    name, max_model_len, config.max_model_len, kv.num_blocks, kv.block_size, capacity)
        return ServedModel(name, engine, tokenizer, max_model_len, config.vocab_size)

    def load(self) -> None:
        """Loads every model in the calling thread; sets ``state``."""
        try:
            for spec in self.specs:
                logger.info("loading model '%s'", spec.name)
                engine = AsyncLLMEngine.attach(self.cores[spec.name], spec.name) if self.cores is not None \
                    else AsyncLLMEngine.from_engine_args(spec.engine_args, name=spec.name)
                self._models[spec.name] = self._serve(spec.name, engine)
                logger.info("model '%s' ready", spec.name)
            if self.ready_barrier is not None:
                self._wait_for_peers(self.ready_barrier)
        except Exception as exc:
            logger.exception("loading the models failed")
            self.error = f"{type(exc).__name__}: {exc}"
            self.state = LoadState.FAILED
            raise
        if self.state == LoadState.LOADING:
            self.state = LoadState.READY
        else:  # stopped while loading
            self.shutdown()

    def _wait_for_peers(self, barrier: ReadyBarrier) -> None:
        """Until every API server process has its models (or this registry stops)."""
        barrier.arrive()
        while not barrier.all_arrived() and self.state == LoadState.LOADING:
            time.sleep(_PEER_POLL_S)

    def load_in_background(self, on_failure: Callable[[str], None] | None = None) -> None:
        def run() -> None:
            try:
                self.load()
            except Exception:
                if on_failure is not None:
                    on_failure(self.error or "model loading failed")

        self._thread = threading.Thread(target=run, name="novainfer-model-loader", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self.state = LoadState.STOPPED
        for model in self._models.values():
            model.engine.shutdown()
            model.tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    # ---- lookups ------------------------------------------------------------------------------
    def health(self) -> tuple[bool, str]:
        """(healthy, reason)."""
        if self.state == LoadState.LOADING:
            return False, "the server is loading its model(s)"
        if self.state == LoadState.FAILED:
            return False, f"loading the model(s) failed: {self.error}"
        if self.state == LoadState.STOPPED:
            return False, "the server is shutting down"
        dead = [name for name, m in self._models.items() if not m.engine.is_healthy]
        if dead:
            errors = "; ".join(str(self._models[n].engine.dead_error or "stopped") for n in dead)
            return False, f"engine(s) {dead} are not running: {errors}"
        for name, model in self._models.items():
            stalled = model.engine.seconds_without_progress()
            if stalled > self.stall_timeout_s:
                return False, (f"the engine of model '{name}' has work but finished no step for {stalled:.1f} s "
                               f"(limit {self.stall_timeout_s:g} s)")
        return True, "ok"

    def alive(self) -> dict[str, bool]:
        """Whether each loaded model's engine is running."""
        return {m.name: m.engine.is_healthy for m in self.ready_models()}

    def get(self, name: str | None) -> ServedModel:
        """The served model named by a request (None: the first); raises OpenAIError 404/503."""
        if name is not None and name not in self.names:
            served = ", ".join(f"'{n}'" for n in self.names)
            raise OpenAIError(f"the model '{name}' does not exist; this server serves {served}", 404,
                              param="model", code="model_not_found")
        name = name if name is not None else self.names[0]
        if self.state != LoadState.READY:
            _, reason = self.health()
            raise OpenAIError(reason, 503, code="not_ready")
        model = self._models[name]
        if not model.engine.is_healthy:
            raise OpenAIError(f"the engine of model '{name}' is not running: {model.engine.dead_error}", 503,
                              code="engine_dead")
        return model

    def ready_models(self) -> list[ServedModel]:
        return [self._models[n] for n in self.names if n in self._models]

    def stats(self) -> dict[str, EngineStats]:
        return {m.name: m.engine.get_stats() for m in self.ready_models()}
