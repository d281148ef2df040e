"""Chat templates rendered as HF transformers renders them (apply_chat_template).

The same jinja2 environment: ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and
loopcontrols, `raise_exception` and `strftime_now` as globals, HF's `tojson` filter (unicode
kept, indent/separators/sort_keys), and the {% generation %} block HF's assistant tracker
understands (rendered as its body). The context is HF's: messages, tools, documents,
add_generation_prompt, the tokenizer's special tokens, and the request's chat_template_kwargs
(Qwen3's enable_thinking). Any error while compiling or rendering is a TemplateError, which the
server answers with a 400.
"""
import functools
import json
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    pass


class _Generation(Extension):
    """{% generation %}...{% endgeneration %}: HF marks assistant tokens with it; render the body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise(message):
    raise TemplateError(str(message))


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=1)
def _env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    try:
        return _env().from_string(source)
    except jinja2.TemplateError as e:
        raise TemplateError(f"the chat template does not compile: {e}") from None


def special_tokens(tokenizer_config: dict) -> dict:
    """bos_token, eos_token, ... as strings (tokenizer_config.json may hold AddedToken dicts)."""
    out = {}
    for k in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        v = tokenizer_config.get(k)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[k] = v
    return out


def find_template(tokenizer_config: dict, model_dir=None) -> str | None:
    """The model's default chat template: tokenizer_config.json's chat_template (a string, or a
    list of named templates whose "default" wins), else chat_template.jinja in the directory."""
    t = tokenizer_config.get("chat_template")
    if isinstance(t, list):
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default") or next(iter(named.values()), None)
    if isinstance(t, str):
        return t
    if model_dir is not None:
        from pathlib import Path
        p = Path(model_dir) / "chat_template.jinja"
        if p.exists():
            return p.read_text()
    return None


def render(source: str, messages: list, *, add_generation_prompt: bool = True,
           continue_final_message: bool = False, tools=None, documents=None,
           special: dict | None = None, kwargs: dict | None = None) -> str:
    context = dict(kwargs or {})
    context.update(special or {})
    context.update(messages=messages, tools=tools, documents=documents,
                   add_generation_prompt=add_generation_prompt)
    template = compile_template(source)
    try:
        text = template.render(**context)
    except TemplateError:
        raise
    except Exception as e:     # noqa: BLE001 - anything a template does wrong is the request's 400
        raise TemplateError(f"the chat template failed to render: {type(e).__name__}: {e}") from None
    if continue_final_message:
        # Leave the last message open (no end-of-turn after it), as HF does: cut after its content.
        last = messages[-1].get("content") if messages else None
        if not isinstance(last, str) or not last.strip():
            raise TemplateError("continue_final_message needs a final message with text content")
        at = text.rfind(last.strip())
        if at < 0:
            raise TemplateError("continue_final_message: the final message's text is not in the "
                                "rendered template")
        text = text[:at + len(last.strip())]
    return text
