"""Issue 41 on the wire, against the real SmolLM2 (one server per configuration, shared by the
module): malformed structured-output and tool requests each get a 400 naming the field, tools
with tool_choice "auto" on a server without a tool parser get vLLM's 400, a tool round trip
(an assistant turn with tool_calls and null content, then the tool's result) reaches the
template, and the reasoning parser splits the answer the same way whole and streamed. None of
these needs the grammar engine: every request here is refused before it is queued, or carries
no constraint."""
import json

import pytest

from infc.server import outputs, protocol
from infc.server.tools import NO_PARSER
from test_server_support import NAMES, live, one_blas_thread, request, use_model  # noqa: F401
from tool_stream_support import sdk_stream, shape

MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
JSON_OBJECT = {"type": "json_object"}


@pytest.fixture(scope="module")
def hermes():
    use_model(None)
    return live(tool_call_parser="hermes")


# (endpoint, fields, the param the 400 names, words its message holds)
MALFORMED = [
    ("chat", {"response_format": "json"}, "response_format", "must be an object"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format", "json_schema' must be an object"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "json_schema.schema' is required"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": "{nope"}}}, "response_format",
     "not valid JSON"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
     "response_format", "strict"),
    ("chat", {"structured_outputs": "x"}, "structured_outputs", "must be an object"),
    ("chat", {"structured_outputs": {"regex": "a+", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ("chat", {"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list of strings"),
    ("chat", {"structured_outputs": {"grammar": ""}}, "structured_outputs", "non-empty string"),
    ("chat", {"structured_outputs": {"xml": "<a/>"}}, "structured_outputs", "structured_outputs.xml"),
    ("chat", {"structured_outputs": {"disable_fallback": True}}, "structured_outputs", "not supported"),
    ("chat", {"guided_json": 5}, "guided_json", "JSON schema"),
    ("chat", {"guided_regex": ["a"]}, "guided_regex", "non-empty string"),
    ("chat", {"guided_choice": "a"}, "guided_choice", "non-empty list of strings"),
    ("chat", {"guided_grammar": 1}, "guided_grammar", "non-empty string"),
    ("chat", {"response_format": JSON_OBJECT, "guided_json": {"type": "object"}}, "guided_json",
     "response_format, guided_json"),
    ("chat", {"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools",
     "tools[0].function.name"),
    ("chat", {"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools",
     "tools[1].function.parameters"),
    ("chat", {"tools": ["get_weather"]}, "tools", "tools[0]' must be an object"),
    ("chat", {"tools": [WEATHER, WEATHER]}, "tools", "two tools are named 'get_weather'"),
    ("chat", {"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ("chat", {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice", "'get_time', which is not in 'tools'"),
    ("chat", {"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ("chat", {"tools": [WEATHER], "tool_choice": "required", "response_format": JSON_OBJECT}, "tool_choice",
     "response_format, tool_choice"),
    ("chat", {"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean"),
    ("completions", {"guided_choice": [1, 2]}, "guided_choice", "non-empty list of strings"),
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format", "JSON schema (an object)"),
]


def post(port, endpoint: str, fields: dict, **extra):
    body = dict(fields, model=NAMES[0], max_tokens=4, **extra)
    if endpoint == "chat":
        return request(port, "POST", "/v1/chat/completions", dict(body, messages=MSG))
    return request(port, "POST", "/v1/completions", dict(body, prompt="Hi"))


@pytest.mark.parametrize("endpoint,fields,param,words", MALFORMED,
                         ids=[f"{e}-{i}-{p}" for i, (e, _, p, _) in enumerate(MALFORMED)])
@pytest.mark.parametrize("stream", [False, True])
def test_malformed_is_400_naming_the_field(hermes, endpoint, fields, param, words, stream):
    status, _, body = post(hermes.port, endpoint, fields, stream=stream)
    err = json.loads(body)["error"]
    assert status == 400, body
    assert err["param"] == param and words in err["message"], err


def test_tools_auto_without_a_parser_is_vllms_400():
    use_model(None)
    plain = live()                          # SmolLM2's template writes no tool-call format
    assert plain.state.tool_parser is None
    for fields in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "auto"}):
        status, _, body = post(plain.port, "chat", fields)
        assert status == 400 and json.loads(body)["error"]["message"] == NO_PARSER, body


ROUND_TRIP_TEMPLATE = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }}({{ c.function.arguments.city }})]"
    "{% endfor %}{% if m.tool_call_id %}[result of {{ m.tool_call_id }}]{% endif %}\n{% endfor %}<assistant>")


def test_a_tool_round_trip_reaches_the_template(hermes):
    """The assistant turn's tool_calls (arguments as OpenAI's JSON text) reach the template as an
    object, its null content as empty text; the tool's answer as its own turn."""
    messages = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    status, _, body = request(hermes.port, "POST", "/tokenize", {
        "model": NAMES[0], "messages": messages, "tools": [WEATHER], "chat_template": ROUND_TRIP_TEMPLATE})
    assert status == 200, body
    text = hermes.backend.tokenizer.decode(json.loads(body)["tokens"], skip_special_tokens=False)
    assert "<assistant>[call call_1 get_weather(Paris)]<tool>sunny, 21 C[result of call_1]" in text, text
    # and with the model's own template (which reads content as text), through generation
    out = hermes.client().chat.completions.create(model=NAMES[0], messages=messages, tools=[WEATHER],
                                                  max_tokens=2, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")


def test_reasoning_split_whole_and_streamed():
    """--reasoning-parser qwen3 on SmolLM2 behind a template that opens the section in the prompt
    (as newer Qwen3 templates do): the answer never closes it, so all of it is reasoning, the
    same text a server without the parser calls content; enable_thinking false: content again."""
    use_model(None)
    plain, thinking = live(), live(reasoning_parser="qwen3")
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "<|im_start|>assistant\n<think>\n")
    kw = dict(model=NAMES[0], messages=MSG, max_tokens=6, temperature=0,
              extra_body={"chat_template": template})
    text = plain.client().chat.completions.create(**kw).choices[0].message.content
    assert text and "</think>" not in text
    c = thinking.client()
    whole = c.chat.completions.create(n=2, **kw)
    assert [shape(ch.message) for ch in whole.choices] == [("", text, [])] * 2
    streamed = sdk_stream(c, n=2, **kw)
    assert [shape(ch.message) for ch in streamed] == [("", text, [])] * 2
    off = dict(kw, extra_body=dict(kw["extra_body"], chat_template_kwargs={"enable_thinking": False}))
    assert shape(c.chat.completions.create(**off).choices[0].message) == (text, "", [])


def test_tools_auto_with_a_parser_answers_text_streamed_as_whole(hermes):
    """SmolLM2 writes no <tool_call>: the parser passes its text through, streamed or not."""
    kw = dict(model=NAMES[0], messages=MSG, tools=[WEATHER], max_tokens=8, temperature=0)
    c = hermes.client()
    whole = c.chat.completions.create(**kw).choices[0]
    streamed = sdk_stream(c, **kw)[0]
    assert whole.message.content and not whole.message.tool_calls
    assert shape(streamed.message) == shape(whole.message)
    assert whole.finish_reason == streamed.finish_reason == "length"


def test_the_constraint_starts_after_the_reasoning_section():
    """With a reasoning parser and thinking on, the grammar applies from the token after
    </think> (its ids in the StructuredOutputs); enable_thinking false: from the first token."""
    use_model(None)
    thinking = live(reasoning_parser="qwen3")
    st, tok = thinking.state, thinking.backend.tokenizer
    end = tuple(tok.encode_text("</think>"))

    def parsed(**fields):
        body = dict(fields, messages=MSG, response_format={"type": "json_object"})
        return outputs.chat(body, st, tok, lambda: protocol.parse_chat(body, st.limits, tok, st.template, st.special))
    assert end and parsed().params.structured_outputs.start_after == end
    off = parsed(chat_template_kwargs={"enable_thinking": False})
    assert off.params.structured_outputs.start_after == () and off.answer.reasoning is None
