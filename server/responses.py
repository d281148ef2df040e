"""/v1/responses and /v1/embeddings, as vLLM answers them for a generative model.

vLLM serves the Responses API for every model that generates (its OpenAIServingResponses is built
for the "generate" task) and refuses /v1/embeddings for a model that does not pool ("The model
does not support Embeddings API", 400 BadRequestError). infc serves generative models only, so
it does the same: /v1/embeddings is that 400, and /v1/responses is served over the chat path.

A Responses request becomes a chat request: `instructions` the system message, `input` a string
(one user message) or a list of messages whose content is a string or input_text / output_text
parts; max_output_tokens, temperature, top_p, seed and the rest of the sampling fields as chat
takes them; text.format (json_schema, json_object) its structured output, as chat's
response_format (server/outputs.py). Its answer is vLLM's Response object: one output message
with one output_text part, status "completed" (or "incomplete" with incomplete_details.reason
"max_output_tokens" where the length ran out), usage in input / output tokens. What this server
does not do is refused with a 400 that names it: streaming events, tools, stored responses
(previous_response_id, background), non-text input (images, files, function-call items).
"""
import time
import uuid

from .protocol import APIError, Fields, bad



def embeddings_unsupported() -> APIError:
    return APIError(400, "The model does not support Embeddings API", "BadRequestError", code=400)


SAMPLING = ("temperature", "top_p", "seed", "top_k", "min_p", "stop", "ignore_eos", "min_tokens",
            "user", "chat_template_kwargs", "cache_salt")
REFUSED = {"stream": "streaming Responses events", "tools": "tools", "previous_response_id":
           "stored responses (previous_response_id)", "background": "background responses"}


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}: content must be a string or a list of input_text parts", "input")
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") in ("input_text", "output_text") \
                and isinstance(part.get("text"), str):
            parts.append(part["text"])
        else:
            raise bad(f"{where}: only input_text / output_text parts are supported", "input")
    return "\n".join(parts)


def chat_body(body: dict) -> dict:
    """The chat completions request a Responses request stands for (400 for what is refused)."""
    for name, what in REFUSED.items():
        if body.get(name) not in (None, False, [], ""):
            raise bad(f"'{name}': {what} are not supported by this server", name)
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad("'instructions' must be a string", "instructions")
        messages.append({"role": "system", "content": instructions})
    inp = body.get("input")
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
    elif isinstance(inp, list) and inp:
        for i, item in enumerate(inp):
            if not isinstance(item, dict) or item.get("type", "message") != "message" \
                    or not isinstance(item.get("role"), str):
                raise bad(f"input[{i}]: only messages ({{role, content}}) are supported", "input")
            messages.append({"role": item["role"], "content": _text(item.get("content"), f"input[{i}]")})
    else:
        raise bad("'input' must be a string or a non-empty list of messages", "input")
    chat = {k: body[k] for k in SAMPLING if k in body}
    chat["messages"] = messages
    # checked here: chat's check would name max_completion_tokens, a field the client never sent
    max_output = Fields(body).int("max_output_tokens", None, 1)
    if max_output is not None:
        chat["max_completion_tokens"] = max_output
    return chat


def text_format(body: dict):
    """The request's text.format (its structured output: structured.text_format), None if absent."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad("'text' must be an object", "text")
    return text.get("format")


def response(body: dict, chat: dict) -> dict:
    """vLLM's Response object for a request `body` from the chat completion `chat` it ran as."""
    choice = chat["choices"][0]
    usage = chat["usage"]
    length = choice["finish_reason"] == "length"
    return {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
        "model": chat["model"], "status": "incomplete" if length else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if length else None,
        "instructions": body.get("instructions"), "metadata": body.get("metadata"),
        "output": [{"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                    "status": "incomplete" if length else "completed",
                    "content": [{"type": "output_text", "text": choice["message"]["content"],
                                 "annotations": [], "logprobs": None}]}],
        "parallel_tool_calls": body.get("parallel_tool_calls", True), "tool_choice": "auto", "tools": [],
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"), "previous_response_id": None,
        "reasoning": None, "text": {"format": text_format(body) or {"type": "text"}}, "truncation": "disabled",
        "background": False, "service_tier": "auto", "user": body.get("user"),
        "usage": {"input_tokens": usage["prompt_tokens"],
                  "input_tokens_details": {"cached_tokens": (usage.get("prompt_tokens_details") or {})
                                           .get("cached_tokens", 0)},
                  "output_tokens": usage["completion_tokens"],
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage["total_tokens"]},
    }
