"""GPT-OSS's harmony format through the server on the CPU (`--tool-call-parser openai
--reasoning-parser openai_gptoss`, vLLM's names): a scripted runner answers with harmony text
(tests/test_server.py's ScriptedRunner) in a byte-level tokenizer whose harmony markers are special
tokens, behind a small harmony chat template (tests/data/harmony_chat_template.jinja). Whole and
streamed (the openai SDK's own accumulator), the analysis channel is reasoning_content, a
commentary message to functions.NAME a tool call, the final channel the content; a malformed
answer is content, never a 5xx. The parsers' cut-anywhere checks are tests/test_tool_parsers.py's."""
import json
from pathlib import Path

import pytest

from infc.backend import Backend
from infc.runtime.engine.async_engine import AsyncEngine
from infc.runtime.engine.engine import Engine
from infc.server.app import ServerConfig, ServerState, make_app
from infc.server.serve import ServerThread
from test_server import ScriptedRunner
from tool_stream_support import sdk_stream, shape

MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
           "<|call|>", "<|endoftext|>"]
TEMPLATE = (Path(__file__).parent / "data" / "harmony_chat_template.jinja").read_text()
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
THINK = "<|channel|>analysis<|message|>The user wants the weather. Call get_weather.<|end|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
        '<|message|>{"city": "Paris"}<|call|>')
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.<|return|>"


def _tokenizer_dir(d: Path) -> Path:
    """A byte-level tokenizer (one token a byte, no merges) whose harmony markers are special
    tokens, as GPT-OSS's are: decoding with skip_special_tokens drops them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tk = Tokenizer(models.BPE({ch: i for i, ch in enumerate(sorted(alphabet))}, []))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(MARKERS)
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|return|>"}))
    return d


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    """(server, runner, tokenizer, state) of a server with both harmony parsers."""
    from infc.runtime.tokenization.tokenizer import Tokenizer
    d = _tokenizer_dir(tmp_path_factory.mktemp("harmony-tok"))
    tok = Tokenizer(d)
    eos = {tok.tk.token_to_id(t) for t in ("<|return|>", "<|call|>")}
    runner = ScriptedRunner([0], tok.vocab_size)
    engine = AsyncEngine(Engine(runner, tok, eos, 1024, max_num_seqs=8))
    b = Backend(engine, tok, d, "scripted", "cpu", 1024, tok.vocab_size, 4096, 16, eos, tok.config)
    cfg = ServerConfig(served_model_names=["gpt-oss"], tool_call_parser="openai", enable_auto_tool_choice=True,
                       reasoning_parser="openai_gptoss")
    state = ServerState(cfg, b)
    server = ServerThread(make_app(state)).start()
    yield server, runner, tok, state
    server.stop()
    engine.shutdown()


def _client(server):
    from openai import OpenAI
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _answer(harmony, text: str, **kw):
    """(whole message, finish reason), (streamed message, finish reason) of this scripted answer."""
    server, runner, tok, _ = harmony
    ids = tok.encode(text)
    assert sum(i >= 256 for i in ids) == sum(text.count(m) for m in MARKERS)   # each marker one token
    runner.script = ids
    kw = dict(model="gpt-oss", messages=MSG, max_tokens=len(ids), temperature=0, **kw)
    c = _client(server)
    whole = c.chat.completions.create(**kw).choices[0]
    streamed = sdk_stream(c, **kw)[0]
    return (shape(whole.message), whole.finish_reason), (shape(streamed.message), streamed.finish_reason)


def test_reasoning_then_a_tool_call(harmony):
    whole, streamed = _answer(harmony, THINK + CALL, tools=[WEATHER])
    want = ("", "The user wants the weather. Call get_weather.", [("get_weather", '{"city": "Paris"}')])
    assert whole == streamed == (want, "tool_calls")


def test_reasoning_then_the_final_answer(harmony):
    whole, streamed = _answer(harmony, THINK + FINAL, tools=[WEATHER])
    assert whole == streamed == (("It is sunny in Paris.", "The user wants the weather. Call get_weather.", []), "stop")
    # no tools asked: the same reading (the markers are special tokens, kept for the parsers)
    whole, streamed = _answer(harmony, THINK + FINAL)
    assert whole == streamed == (("It is sunny in Paris.", "The user wants the weather. Call get_weather.", []), "stop")


@pytest.mark.parametrize("text", [
    "Just plain text, no harmony at all.",
    THINK + '<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>{"city": <|call|>',
    "<|message|><|message|><|end|><|start|><|start|>final",
    THINK + "<|start|>assistant garbage without a header end " * 10,
], ids=["not-harmony", "arguments-not-json", "markers-out-of-order", "header-never-ends"])
def test_malformed_answers_are_content(harmony, text):
    """Never a 5xx (the SDK raises on one): what is not a well-formed call is content as written,
    streamed alike, except a call whose header was read: a stream has sent its name and the
    arguments it read (as every parser's stream does, tests/test_tool_parsers.py)."""
    whole, streamed = _answer(harmony, text, tools=[WEATHER])
    (content, reasoning, calls), finish = whole
    assert not calls and finish in ("stop", "length") and content and content in text
    if "to=functions.get_weather<|message|>" in text:
        assert streamed == (("", reasoning, [("get_weather", '{"city": ')]), "tool_calls")
    else:
        assert streamed == whole


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}], ids=["thinking", "no-reasoning-split"])
def test_a_structured_answer_starts_after_the_final_header(harmony, kwargs):
    """The grammar holds from the final channel's text on (its header's ids), reasoning split or
    not, and the markers are kept in the decoded text."""
    from infc.server import outputs, protocol
    _, _, tok, st = harmony
    body = dict(messages=MSG, response_format={"type": "json_object"}, chat_template_kwargs=kwargs)
    req = outputs.chat(body, st, tok, lambda: protocol.parse_chat(body, st.limits, tok, st.template, st.special))
    ids = tuple(tok.encode_text("<|channel|>final<|message|>"))
    assert (ids[0], ids[-1]) == (tok.tk.token_to_id("<|channel|>"), tok.tk.token_to_id("<|message|>"))
    assert req.params.structured_outputs.start_after == ids
    assert req.params.skip_special_tokens is False and req.answer.harmony
    assert (req.answer.reasoning is None) == bool(kwargs)
