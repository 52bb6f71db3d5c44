"""``novainfer serve``: the OpenAI-compatible HTTP server on one or more models."""

from __future__ import annotations

import argparse
import logging
import os

from novainfer.builtin_models import served_model_name
from novainfer.entrypoints.cli import args as cli_args

API_KEY_ENV = "NOVAINFER_API_KEY"


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    serve = sub.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API",
                           description="Serve one or more models over an OpenAI-compatible HTTP API. Requests "
                                       "pick a model by its served name (the request's 'model' field).")
    serve.add_argument("models", nargs="*", metavar="MODEL",
                       help="models to serve: directories, .gguf files, or the built-in 'smollm2' "
                            "(SmolLM2-135M-Instruct, the default) or 'tiny' (a tiny random-weight test model)")
    serve.add_argument("--model", dest="extra_models", action="append", default=[], metavar="MODEL",
                       help="another model to serve (repeatable)")
    serve.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                       help="the name clients use for the model at the same position (repeatable; "
                            "default: the MODEL argument as given, or a built-in model's own name)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-server-count", type=int, default=1, metavar="N",
                       help="HTTP server processes sharing the port and each model's engine core (raise it when one "
                            "process's CPU, not the engine, limits streamed tokens per second)")
    auth = serve.add_argument_group("authentication and network edge")
    auth.add_argument("--api-key", action="append", default=[], metavar="KEY",
                      help=f"accept 'Authorization: Bearer KEY' (repeatable: each key is its own client); with a "
                           f"key, every route but the Web UI's files, /health, /version and /metrics needs one "
                           f"(default: ${API_KEY_ENV}, if set)")
    auth.add_argument("--api-key-file", default=None, metavar="PATH",
                      help="a file of API keys, one per line (blank lines and lines starting with # ignored)")
    auth.add_argument("--metrics-require-key", action="store_true", help="/metrics needs a key too")
    auth.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                      help="Host header values accepted ('*': any; default: localhost, 127.0.0.1, ::1 and the "
                           "bound address, or any when bound to 0.0.0.0 or ::)")
    auth.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                      help="origins allowed by CORS (default: none, CORS off)")
    auth.add_argument("--request-timeout", type=float, default=30.0,
                      help="seconds within which a request's body must have arrived (else 408)")
    auth.add_argument("--max-body-bytes", type=int, default=32 << 20,
                      help="largest request body in bytes (larger: 413)")
    auth.add_argument("--enable-docs", action="store_true",
                      help="serve the interactive API docs at /docs and /redoc (they load their scripts from a "
                           "CDN, so they need the browser to be online)")
    serve.add_argument("--engine-stall-timeout", type=float, default=60.0,
                       help="seconds a busy engine may go without finishing a step before /health answers 503")
    limits = serve.add_argument_group("backpressure")
    limits.add_argument("--max-waiting-requests", type=int, default=512,
                        help="most sequences (prompts x n) waiting per model; beyond it requests get 429")
    limits.add_argument("--max-queued-prompt-tokens", type=int, default=None,
                        help="most prompt tokens waiting per model; beyond it requests get 429")
    limits.add_argument("--max-concurrent-requests-per-client", type=int, default=None,
                        help="most in-flight requests per client (its API key, else its address)")
    limits.add_argument("--retry-after", type=int, default=1, help="seconds sent in Retry-After with a 429")
    sessions = serve.add_argument_group("sessions")
    sessions.add_argument("--max-sessions", type=int, default=1024,
                          help="most stored chat sessions per client (its least recently used are dropped)")
    sessions.add_argument("--session-ttl", type=float, default=3600.0,
                          help="seconds an idle chat session is kept")
    serve.add_argument("--disable-log-requests", action="store_true", help="no log line per finished request")
    serve.add_argument("--no-webui", dest="webui", action="store_false", help="do not serve the chat Web UI at /")
    serve.add_argument("--uvicorn-log-level", default="warning",
                       choices=["critical", "error", "warning", "info", "debug", "trace"])
    cli_args.add_engine_args(serve)
    serve.set_defaults(func=cmd_serve)
    return serve


def server_config_from(ns: argparse.Namespace):
    """Builds the ServerConfig (and one EngineArgs per model) from parsed flags."""
    from novainfer.entrypoints.openai.admission import AdmissionLimits
    from novainfer.entrypoints.openai.config import ServerConfig
    from novainfer.entrypoints.openai.served_models import ModelSpec

    paths: list[str | None] = list(ns.models) + list(ns.extra_models)
    if not paths:
        paths = [None]
    names = list(ns.served_model_name)
    if len(names) > len(paths):
        raise ValueError(f"{len(names)} --served-model-name given for {len(paths)} model(s)")
    names += [served_model_name(p) for p in paths[len(names):]]
    specs = [ModelSpec(name, cli_args.engine_args_from(ns, path)) for name, path in zip(names, paths)]
    limits = AdmissionLimits(max_waiting_requests=ns.max_waiting_requests,
                             max_queued_prompt_tokens=ns.max_queued_prompt_tokens,
                             max_concurrent_per_client=ns.max_concurrent_requests_per_client,
                             retry_after_s=ns.retry_after)
    return ServerConfig(models=specs, host=ns.host, port=ns.port, api_keys=api_keys_from(ns),
                        metrics_require_key=ns.metrics_require_key, limits=limits, max_sessions=ns.max_sessions,
                        session_ttl_s=ns.session_ttl, log_requests=not ns.disable_log_requests,
                        max_body_bytes=ns.max_body_bytes, request_timeout_s=ns.request_timeout,
                        allowed_hosts=ns.allowed_hosts, allowed_origins=ns.allowed_origins,
                        enable_docs=ns.enable_docs, engine_stall_timeout_s=ns.engine_stall_timeout,
                        uvicorn_log_level=ns.uvicorn_log_level, webui=ns.webui, api_server_count=ns.api_server_count)


def api_keys_from(ns: argparse.Namespace) -> list[str]:
    """--api-key values, then the keys of --api-key-file, else $NOVAINFER_API_KEY (duplicates dropped)."""
    keys = list(ns.api_key)
    if ns.api_key_file:
        with open(ns.api_key_file, encoding="utf-8") as f:
            keys += [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise ValueError(f"--api-key-file {ns.api_key_file} holds no key")
    if not keys and os.environ.get(API_KEY_ENV):
        keys = [os.environ[API_KEY_ENV].strip()]
    return list(dict.fromkeys(keys))


def cmd_serve(ns: argparse.Namespace) -> int:
    from novainfer.entrypoints.openai.api_server import run_server
    from novainfer.entrypoints.openai.multi_server import run_api_servers

    if ns.log_level.upper() == "WARNING":  # the global default: a server still logs its requests and start-up
        for name in ("novainfer.entrypoints.openai", "novainfer.engine.async_llm_engine"):
            logging.getLogger(name).setLevel(logging.INFO)
    config = server_config_from(ns)
    return run_server(config) if config.api_server_count == 1 else run_api_servers(config)
