"""What a tokenizer's load derives from its vocabulary, kept across starts.

A server's start reads two facts off the tokenizer after the library loads it: the longest token's
characters (the prompt bound, Tokenizer.max_token_chars: `get_vocab` of every entry) and whether
the fast encoder's probe texts encode the same split as whole (FastEncoder's probe). Both hold the
GIL while they run (~0.1-0.3 s at Qwen's 151k tokens), beside the weights' load, and both depend
only on the tokenizer's files, the `tokenizers` library and this package's encoder. So the first
load writes them to a small JSON file, keyed by those, and a restart reads them back.

The key is the tokenizer files' paths, sizes and modification times (as the artifact key takes a
checkpoint's), the library's version and the source of the modules that decide the facts: a changed
file or upgraded library derives them again. A cache that cannot be read or written is the same as
none (the facts are derived, nothing fails); INFC_TOKENIZER_CACHE is its folder.
"""
import hashlib
import json
import os
import tempfile
from pathlib import Path

import tokenizers

from infc import envs

_DECIDERS = ("fast_tokenize.py", "tokenizer.py", "facts.py")   # the code the facts come from
_code_hash = None


def _code() -> str:
    global _code_hash
    if _code_hash is None:
        here = Path(__file__).resolve().parent
        h = hashlib.sha256()
        for name in _DECIDERS:
            h.update((here / name).read_bytes())
        _code_hash = h.hexdigest()
    return _code_hash


def key(model_dir: Path) -> str | None:
    """The facts' key for model_dir's tokenizer files (None when tokenizer.json cannot be read)."""
    parts = [tokenizers.__version__, _code()]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        p = Path(model_dir) / name
        try:
            st = p.stat()
        except OSError:
            if name == "tokenizer.json":
                return None
            parts.append(f"{name}: none")
            continue
        parts.append(f"{p.resolve()} {st.st_size} {st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _file(k: str) -> Path:
    return Path(envs.value("INFC_TOKENIZER_CACHE")) / f"{k}.json"


def read(k: str | None) -> dict:
    """The facts kept under key k ({} when none are, or the file is unreadable)."""
    if k is None:
        return {}
    try:
        facts = json.loads(_file(k).read_text())
    except (OSError, ValueError):
        return {}
    return facts if isinstance(facts, dict) else {}


def write(k: str | None, facts: dict) -> None:
    """Keep facts under key k, whole or not at all (a concurrent reader never sees half a file);
    a folder that cannot be written keeps nothing."""
    if k is None:
        return
    path, tmp = _file(k), None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(facts, f)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
