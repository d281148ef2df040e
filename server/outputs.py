"""A request's output features, applied to its checked GenRequest: the structured constraint
(structured.py) into its SamplingParams, and for chat the AnswerPlan (chat_output.py) of its tool
calling (tools.py) and reasoning (reasoning.py). The tool fields are checked before the template
renders them; the engine compiles the constraint before anything is queued (app.checked)."""
import dataclasses

from . import protocol, reasoning, responses, structured, tools
from .chat_output import AnswerPlan


def _with_constraint(req: protocol.GenRequest, so) -> protocol.GenRequest:
    if so is not None and req.params is not None:
        req.params = dataclasses.replace(req.params, structured_outputs=so)
    return req


def completion(body: dict, parse) -> protocol.GenRequest:
    """parse(): protocol.parse_completion of this body."""
    so = structured.constraint(body)
    return _with_constraint(parse(), so)


def response(body: dict, parse) -> protocol.GenRequest:
    """A /v1/responses request; parse(): protocol.parse_chat of the chat body it runs as. Its
    text.format is its structured output, as response_format is chat's."""
    so = structured.text_format(responses.text_format(body))
    return _with_constraint(parse(), so)


def chat(body: dict, state, tokenizer, parse) -> protocol.GenRequest:
    """parse(): protocol.parse_chat of this body; state: the server's parsers."""
    tool = tools.tool_request(body, state.tool_parser is not None)
    so = structured.constraint(body, tool.schema if tool is not None else None)
    req = parse()
    kwargs = body.get("chat_template_kwargs") or {}
    thinking = state.reasoning_parser is not None and reasoning.thinking_enabled(kwargs)
    rp = state.reasoning_parser if thinking else None
    harmony = any(getattr(p, "harmony", False) for p in (state.tool_parser, state.reasoning_parser))
    if so is not None and (rp is not None or harmony):
        # the grammar holds from the answer's text on: after </think>, or harmony's final header
        end = rp.end if rp is not None else reasoning.GptOssReasoningParser.end
        so = structured.starting_after(so, tokenizer.encode_text(end))
    if (harmony or (tool is not None and tool.mode == "auto")) and req.params is not None:
        # the parsers read the format's markers, some of them special tokens (Mistral's; every
        # harmony marker)
        req.params = dataclasses.replace(req.params, skip_special_tokens=False)
    req.answer = AnswerPlan(tool, state.tool_parser, rp, rp is not None and rp.inside_from(req.texts[0]),
                            harmony)
    return _with_constraint(req, so)
