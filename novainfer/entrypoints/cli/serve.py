"""``novainfer serve``: the OpenAI-compatible HTTP server on one or more models."""

from __future__ import annotations

import argparse
import logging
import os

from novainfer.entrypoints.cli import args as cli_args

# The served name of the built-in tiny model (used when no model is given).
TINY_MODEL_NAME = "novainfer-tiny"
API_KEY_ENV = "NOVAINFER_API_KEY"


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    serve = sub.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API",
                           description="Serve one or more models over an OpenAI-compatible HTTP API. Requests "
                                       "pick a model by its served name (the request's 'model' field).")
    serve.add_argument("models", nargs="*", metavar="MODEL",
                       help="model directories or .gguf files to serve (default: the built-in tiny model)")
    serve.add_argument("--model", dest="extra_models", action="append", default=[], metavar="MODEL",
                       help="another model directory or .gguf file to serve (repeatable)")
    serve.add_argument("--served-model-name", action="append", default=[], metavar="NAME",
                       help="the name clients use for the model at the same position (repeatable; "
                            "default: the MODEL argument as given)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                       help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, if set)")
    limits = serve.add_argument_group("backpressure")
    limits.add_argument("--max-waiting-requests", type=int, default=512,
                        help="most sequences (prompts x n) waiting per model; beyond it requests get 429")
    limits.add_argument("--max-queued-prompt-tokens", type=int, default=None,
                        help="most prompt tokens waiting per model; beyond it requests get 429")
    limits.add_argument("--max-concurrent-requests-per-client", type=int, default=None,
                        help="most in-flight requests per client (the request's 'user', else its address)")
    limits.add_argument("--retry-after", type=int, default=1, help="seconds sent in Retry-After with a 429")
    sessions = serve.add_argument_group("sessions")
    sessions.add_argument("--max-sessions", type=int, default=1024,
                          help="most stored chat sessions (least recently used are dropped)")
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
    names += [p if p is not None else TINY_MODEL_NAME for p in paths[len(names):]]
    specs = [ModelSpec(name, cli_args.engine_args_from(ns, path)) for name, path in zip(names, paths)]
    limits = AdmissionLimits(max_waiting_requests=ns.max_waiting_requests,
                             max_queued_prompt_tokens=ns.max_queued_prompt_tokens,
                             max_concurrent_per_client=ns.max_concurrent_requests_per_client,
                             retry_after_s=ns.retry_after)
    return ServerConfig(models=specs, host=ns.host, port=ns.port, api_key=ns.api_key or None, limits=limits,
                        max_sessions=ns.max_sessions, session_ttl_s=ns.session_ttl,
                        log_requests=not ns.disable_log_requests, uvicorn_log_level=ns.uvicorn_log_level,
                        webui=ns.webui)


def cmd_serve(ns: argparse.Namespace) -> int:
    from novainfer.entrypoints.openai.api_server import run_server

    if ns.log_level.upper() == "WARNING":  # the global default: a server still logs its requests and start-up
        for name in ("novainfer.entrypoints.openai", "novainfer.engine.async_llm_engine"):
            logging.getLogger(name).setLevel(logging.INFO)
    return run_server(server_config_from(ns))
