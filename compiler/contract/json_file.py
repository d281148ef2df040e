"""Reading a model directory's JSON files (config.json, the safetensors index, tokenizer_config.json,
generation_config.json) so that a broken one is a ModelDirError naming the file, never a traceback.

json.loads raises more than JSONDecodeError: RecursionError for `[[[[...` thousands deep,
ValueError for an integer of more than 4300 digits, UnicodeDecodeError for bytes that are not
UTF-8; each is the file's fault and is said so, with the line where JSON reports one.
"""
import json
from pathlib import Path

from .errors import ModelDirError


def loads(text: str | bytes, where) -> object:
    """The JSON value of text; `where` (a path, or a path and what part of it) names it in errors."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ModelDirError(f"{where}:{e.lineno}: invalid JSON: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise ModelDirError(f"{where}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except RecursionError:
        raise ModelDirError(f"{where}: invalid JSON: nested too deeply") from None
    except ValueError as e:             # e.g. "Exceeds the limit (4300 digits) for integer ..."
        raise ModelDirError(f"{where}: invalid JSON: {e}") from None


def check_regular(path: Path) -> None:
    """A file the model directory names must be a regular file (after links): reading a FIFO
    blocks forever, a directory fails with an OS error."""
    if Path(path).exists() and not Path(path).is_file():
        raise ModelDirError(f"{path}: not a regular file")


def read(path: Path) -> object:
    """The JSON value of the file at path (ModelDirError when it cannot be read or parsed)."""
    check_regular(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ModelDirError(f"{path}: cannot read ({e.strerror or e})") from None
    return loads(raw, path)


def read_object(path: Path) -> dict:
    """read(path), which must be a JSON object."""
    doc = read(path)
    if not isinstance(doc, dict):
        raise ModelDirError(f"{path}: a JSON {_kind(doc)}, not an object")
    return doc


def _kind(v) -> str:
    return {list: "list", str: "string", type(None): "null", bool: "boolean", int: "number",
            float: "number"}.get(type(v), type(v).__name__)


def json_key_line(path: Path, key: str) -> int | None:
    """The 1-based line of `"key":` in a JSON file (for file:line in messages), or None."""
    try:
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            if f'"{key}"' in line:
                return n
    except OSError:
        pass
    return None
