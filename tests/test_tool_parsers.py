"""The tool-call parsers (server/tool_parsers) and the reasoning split (server/reasoning.py) on
recorded model answers (tests/data/tool_call_outputs.json): what the whole answer reads as, and
that its stream, cut at every point (and token by token), joined by the openai SDK's own
accumulator, is the same message."""
import json
from pathlib import Path

import pytest

from infc.server import args as server_args
from infc.server import tool_parsers
from infc.server.chat_output import AnswerPlan
from infc.server.reasoning import REASONING_PARSERS, get as reasoning_parser
from infc.server.tool_parsers.hermes import HermesParser
from infc.server.tools import ToolRequest
from tool_stream_support import sdk_join, shape

CASES = json.loads((Path(__file__).parent / "data" / "tool_call_outputs.json").read_text())["cases"]
AUTO = ToolRequest("auto")


def plan_for(case, **kw) -> AnswerPlan:
    return AnswerPlan(AUTO, tool_parsers.get(case["parser"]), **kw)


def streamed(plan: AnswerPlan, pieces: list[str]):
    s = plan.stream()
    deltas = []
    for k, p in enumerate(pieces):
        deltas += s.feed(p, final=k == len(pieces) - 1)
    return sdk_join(deltas, "tool_calls" if s.called else "stop")


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_whole_answer(case):
    msg, called = plan_for(case).message(case["text"])
    content, _, calls = shape(msg)
    assert (content, [list(c) for c in calls]) == (case["content"], case["calls"])
    assert called == bool(case["calls"])
    assert all(c["id"].startswith("chatcmpl-tool-") for c in msg.get("tool_calls", []))


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_stream_split_anywhere(case):
    """Every cut into two chunks, and one character a chunk: the SDK joins the same message."""
    plan, text = plan_for(case), case["text"]
    whole = shape(plan.message(text)[0])
    cuts = [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        got = shape(streamed(plan, pieces))
        if case.get("complete", True):
            assert got == whole, pieces
        else:   # a stream has sent what it read of the unfinished call; the finished ones agree
            assert got[2][:len(whole[2])] == whole[2], pieces


def test_parallel_tool_calls_false_keeps_the_first():
    case = next(c for c in CASES if c["id"] == "hermes-text-before-parallel")
    plan = AnswerPlan(ToolRequest("auto", parallel=False), HermesParser())
    assert shape(plan.message(case["text"])[0])[2] == [tuple(case["calls"][0])]
    assert shape(streamed(plan, list(case["text"])))[2] == [tuple(case["calls"][0])]


def test_named_and_required_answers():
    named = AnswerPlan(ToolRequest("named", name="get_weather", schema={}))
    text = '{"city": "Paris"}'
    assert shape(named.message(text)[0]) == ("", "", [("get_weather", text)])
    assert shape(streamed(named, list(text))) == ("", "", [("get_weather", text)])
    required = AnswerPlan(ToolRequest("required", schema={}))
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    want = ("", "", [("a", '{"x": 1}'), ("b", "{}")])
    assert shape(required.message(text)[0]) == want
    for k in range(len(text) + 1):
        assert shape(streamed(required, [text[:k], text[k:]])) == want


THINK = [  # (parser, prompt ends inside the section, answer, reasoning, content)
    ("qwen3", False, "<think>\nThe user wants X.\n</think>\n\nX is 4.", "\nThe user wants X.\n", "\n\nX is 4."),
    ("qwen3", False, "X is 4.", "", "X is 4."),
    ("qwen3", True, "Short thought.</think>The answer.", "Short thought.", "The answer."),
    ("qwen3", False, "<think>cut off mid tho", "cut off mid tho", ""),
    ("deepseek_r1", True, "Reason here.\n</think>\n\nAnswer.", "Reason here.\n", "\n\nAnswer."),
    ("deepseek_r1", True, "<think>R</think>A", "R", "A"),
]


@pytest.mark.parametrize("name,inside,text,reasoning,content", THINK)
def test_reasoning_split(name, inside, text, reasoning, content):
    plan = AnswerPlan(reasoning=reasoning_parser(name), inside=inside)
    want = (content, reasoning, [])
    assert shape(plan.message(text)[0]) == want
    for pieces in [[text[:k], text[k:]] for k in range(len(text) + 1)] + [list(text)]:
        assert shape(streamed(plan, pieces)) == want, pieces


def test_reasoning_then_tool_call():
    text = '<think>Need weather.</think>\n<tool_call>\n{"name": "w", "arguments": {"c": "P"}}\n</tool_call>'
    plan = AnswerPlan(AUTO, HermesParser(), reasoning_parser("qwen3"))
    want = ("\n", "Need weather.", [("w", '{"c": "P"}')])
    assert shape(plan.message(text)[0]) == want
    assert shape(streamed(plan, list(text))) == want


HARMONY = [  # (answer, reasoning, content, calls) through both GPT-OSS parsers (--tool-call-parser
    # openai --reasoning-parser openai_gptoss) with tool_choice "auto"
    ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>4.<|return|>",
     "Think.", "4.", []),
    ("<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>commentary<|message|>Hm.<|end|>"
     "<|start|>assistant<|channel|>analysis<|message|>B.<|end|>"
     '<|start|>assistant to=functions.w<|channel|>commentary<|message|>{"c": 1}<|call|>',
     "A.\nB.", "Hm.", [("w", '{"c": 1}')]),
    ("<|channel|>analysis<|message|>cut off mid tho", "cut off mid tho", "", []),
    ("No harmony here.", "", "No harmony here.", []),
    ("<|channel|>final<|message|>Direct.", "", "Direct.", []),       # the stop token not in the text
]


@pytest.mark.parametrize("text,reasoning,content,calls", HARMONY)
def test_harmony_reasoning_and_calls(text, reasoning, content, calls):
    """The analysis channel is reasoning, the final channel and preambles content, calls calls:
    whole, and streamed cut anywhere; without tools asked a call's text is content; with only the
    reasoning parser (thinking off: none) the final text is still the content."""
    for tool, rp in [(AUTO, "openai_gptoss"), (None, "openai_gptoss"), (AUTO, None)]:
        plan = AnswerPlan(tool, tool_parsers.get("openai"), rp and reasoning_parser(rp), False, True)
        msg = plan.message(text)[0]
        got = shape(msg)
        assert got[1] == (reasoning if rp else "")
        if tool is AUTO:
            assert (got[0], got[2]) == (content, calls)
        else:
            assert not got[2] and got[0].startswith(content)
        cuts = [list(text)] + ([[text[:k], text[k:]] for k in range(len(text) + 1)] if rp and tool else [])
        for pieces in cuts:          # every cut through both parsers, one character a chunk for all
            assert shape(streamed(plan, pieces)) == got, pieces


def test_parser_registry_and_template_detection():
    assert set(server_args.TOOL_CALL_PARSERS) == {"hermes", "llama3_json", "mistral", "deepseek_v3", "openai"}
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1", "openai_gptoss"}
    harmony = (Path(__file__).parent / "data" / "harmony_chat_template.jinja").read_text()
    assert tool_parsers.from_template(harmony) == "openai"
    assert tool_parsers.from_template('{{ "<|start|>assistant to=" + "functions." + name }}<|channel|>') == "openai"
    assert tool_parsers.from_template("{{ '<tool_call>' }}{{ tool | tojson }}{{ '</tool_call>' }}") == "hermes"
    assert tool_parsers.from_template("[TOOL_CALLS]{{ x }}") == "mistral"
    assert tool_parsers.from_template("{{ '<｜tool▁calls▁begin｜>' }}") == "deepseek_v3"
    assert tool_parsers.from_template("<|python_tag|>") == "llama3_json"
    assert tool_parsers.from_template("<tool_call> [TOOL_CALLS]") is None     # ambiguous: no default
    assert tool_parsers.from_template("{{ messages }}") is None
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'"):
        tool_parsers.get("nope")


def test_tool_schemas_are_closed_where_they_do_not_say():
    from infc.server.tools import closed
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "string"}}},
        "c": {"type": "array", "items": {"type": "object", "properties": {}}},
        "d": {"type": "object", "additionalProperties": True}},
        "$defs": {"E": {"anyOf": [{"type": "object", "properties": {"x": {}}}, {"type": "null"}]}}}
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["c"]["items"]["additionalProperties"] is False
    assert out["properties"]["d"]["additionalProperties"] is True          # said otherwise: kept
    assert out["$defs"]["E"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema                            # the request's own untouched


def test_flags_choose_the_parsers():
    import argparse
    from infc.server.state import ServerConfig, tool_parser
    p = argparse.ArgumentParser()
    server_args.add_serve_args(p)
    a = p.parse_args(["--model-path", "m", "--enable-auto-tool-choice", "--tool-call-parser", "mistral",
                      "--reasoning-parser", "deepseek_r1"])
    cfg = server_args.config_from_args(a)
    assert (cfg.tool_call_parser, cfg.enable_auto_tool_choice, cfg.reasoning_parser) == ("mistral", True, "deepseek_r1")
    with pytest.raises(SystemExit):                          # argparse's usage error for a name it lacks
        p.parse_args(["--model-path", "m", "--tool-call-parser", "nope"])
    assert tool_parser(cfg, "{{ '<tool_call>' }}").name == "mistral"             # the flag wins
    assert tool_parser(ServerConfig(), "{{ '<tool_call>' }}").name == "hermes"    # else the template's
    assert tool_parser(ServerConfig(), "{{ messages }}") is None
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        tool_parser(ServerConfig(enable_auto_tool_choice=True), "{{ messages }}")
