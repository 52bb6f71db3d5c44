"""The server's own settings (the engines' are EngineArgs, one per served model)."""

from __future__ import annotations

from dataclasses import dataclass, field

from novainfer.entrypoints.openai.admission import AdmissionLimits
from novainfer.entrypoints.openai.served_models import ModelSpec


@dataclass
class ServerConfig:
    models: list[ModelSpec]
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    limits: AdmissionLimits = field(default_factory=AdmissionLimits)
    max_sessions: int = 1024
    session_ttl_s: float = 3600.0
    log_requests: bool = True
    max_body_bytes: int = 32 << 20  # larger request bodies are refused with 413
    uvicorn_log_level: str = "warning"
    graceful_shutdown_s: float = 5.0
    webui: bool = True  # serve the chat Web UI at /

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if not self.session_ttl_s > 0:
            raise ValueError(f"session_ttl_s must be > 0, got {self.session_ttl_s}")
