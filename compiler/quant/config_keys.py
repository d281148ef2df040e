"""Reading a `quantization_config` (or one of its nested objects) so that every bad value fails the
build naming its key: `config.json: quantization_config.config_groups.group_0.weights.group_size:
...`. Shared by the format modules (compiler/quant/formats/)."""
import re

from ..contract.errors import ModelDirError

_MISSING = object()
# the largest group / block size read: the kernels and the numpy reference index in int32 / int64,
# and a size past a weight's dimension means one group anyway (a larger one is a typo, not a format)
MAX_SIZE = 2**31 - 1


class ConfigKeys:
    """One object of the config: `path` is its dotted key from quantization_config."""

    def __init__(self, d, where: str, path: str = "quantization_config"):
        self.d, self.where, self.path = d, where, path
        if not isinstance(d, dict):
            raise self.bad(None, f"must be an object, got {_show(d)}")

    def bad(self, key, why: str) -> ModelDirError:
        at = self.path if key is None else f"{self.path}.{key}"
        return ModelDirError(f"{self.where}: {at}: {why}")

    def only(self, known, meta=()):
        """Every key must be one the format reads (`known`) or metadata it can ignore (`meta`)."""
        for key in self.d:
            if key not in known and key not in meta:
                raise self.bad(key, f"unknown key (this format reads: {', '.join(sorted(known))})")
        return self

    def has(self, key) -> bool:
        return self.d.get(key) is not None

    def get(self, key, default=_MISSING, choices=None):
        v = self.d.get(key)
        if v is None:
            if default is _MISSING:
                raise self.bad(key, "missing")
            return default
        if choices is not None and v not in choices:
            raise self.bad(key, f"{_show(v)}: must be one of {', '.join(map(repr, choices))}")
        return v

    def int(self, key, default=_MISSING, choices=None, positive=True):
        v = self.get(key, default)
        if v is None and default is None:
            return None
        if not isinstance(v, int) or isinstance(v, bool) or (positive and v <= 0):
            raise self.bad(key, f"{_show(v)}: must be a {'positive ' if positive else ''}integer")
        if v > MAX_SIZE:
            raise self.bad(key, f"{v}: too large (at most {MAX_SIZE})")
        if choices is not None and v not in choices:
            raise self.bad(key, f"{v}: must be one of {', '.join(map(str, choices))}")
        return v

    def bool(self, key, default=_MISSING) -> bool:
        v = self.get(key, default)
        if not isinstance(v, bool):
            raise self.bad(key, f"{_show(v)}: must be true or false")
        return v

    def block(self, key):
        """A [rows, columns] block size (fp8's weight_block_size, compressed-tensors'
        block_structure), as a tuple; None where the key is absent or null."""
        v = self.get(key, None)
        if v is not None and not (isinstance(v, list) and len(v) == 2 and all(
                isinstance(b, int) and not isinstance(b, bool) and 0 < b <= MAX_SIZE for b in v)):
            raise self.bad(key, f"{v!r}: must be [rows, columns], two positive integers (at most {MAX_SIZE})")
        return None if v is None else tuple(v)

    def names(self, key) -> list:
        """A list of module names / patterns (each a valid regex where the format allows one)."""
        v = self.d.get(key)
        v = [] if v is None else v              # null is no list; "" or false is not a list either
        if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
            raise self.bad(key, f"{_show(v)}: must be a list of module names")
        for s in v:
            try:
                re.compile(s[3:] if s.startswith("re:") else s)
            except re.error as e:
                raise self.bad(key, f"{s!r} is not a valid pattern ({e})") from None
        return v

    def sub(self, key, default=_MISSING) -> "ConfigKeys | None":
        v = self.get(key, default)
        return None if v is None else ConfigKeys(v, self.where, f"{self.path}.{key}")


def _show(v) -> str:
    return repr(v) if isinstance(v, (str, int, float, bool)) or v is None else type(v).__name__


# what a module-name entry of an ignore list means: transformers' should_convert_module (a regex
# from the start up to a module boundary, or a suffix), so `lm_head` and `model.layers.*.self_attn`
# both read as their published loaders read them
_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"


def not_converted(module: str, patterns) -> bool:
    return any(re.match(rf"(?:{p}){_BOUNDARY}", module) or module.endswith(p) for p in patterns)
