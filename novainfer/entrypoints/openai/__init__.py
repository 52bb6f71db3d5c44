"""The OpenAI-compatible HTTP server (``novainfer serve``).

Modules: ``api_server`` (app factory, routes, uvicorn), ``protocol`` (request/response bodies),
``serving_chat`` / ``serving_completion`` (the two generation endpoints), ``serving_common``
(shared request plumbing), ``streaming`` (SSE, disconnects), ``logprobs`` (OpenAI's formats),
``errors`` and ``middleware`` (error bodies, request ids, auth), ``admission`` (backpressure),
``sessions`` (server-side chat history), ``metrics`` (Prometheus, request log), ``served_models``
(one AsyncLLMEngine per served model) and ``config``.
"""
