"""Issue 41 end to end against the real SmolLM2 with the grammar engine (one server, hermes tool
parser, shared by the module): response_format, vLLM's structured_outputs and guided_* on chat and
completions, streamed and not, n > 1; tool_choice "required" and a named function answered as
tool calls whose arguments match the tool's schema; a constraint the engine cannot compile is a
400 naming its field. The fast cases go as one batch of concurrent requests (they share engine
steps); then the client libraries, unchanged: openai's parse with a pydantic model, LangChain's
with_structured_output (json_schema and function_calling) and bind_tools with a tool round trip."""
import json
import re

import pytest
from pydantic import BaseModel

from test_server_support import NAMES, live, one_blas_thread, request, run_together, use_model  # noqa: F401
from tool_stream_support import sdk_stream, shape

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": CITY}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["CET", "UTC"]}}, "required": ["tz"],
    "additionalProperties": False}}}
HERMES_ANSWER = 'Ok<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
OK = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def srv():
    use_model(None)
    return live(tool_call_parser="hermes")


def together(*fns):
    """Run the calls at once (they share the engine's steps); their results in order."""
    return run_together(fns)


def valid_city(args: str):
    assert json.loads(args)["city"] in ("Paris", "Rome"), args


def test_constrained_answers_in_one_batch(srv):
    c = srv.client()
    chat = dict(model=NAMES[0], messages=ASK, temperature=0, max_tokens=12)
    schema_rf = {"type": "json_schema", "json_schema": {"name": "ok", "schema": OK, "strict": True}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    # tool_choice "auto": a choice makes SmolLM2 write a Hermes call, which the server's parser reads
    forced = dict(chat, tools=[WEATHER], max_tokens=40, extra_body={"guided_choice": [HERMES_ANSWER]})
    (rf, choice, regex, streamed_named, required, one_call, obj, auto, auto_streamed) = together(
        lambda: c.chat.completions.create(response_format=schema_rf, n=2, **chat),
        lambda: sdk_stream(c, n=2, extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}}, **chat),
        lambda: c.completions.create(model=NAMES[0], prompt="The year was", max_tokens=6, temperature=0,
                                     extra_body={"guided_regex": "1[0-9]{3}"}),
        lambda: sdk_stream(c, tools=[WEATHER, TIME], tool_choice=named, **chat),
        lambda: c.chat.completions.create(tools=[WEATHER, TIME], tool_choice="required",
                                          **dict(chat, max_tokens=40)),
        lambda: sdk_stream(c, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False,
                           **dict(chat, max_tokens=40)),
        lambda: c.completions.create(model=NAMES[0], prompt='{"ok": true} is JSON. Another:', max_tokens=12,
                                     temperature=0, extra_body={"response_format": {"type": "json_object"}}),
        lambda: c.chat.completions.create(**forced),
        lambda: sdk_stream(c, **forced))
    for ch in rf.choices:                                           # response_format json_schema
        assert set(json.loads(ch.message.content)) == {"ok"} and ch.finish_reason == "stop"
    assert [shape(ch.message)[0] for ch in choice] and \
        all(shape(ch.message)[0] in ("sunny", "rainy") for ch in choice)  # structured_outputs choice, streamed
    assert re.fullmatch("1[0-9]{3}", regex.choices[0].text)           # guided_regex, completions
    (ch,) = streamed_named                                            # a named function, streamed
    assert ch.finish_reason == "tool_calls" and not ch.message.content
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    valid_city(call.function.arguments)
    msg = required.choices[0]                                          # "required": calls, each valid
    assert msg.finish_reason == "tool_calls" and msg.message.tool_calls and msg.message.content is None
    for call in msg.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time")
        args = json.loads(call.function.arguments)
        assert args.get("city", args.get("tz")) in ("Paris", "Rome", "CET", "UTC"), args
    assert len(one_call[0].message.tool_calls) == 1                    # parallel_tool_calls false
    want = ("Ok", "", [("get_weather", '{"city": "Rome"}')])             # "auto", whole and streamed
    assert shape(auto.choices[0].message) == shape(auto_streamed[0].message) == want
    assert auto.choices[0].finish_reason == auto_streamed[0].finish_reason == "tool_calls"
    text = obj.choices[0].text                                         # json_object, completions
    assert text.startswith("{") and (obj.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict)), text


@pytest.mark.parametrize("fields,param", [
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}}, "response_format"),
])
def test_what_the_engine_cannot_compile_is_400_naming_the_field(srv, fields, param):
    status, _, body = request(srv.port, "POST", "/v1/chat/completions",
                              dict(fields, model=NAMES[0], messages=ASK, max_tokens=2))
    assert status == 400 and json.loads(body)["error"]["param"] == param, body
    assert srv.state.ready                      # the engine lives on


# -- the client libraries, unchanged ----------------------------------------------------------------
class Weather(BaseModel):
    city: str
    sunny: bool


def test_openai_parse_with_a_pydantic_model(srv):
    out = srv.client().chat.completions.parse(model=NAMES[0], messages=ASK, response_format=Weather,
                                              temperature=0, max_tokens=30)
    assert isinstance(out.choices[0].message.parsed, Weather)


def lc_model(srv, **kw):
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(base_url=srv.url + "/v1", api_key="none", model=NAMES[0], temperature=0,
                      max_tokens=30, max_retries=0, **kw)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(srv, method):
    out = lc_model(srv).with_structured_output(Weather, method=method).invoke("Weather in Paris?")
    assert isinstance(out, Weather)


def test_langchain_bind_tools_round_trip(srv):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    model = lc_model(srv)
    ask = [HumanMessage("What is the weather in Paris?")]
    ai = model.bind_tools([get_weather], tool_choice="get_weather").invoke(ask)
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    answer = model.bind_tools([get_weather]).invoke(ask + [ai, result])   # "auto": the hermes parser
    assert isinstance(answer.content, str) and answer.response_metadata["finish_reason"] in ("stop", "length")
