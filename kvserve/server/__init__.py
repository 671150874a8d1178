"""The OpenAI-compatible HTTP server (``kvserve serve``).

Two processes: this package's FastAPI app (tokenize, detokenize, HTTP, metrics)
and the engine process (``engine_proc``: scheduler + model runner, the one engine
core loop), joined by two ZMQ PUSH/PULL sockets over IPC. Server-only libraries
(FastAPI, uvicorn, pyzmq, prometheus-client) are imported only inside this package,
so ``import kvserve`` and ``Engine`` work without them.
"""
