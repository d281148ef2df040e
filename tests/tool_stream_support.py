"""Shared by the tool-call tests (no tests here): a chat answer's stream deltas joined by the
openai SDK's own accumulator (ChatCompletionStreamState, what client.chat.completions.stream
uses; sdk_stream reads a live server's stream with it), and a message as (content, reasoning, [(name, arguments)])."""
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk


def sdk_join(deltas: list[dict], finish: str = "stop"):
    """The message the SDK builds from these deltas (one chunk each, as the server sends)."""
    state = ChatCompletionStreamState()
    chunks = [{"role": "assistant", "content": ""}] + deltas
    for k, d in enumerate(chunks):
        state.handle_chunk(ChatCompletionChunk.model_validate({
            "id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": d, "finish_reason": finish if k == len(chunks) - 1 else None}]}))
    return state.current_completion_snapshot.choices[0].message


def sdk_stream(client, **kw) -> list:
    """A streamed request's choices as the SDK's accumulator holds them at the end (its snapshot:
    get_final_completion would refuse an answer cut off by max_tokens)."""
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
    return state.current_completion_snapshot.choices


def shape(message) -> tuple:
    """(content, reasoning, [(name, arguments)]) of an SDK message or a message dict."""
    m = message if isinstance(message, dict) else message.model_dump()
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in (m.get("tool_calls") or [])]
    return (m.get("content") or "", m.get("reasoning_content") or "", calls)
