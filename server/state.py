"""The server's state: the limits it enforces, and the backend it serves once attached (until then
/health answers 503), with the chat template and token strings it renders. Its configuration,
ServerConfig, lives in args.py."""
import threading
import time

from . import chat, protocol, reasoning, tool_parsers
from .args import ServerConfig


class ServerState:
    def __init__(self, config: ServerConfig, backend=None):
        self.config = config
        self.backend = None
        self.error: BaseException | None = None     # the startup failure, if any
        self.inflight_seqs = 0                        # sequences of requests being served
        self.admission_lock = threading.Lock()        # admission runs on the worker pool too
        self.created = int(time.time())
        self.template, self.special, self.limits = None, {}, None
        self.tool_parser, self.reasoning_parser = None, None
        self._token_str: dict[int, str] = {}
        if backend is not None:
            self.attach(backend)

    def attach(self, backend):
        c = self.config
        self.template = c.chat_template or chat.find_template(backend.tokenizer_config, backend.model_dir)
        self.special = chat.special_tokens(backend.tokenizer_config)
        self.tool_parser = tool_parser(c, self.template)
        self.reasoning_parser = reasoning.get(c.reasoning_parser) if c.reasoning_parser else None
        self.limits = protocol.Limits(backend.max_model_len, backend.vocab_size, c.max_logprobs, c.max_n,
                                      protocol.prompt_char_bound(backend.tokenizer, backend.max_model_len))
        self.backend = backend                        # last: from here on the server is ready

    @property
    def ready(self) -> bool:
        return self.backend is not None and self.backend.engine.healthy

    def token_str(self, t: int) -> str:
        s = self._token_str.get(t)
        if s is None:
            tok = self.backend.tokenizer
            s = tok.decode([t], skip_special_tokens=False) if tok is not None else f"token_id:{t}"
            if len(self._token_str) < 1 << 18:
                self._token_str[t] = s
        return s


def tool_parser(c: ServerConfig, template: str | None):
    """The parser --tool-call-parser names, else the one the chat template implies (None: tools
    with tool_choice "auto" get vLLM's 400)."""
    name = c.tool_call_parser or tool_parsers.from_template(template)
    if name is None and c.enable_auto_tool_choice:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser: the chat template implies "
                         f"no single format (one of {', '.join(tool_parsers.PARSERS)})")
    return tool_parsers.get(name) if name else None
