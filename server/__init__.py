"""infc.server: the OpenAI-compatible HTTP server over the engine handle (`infc serve`); the
engine itself is built by infc/backend.py, shared with `LLM`.

    args.py      the command line: vLLM's flag spellings and defaults
    app.py       Starlette routes, SSE, errors, auth, limits, disconnects
    protocol.py  request bodies checked field by field; OpenAI-shaped errors
    offload.py   the worker pool: parsing, templating, tokenization off the event loop
    admission.py admission by cost (sequences, prompt scoring included); the 429
    chat.py      chat templates rendered as HF renders them
    outputs.py   a request's structured output, tool calling and reasoning, applied to it
    structured.py  response_format / structured_outputs / guided_* -> StructuredOutputs
    tools.py     tools and tool_choice checked; the grammar of required / named calls
    tool_parsers/  tool-call formats by vLLM's names (--tool-call-parser), streamed as deltas; harmony.py GPT-OSS's messages
    reasoning.py <think> sections (or harmony's analysis channel) split into reasoning_content (--reasoning-parser)
    chat_output.py  a chat answer shaped into message / stream deltas
    scoring.py   prompt logprobs (echo) through the engine's public door
    metrics.py   /metrics in Prometheus text with vLLM's names
    serve.py     uvicorn (TCP_NODELAY), startup, a background-thread server for tests
"""
