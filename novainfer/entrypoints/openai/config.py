"""The server's own settings (the engines' are EngineArgs, one per served model)."""

from __future__ import annotations

from dataclasses import dataclass, field

from novainfer.engine.core_client import CoreHandle
from novainfer.entrypoints.openai.admission import AdmissionLimits
from novainfer.entrypoints.openai.middleware import default_allowed_hosts
from novainfer.entrypoints.openai.served_models import ModelSpec


@dataclass(frozen=True)
class SharedServing:
    """What one of several API server processes (``api_server_count`` > 1) shares with the others;
    the supervisor process sets it (see ``novainfer.entrypoints.openai.multi_server``)."""

    index: int  # of this process, from 0
    count: int
    cores: dict[str, CoreHandle]  # per served model: the engine core this process attaches to
    metrics_dir: str  # where each process keeps its metrics, summed at a scrape
    session_address: str  # the supervisor's session service (a ZMQ address)
    ready_dir: str  # where each process marks itself ready (see served_models.ReadyBarrier)


@dataclass
class ServerConfig:
    models: list[ModelSpec]
    host: str = "127.0.0.1"
    port: int = 8000
    # Accepted API keys (none: no key needed); each names its own principal.
    api_keys: list[str] = field(default_factory=list)
    metrics_require_key: bool = False
    limits: AdmissionLimits = field(default_factory=AdmissionLimits)
    max_sessions: int = 1024  # per principal: one client's sessions never evict another's
    session_ttl_s: float = 3600.0
    log_requests: bool = True
    max_body_bytes: int = 32 << 20  # larger request bodies are refused with 413
    request_timeout_s: float = 30.0  # a request body must have arrived by then (else 408)
    # Host header values accepted (None: any); the default depends on the bound address.
    allowed_hosts: list[str] | None = None
    allowed_origins: list[str] = field(default_factory=list)  # CORS stays off when empty
    enable_docs: bool = False  # /docs and /redoc (the OpenAPI schema itself is always served)
    engine_stall_timeout_s: float = 60.0  # /health is 503 when a busy engine made no step for this long
    uvicorn_log_level: str = "warning"
    graceful_shutdown_s: float = 5.0
    webui: bool = True  # serve the chat Web UI at /
    # API server processes in front of the engine cores (1: this process serves HTTP itself).
    api_server_count: int = 1
    shared: SharedServing | None = None  # set in each of several API server processes

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if any(not k.strip() or k != k.strip() for k in self.api_keys):
            raise ValueError("API keys must be non-empty and carry no surrounding whitespace")
        if self.allowed_hosts is None:
            self.allowed_hosts = default_allowed_hosts(self.host)
        elif "*" in self.allowed_hosts:
            self.allowed_hosts = None
        for name in ("request_timeout_s", "engine_stall_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.api_server_count < 1:
            raise ValueError(f"api_server_count must be >= 1, got {self.api_server_count}")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if not self.session_ttl_s > 0:
            raise ValueError(f"session_ttl_s must be > 0, got {self.session_ttl_s}")
