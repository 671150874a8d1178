"""The OpenAI-compatible HTTP server (``kvserve serve``).

Two processes: this package's FastAPI app (tokenize, detokenize, HTTP, metrics)
and the engine process (``kvserve.engine.process``: scheduler + model runner, the
one engine core loop), joined by two ZMQ PUSH/PULL sockets over IPC
(``kvserve.engine.client`` is the app's end).

    app.py         create_app: the app over one ``Server`` (in ``app.state.server``)
    state.py       Server, ServerArgs: engine client, tokenizer, in-flight requests
    openai_api.py  /v1/completions, /v1/chat/completions, /v1/models
    native_api.py  /generate, /abort_request, /flush_cache, /health*, /metrics, info
    http.py        errors, SSE, the endpoint wrapper, the API-key middleware
    protocol.py    request bodies (pydantic) and ApiError

Server-only libraries (FastAPI, uvicorn, pyzmq, prometheus-client) are imported only
inside this package and the engine's ``process`` / ``client`` modules, so
``import kvserve`` and ``Engine`` work without them.
"""
