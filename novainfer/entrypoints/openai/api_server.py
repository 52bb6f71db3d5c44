"""The OpenAI-compatible HTTP server: app factory, routes, and running it under uvicorn.

    novainfer serve [MODEL ...] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine flags]

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET|POST /v1/sessions,
GET|DELETE /v1/sessions/{id}, POST /tokenize, POST /detokenize, GET|HEAD /health, GET /metrics,
GET /version, GET /openapi.json, /docs and /redoc (only with ``enable_docs``), and the chat Web UI
at / (unless ``ServerConfig.webui`` is off).
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable

import anyio
from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import novainfer
from novainfer.entrypoints.openai.admission import AdmissionController, AdmissionLimits
from novainfer.entrypoints.openai.config import ServerConfig
from novainfer.entrypoints.openai.errors import OpenAIError, error_body, install_exception_handlers, \
    request_id_of
from novainfer.entrypoints.openai.http_protocol import protocol_with_header_deadline
from novainfer.entrypoints.openai.metrics import ServerMetrics
from novainfer.entrypoints.openai.middleware import AuthMiddleware, BodyLimitMiddleware, HostCheckMiddleware, \
    RequestIdMiddleware
from novainfer.entrypoints.openai.protocol import ChatCompletionRequest, ChatCompletionResponse, \
    CompletionRequest, CompletionResponse, DetokenizeRequest, DetokenizeResponse, ErrorResponse, \
    HealthResponse, ModelCard, ModelList, SessionCreateRequest, SessionDeleted, SessionDetail, SessionInfo, \
    SessionList, TokenizeRequest, TokenizeResponse, VersionResponse
from novainfer.entrypoints.openai.served_models import ModelRegistry, ReadyBarrier
from novainfer.entrypoints.openai.serving_chat import ChatHandler, messages_chars, plain_messages, tokenize_chat
from novainfer.entrypoints.openai.serving_common import ServerContext, check_before_tokenizing, principal_of
from novainfer.entrypoints.openai.serving_completion import CompletionHandler
from novainfer.entrypoints.openai.sessions import RemoteSessionStore, Session, SessionStore
from novainfer.entrypoints.openai.webui import mount_webui

logger = logging.getLogger(__name__)

# Every status a route may answer besides 200, each with OpenAI's error body (400: validation; 401:
# key; 404: model or session; 408/413: body; 429: overload; 500/503: server). /health, /version
# and /metrics never need a key.
_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 408, 413, 429, 500, 503)}
_OPEN_ERRORS = {status: {"model": ErrorResponse} for status in (400, 408, 413, 500, 503)}
_SSE = {"text/event-stream": {"schema": {"type": "string"}}}


def _context(request: Request) -> ServerContext:
    return request.app.state.ctx


def _no_session(session_id: str) -> OpenAIError:
    # Another principal's session is "not found", exactly like one that never existed.
    return OpenAIError(f"no session '{session_id}' (never created, deleted, or expired)", 404,
                       param="session_id", code="session_not_found")


def _session_info(session: Session, cls=SessionInfo, **extra) -> SessionInfo:
    return cls(id=session.id, model=session.model, created=int(session.created), last_used=int(session.last_used),
               num_messages=len(session.messages), **extra)


def _add_routes(router: APIRouter) -> None:
    """The API's routes, on the app's own router: an included router (``include_router``) builds
    its routes' state at the first request and matches every request through one more layer."""

    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse,
                 responses={**_ERRORS, 200: {"content": _SSE}})
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await ChatHandler(_context(request), body, request).handle()

    @router.post("/v1/completions", response_model=CompletionResponse, responses={**_ERRORS, 200: {"content": _SSE}})
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await CompletionHandler(_context(request), body, request).handle()

    @router.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def list_models(request: Request) -> ModelList:
        models = _context(request).models
        lengths = {m.name: m.max_model_len for m in models.ready_models()}
        return ModelList(data=[ModelCard(id=name, root=name, max_model_len=lengths.get(name))
                               for name in models.names])

    @router.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def get_model(model_id: str, request: Request) -> ModelCard:
        model = _context(request).models.get(model_id)
        return ModelCard(id=model.name, root=model.name, max_model_len=model.max_model_len)

    # Sessions live in the namespace of the request's principal: another principal's are not found.
    @router.get("/v1/sessions", response_model=SessionList, responses=_ERRORS)
    async def list_sessions(request: Request) -> SessionList:
        return SessionList(data=[_session_info(s) for s in _context(request).sessions.list(principal_of(request))])

    @router.post("/v1/sessions", response_model=SessionInfo, responses=_ERRORS)
    async def create_session(request: Request, body: SessionCreateRequest | None = None) -> SessionInfo:
        model = _context(request).models.get(body.model if body is not None else None)
        return _session_info(_context(request).sessions.create(principal_of(request), model.name))

    @router.get("/v1/sessions/{session_id}", response_model=SessionDetail, responses=_ERRORS)
    async def get_session(session_id: str, request: Request) -> SessionDetail:
        session = _context(request).sessions.get(principal_of(request), session_id)
        if session is None:
            raise _no_session(session_id)
        return _session_info(session, SessionDetail, messages=session.messages)

    @router.delete("/v1/sessions/{session_id}", response_model=SessionDeleted, responses=_ERRORS)
    async def delete_session(session_id: str, request: Request) -> SessionDeleted:
        if not _context(request).sessions.delete(principal_of(request), session_id):
            raise _no_session(session_id)
        return SessionDeleted(id=session_id)

    @router.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
        model = _context(request).models.get(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError("give exactly one of 'prompt' and 'messages'", param="prompt")
        if body.messages is not None:
            if not body.messages:
                raise OpenAIError("messages must not be empty", param="messages")
            messages = plain_messages(body.messages)
            chars = messages_chars(messages)
            check_before_tokenizing(chars, None, model.max_model_len, "messages")
            tokens = await tokenize_chat(model, messages, body.add_generation_prompt,
                                         body.allow_special_tokens_in_content)
        else:
            check_before_tokenizing(len(body.prompt), None, model.max_model_len, "prompt")
            tokens = await model.run_tokenizer(model.tokenizer.encode, body.prompt, size=len(body.prompt),
                                               add_special_tokens=body.add_special_tokens)
        return TokenizeResponse(count=len(tokens), max_model_len=model.max_model_len, tokens=tokens)

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
        model = _context(request).models.get(body.model)
        if len(body.tokens) > model.max_model_len:
            raise OpenAIError(f"tokens has {len(body.tokens)} ids; at most {model.max_model_len} (the model's "
                              f"context) are accepted", param="tokens")
        bad = next((t for t in body.tokens if not 0 <= t < model.vocab_size), None)
        if bad is not None:
            raise OpenAIError(f"tokens must be in [0, {model.vocab_size}), got {bad}", param="tokens")
        return DetokenizeResponse(prompt=await model.run_tokenizer(model.tokenizer.decode, body.tokens,
                                                                   size=len(body.tokens)))

    @router.get("/health", response_model=HealthResponse, responses=_OPEN_ERRORS)
    async def health(request: Request) -> Response:
        healthy, reason = _context(request).models.health()
        if healthy:
            return JSONResponse({"status": "ok"})
        err = OpenAIError(reason, 503, code="unhealthy")
        return JSONResponse(error_body(err, request_id_of(request)), status_code=503)

    router.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)

    @router.get("/metrics", response_class=Response,
                responses={**_ERRORS, 200: {"content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(_context(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @router.get("/version", response_model=VersionResponse, responses=_OPEN_ERRORS)
    async def version() -> VersionResponse:
        return VersionResponse(version=novainfer.__version__)


def _document_400_not_422(app: FastAPI) -> None:
    """FastAPI documents validation failures as 422; this server answers them with 400."""
    default_openapi = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = default_openapi()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    responses = operation.get("responses", {})
                    if responses.pop("422", None) is not None:
                        responses.setdefault("400", {"description": "Bad Request",
                                                     "content": {"application/json": {
                                                         "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}})
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_app(config: ServerConfig | None = None, *, registry: ModelRegistry | None = None,
              on_load_failure: Callable[[str], None] | None = None) -> FastAPI:
    """The ASGI app. With ``registry`` (already loaded engines) nothing is loaded at startup;
    otherwise the models of ``config`` load in the background once the app starts."""
    if config is None and registry is None:
        raise ValueError("build_app needs a ServerConfig or a ModelRegistry")
    config = config or ServerConfig(models=registry.specs)
    owns_registry = registry is None
    shared = config.shared
    if registry is None:
        registry = ModelRegistry(config.models) if shared is None else ModelRegistry(
            config.models, cores=shared.cores, ready_barrier=ReadyBarrier(shared.ready_dir, shared.index, shared.count))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Streaming responses run on anyio, which imports its event-loop backend on first use: here,
        # not inside the first burst of requests (it took 100 ms of a small machine's event loop).
        await anyio.sleep(0)
        if owns_registry:
            registry.load_in_background(on_load_failure)
        try:
            yield
        finally:
            if owns_registry:
                registry.shutdown()

    registry.stall_timeout_s = config.engine_stall_timeout_s
    docs = {} if config.enable_docs else {"docs_url": None, "redoc_url": None}
    app = FastAPI(title="NovaInfer OpenAI-compatible API", version=novainfer.__version__, lifespan=lifespan, **docs)
    if shared is None:
        metrics = ServerMetrics(registry.stats, registry.alive)
        sessions = SessionStore(config.max_sessions, config.session_ttl_s)
    else:  # one of several API server processes: summed metrics, the supervisor's sessions
        metrics = ServerMetrics(registry.stats, registry.alive, shared_dir=shared.metrics_dir,
                                process_index=shared.index)
        sessions = RemoteSessionStore(shared.session_address)
    registry.count_finishes_with({name: metrics.count_finishes(name) for name in registry.names})
    app.state.ctx = ServerContext(models=registry, admission=AdmissionController(config.limits), metrics=metrics,
                                  sessions=sessions, log_requests=config.log_requests)
    app.state.config = config
    install_exception_handlers(app)
    _add_routes(app.router)
    if config.webui:
        mount_webui(app)
    _document_400_not_422(app)
    _add_middleware(app, config)
    return app


def _add_middleware(app: FastAPI, config: ServerConfig) -> None:
    """Each ``add_middleware`` wraps the ones before it: the last added runs first. From the
    outside in: request id and error logging, Host check, CORS, body bounds, then the key."""
    open_paths = ["/health", "/version", "/", *([] if config.metrics_require_key else ["/metrics"])]
    app.add_middleware(AuthMiddleware, api_keys=config.api_keys, open_paths=open_paths,
                       open_prefixes=["/webui/"] if config.webui else [])
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes, timeout_s=config.request_timeout_s)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-Id"])
    if config.allowed_hosts is not None:
        app.add_middleware(HostCheckMiddleware, allowed_hosts=config.allowed_hosts)
    app.add_middleware(RequestIdMiddleware)


def run_server(config: ServerConfig, sockets: list[socket.socket] | None = None) -> int:
    """Serves until interrupted; returns a process exit code (1 if the models failed to load).
    ``sockets``: already bound listening sockets to serve (one of several API server processes)."""
    import uvicorn

    failure: list[str] = []
    server_ref: list[uvicorn.Server] = []

    def on_load_failure(reason: str) -> None:
        failure.append(reason)
        if server_ref:
            server_ref[0].should_exit = True

    app = build_app(config, on_load_failure=on_load_failure)
    # Request headers have a deadline in the protocol, the body in BodyLimitMiddleware. The event
    # loop is asyncio's, not uvloop, even where uvloop is installed: libuv accepts one connection per
    # turn of the loop, and a turn that serves hundreds of streams lasts milliseconds, so a burst's
    # last connections waited in the kernel's queue, accepted at about 80 per second (asyncio
    # accepts every waiting connection at once). On a 500-request burst (H200) asyncio's loop gave
    # 21% more output tokens per second.
    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.uvicorn_log_level,
                               loop="asyncio", access_log=False, timeout_graceful_shutdown=config.graceful_shutdown_s,
                               http=protocol_with_header_deadline(config.request_timeout_s), lifespan="on")
    server = uvicorn.Server(uv_config)
    server_ref.append(server)
    names = ", ".join(s.name for s in config.models)
    # Several API server processes: the supervisor says it once.
    logger.log(logging.INFO if config.shared is None else logging.DEBUG,
               "serving %s on http://%s:%d (loading models in the background); %s; Host allowed: %s", names,
               config.host, config.port,
               f"{len(config.api_keys)} API key(s) required" if config.api_keys else "no API key required",
               ", ".join(config.allowed_hosts) if config.allowed_hosts is not None else "any")
    try:
        server.run(sockets=sockets)
    except KeyboardInterrupt:  # uvicorn re-raises the signal after its graceful shutdown
        pass
    if failure:
        logger.error("server stopped: %s", failure[0])
        return 1
    return 0


__all__ = ["AdmissionLimits", "ServerConfig", "build_app", "run_server"]
