"""Tokenizer from an HF directory's tokenizer.json, with incremental detokenization that never
emits half a UTF-8 character (a token that ends mid-character waits for the next one). Long texts
are encoded by fast_tokenize.FastEncoder: the same ids as the library's own `encode`, split at
proven boundaries across threads, with the ids of recently seen text reused."""
import functools
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from infc.compiler.contract import json_file
from infc.compiler.contract.errors import ModelDirError

from . import facts
from .fast_tokenize import FastEncoder


class Tokenizer:
    def __init__(self, model_dir: Path):
        path = Path(model_dir) / "tokenizer.json"
        if not path.exists():
            raise ModelDirError(f"{model_dir}: no tokenizer.json")
        json_file.check_regular(path)
        try:
            self.tk = HFTokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises its own exception types
            raise ModelDirError(f"{path}: cannot load tokenizer ({e})") from None
        cfg_path = Path(model_dir) / "tokenizer_config.json"
        self.config = json_file.read_object(cfg_path) if cfg_path.exists() else {}
        self.add_bos = bool(self.config.get("add_bos_token", False))
        self.bos_id = self._bos_id(cfg_path)
        # the facts an earlier load derived from these files (facts.py): its probe's outcome here,
        # the longest token in max_token_chars; what this load derives is kept for the next
        self._facts_key = facts.key(model_dir)
        self._facts = facts.read(self._facts_key)
        probed = self._facts.get("probe")
        self.fast = FastEncoder(self.tk, probe=probed if isinstance(probed, str) and probed else True)
        if self.fast.probed is not None:
            self._keep(probe=self.fast.probed)

    def _bos_id(self, cfg_path) -> int | None:
        """bos_token's id: the token as a string or an AddedToken {"content": ...}; None when absent
        or not in the vocabulary (as before: no BOS is added then)."""
        bos = self.config.get("bos_token")
        if isinstance(bos, dict):
            bos = bos.get("content")
        if bos is None or bos == "":
            return None
        if not isinstance(bos, str):        # token_to_id would raise a TypeError deep in the library
            raise ModelDirError(f"{cfg_path}: 'bos_token' must be a token string or "
                                f"{{\"content\": token}}, got {self.config.get('bos_token')!r}")
        return self.tk.token_to_id(bos)

    def _keep(self, **new):
        self._facts = {**self._facts, **new}
        facts.write(self._facts_key, self._facts)

    def encode_text(self, text: str) -> list[int]:
        """Exactly self.tk.encode(text, add_special_tokens=False).ids (no BOS), fast on long texts."""
        return self.fast.encode(text)

    def encode(self, text: str) -> list[int]:
        ids = self.fast.encode(text)
        if self.add_bos and self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token stands for (vLLM's max_chars_per_token): its
        longest vocabulary entry. A byte-level token spells each of its bytes as one character and
        a text character is at least one byte; a SentencePiece token spells each character as
        itself (byte-fallback pieces, "<0xE4>", spell one byte with six). So a text of more than
        n x this many characters has more than n tokens. Holds the GIL ~0.1-0.2 s at 151k tokens:
        the backend reads it on the tokenizer's loading thread, and a restart reads it from the
        facts the first load kept."""
        n = self._facts.get("max_token_chars")
        if not isinstance(n, int) or n < 1:
            n = max(map(len, self.tk.get_vocab(with_added_tokens=True)), default=1)
            self._keep(max_token_chars=n)
        return n

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)


class IncrementalDecoder:
    """Feeds token ids, returns the new text each time (vLLM's prefix/read offset scheme)."""

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tok, skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        self.text = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tok.decode(self.ids[self.prefix:self.read], self.skip)
        full = self.tok.decode(self.ids[self.prefix:], self.skip)
        if full.endswith("\ufffd") or len(full) <= len(before):
            return ""                      # an incomplete character: wait for more bytes
        new = full[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += new
        return new


def eos_ids(model_dir: Path) -> set[int]:
    """generation_config.json's eos_token_id (else config.json's): one id or a list.

    A file that is there but broken (not JSON, not an object, an id that is a string or a list of
    lists) is an error naming it: skipping it would stop generation at the wrong tokens, or never
    (a "2" never equals the sampled 2)."""
    for name in ("generation_config.json", "config.json"):
        p = Path(model_dir) / name
        if p.exists():
            e = json_file.read_object(p).get("eos_token_id")
            if e is not None:
                return _token_ids(e, p)
    return set()


def _token_ids(e, path) -> set[int]:
    ids = e if isinstance(e, list) else [e]
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < 2**31]
    if bad:
        raise ModelDirError(f"{path}:{json_file.json_key_line(path, 'eos_token_id')}: 'eos_token_id' must be a "
                            f"token id or a list of them (integers >= 0), got {e!r}")
    return set(ids)
