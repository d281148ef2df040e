"""Clients that leave mid-request: 50 streaming clients disconnect after their first tokens (some
with a FIN, some with a RST), and non-streaming clients hang up while their requests run. After
each wave the engine has zero running requests and zero referenced KV blocks (its scheduler and
block manager say so), the server holds no sequence, and the aborts are counted."""
import asyncio
import json
import re
import time

from test_server_support import assert_clean, one_blas_thread, request, srv  # noqa: F401

TOKEN = re.compile(rb'"(text|content)":"[^"]')


def _post(path: str, body: dict) -> bytes:
    raw = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(raw)}\r\n\r\n").encode() + raw


async def _streaming_client(port: int, i: int, deadline: float) -> int:
    """Reads until `want` token events arrived, then disconnects; returns the events seen."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    chat = i % 5 == 4
    body = {"model": "smol", "max_tokens": 120, "stream": True, "ignore_eos": True, "temperature": 1.0, "seed": i}
    if chat:
        body["messages"] = [{"role": "user", "content": f"Tell story {i}."}]
    else:
        body["prompt"] = f"Story {i}: once"
    writer.write(_post("/v1/chat/completions" if chat else "/v1/completions", body))
    await writer.drain()
    want = 2 if i % 3 == 0 else 1
    buf, seen = b"", 0
    while seen < want:
        left = deadline - time.monotonic()
        assert left > 0, f"client {i}: no token before the deadline"
        data = await asyncio.wait_for(reader.read(65536), left)
        assert data, f"client {i}: the server closed the stream early: {buf[-200:]!r}"
        buf += data
        seen = len(TOKEN.findall(buf))
    assert buf.startswith(b"HTTP/1.1 200"), buf[:100]
    if i % 2:
        writer.transport.abort()                 # RST
    else:
        writer.close()                           # FIN
    return seen


def _aborts(port) -> float:
    body = request(port, "GET", "/metrics")[2].decode()
    m = re.search(r'vllm:request_success_total\{finished_reason="abort",model_name="smol"\} (\S+)', body)
    return float(m.group(1))


def test_50_streaming_clients_disconnect_mid_stream(srv):
    assert_clean(srv)
    before = _aborts(srv.port)

    async def main():
        deadline = time.monotonic() + 240
        return await asyncio.gather(*(_streaming_client(srv.port, i, deadline) for i in range(50)))

    seen = asyncio.run(main())
    assert len(seen) == 50 and all(s >= 1 for s in seen)
    assert_clean(srv, timeout=120)
    assert _aborts(srv.port) - before == 50               # every one aborted, none ran to the end
    s = request(srv.port, "GET", "/metrics")[2].decode()
    assert 'vllm:num_requests_running{model_name="smol"} 0.0' in s
    assert 'vllm:kv_cache_usage_perc{model_name="smol"} 0.0' in s


def test_non_streaming_clients_disconnect(srv):
    assert_clean(srv)
    before = _aborts(srv.port)
    engine = srv.engine

    async def main():
        conns = []
        for i in range(5):
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(_post("/v1/completions", {"model": "smol", "prompt": f"List {i}:", "max_tokens": 200,
                                                   "ignore_eos": True}))
            await writer.drain()
            conns.append(writer)
        t0 = time.monotonic()
        while len(engine.requests) < 5:                  # all five are running in the engine
            assert time.monotonic() - t0 < 120, "the requests never reached the engine"
            await asyncio.sleep(0.05)
        for w in conns:
            w.close()

    asyncio.run(main())
    assert_clean(srv, timeout=120)
    assert _aborts(srv.port) - before == 5
