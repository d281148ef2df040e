"""infc.server: the OpenAI-compatible HTTP server over the engine handle (`infc serve`).

    args.py      the command line: vLLM's flag spellings and defaults
    backend.py   builds the engine for a device (cpu: reference executor; cuda: CUDA runner)
    app.py       FastAPI routes, SSE, errors, auth, limits, disconnects
    protocol.py  request bodies checked field by field; OpenAI-shaped errors
    chat.py      chat templates rendered as HF renders them
    scoring.py   prompt logprobs (echo) through the engine's public door
    metrics.py   /metrics in Prometheus text with vLLM's names
    serve.py     uvicorn (TCP_NODELAY), startup, a background-thread server for tests
"""
