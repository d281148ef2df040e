"""A LoRA adapter as PEFT publishes it: a directory with adapter_config.json and
adapter_model.safetensors, read without torch.

    adapter_config.json   peft_type LORA, r, lora_alpha, use_rslora, target_modules,
                          rank_pattern / alpha_pattern (a module's own rank and alpha, keyed by a
                          name or a regex matched at the end of the module's name, as PEFT does)
    adapter_model.safetensors   base_model.model.<module>.lora_A.weight [r, K] and
                          .lora_B.weight [N, r] (an adapter name before .weight is allowed)

The scale of a module is alpha / r, or alpha / sqrt(r) with rsLoRA (use_rslora). What PEFT can
save but a LoRA slot cannot hold (DoRA's magnitudes, trained biases, modules_to_save's full
copies, embedding adapters, fan_in_fan_out weights) is refused naming the key, as is anything
malformed: a bad adapter never reaches a slot.
"""
import math
import re
from pathlib import Path

from infc.compiler.contract import json_file
from infc.compiler.contract.errors import ModelDirError
from infc.compiler.contract.safetensors_io import SafetensorsFile

from .adapter import Adapter, ModuleDelta
from .tables import AdapterError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
# a lora tensor's key: <module>.lora_A[.<adapter name>].weight
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(\.[^.]+)?\.weight$")
# adapter_config.json settings whose non-default values a LoRA slot cannot serve
_REFUSED = {"use_dora": (False, None), "fan_in_fan_out": (False, None), "bias": ("none", None),
            "lora_bias": (False, None), "modules_to_save": (None, []),
            "use_qalora": (False, None)}
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")     # the weight dtypes an adapter may store


def _pattern_re(key: str) -> str:
    """The regex a rank_pattern / alpha_pattern key stands for (PEFT: the key matches the end of
    the module's dotted name)."""
    return rf"(.*\.)?({key})$"


def _pattern_key(patterns: dict, module: str) -> str | None:
    """The rank_pattern / alpha_pattern key that names `module`, else None."""
    for key in patterns:
        if re.match(_pattern_re(key), module):
            return key
    return None


def _positive(v, kind=(int, float)) -> bool:
    """v is a positive number of `kind` that a float holds (the scale is a float: an alpha of
    1e400 or Infinity would overflow it)."""
    if isinstance(v, bool) or not isinstance(v, kind) or not v > 0:
        return False
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


def _number(cfg: dict, key: str, where: str, kind=(int, float)):
    v = cfg.get(key)
    if not _positive(v, kind):
        raise AdapterError(f"{where}: {CONFIG} '{key}' must be a positive number, got {v!r}")
    return v


def _regex(pattern: str, what: str, where: str, wrapped: str | None = None):
    """A regex the adapter's config gives, compiled now as it is used (`wrapped`): a bad one is
    the config's error, not a re.error (a 500) out of the first match."""
    try:
        re.compile(pattern if wrapped is None else wrapped)
    except (re.error, RecursionError, OverflowError) as e:
        raise AdapterError(f"{where}: {CONFIG} {what} {pattern!r} is not a valid regex: {e}") from None


def _read_json(path: Path, where: str) -> dict:
    """adapter_config.json's object. What cannot be read or parsed is the adapter's error: an
    OSError (a path too long, no permission) or a RecursionError (JSON nested 100,000 deep) would
    otherwise reach a server as a 500."""
    f = path / CONFIG
    try:
        kind = "dir" if path.is_dir() else "file" if path.exists() else None
        raw = f.read_bytes() if kind == "dir" and f.is_file() else None
    except OSError as e:
        raise AdapterError(f"{where}: cannot read it ({e.strerror or e})") from None
    if kind is None:
        raise AdapterError(f"{where}: no such directory")
    if kind == "file":
        raise AdapterError(f"{where}: a file, not an adapter directory (a PEFT LoRA adapter is a directory "
                           f"with {CONFIG} and {WEIGHTS})")
    if raw is None:
        raise AdapterError(f"{where}: no {CONFIG} (a PEFT LoRA adapter directory has one)")
    try:
        cfg = json_file.loads(raw, CONFIG)
    except ModelDirError as e:           # the adapter's own class: the server answers it with a 400
        raise AdapterError(f"{where}: {CONFIG} is not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{where}: {CONFIG} must be a JSON object")
    return cfg


def read_config(path: Path, name: str) -> dict:
    where = f"LoRA adapter '{name}' ({path})"
    cfg = _read_json(path, where)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: {CONFIG} peft_type is {cfg['peft_type']!r}; only LORA adapters are served")
    _number(cfg, "r", where, int)
    _number(cfg, "lora_alpha", where)
    for key, ok in _REFUSED.items():
        if key in cfg and cfg[key] not in ok:
            raise AdapterError(f"{where}: {CONFIG} '{key}': {cfg[key]!r} is not supported (a LoRA slot holds "
                               f"A and B only)")
    # a string "false" is truthy: taken as given it would silently scale by alpha / sqrt(r)
    if cfg.get("use_rslora") not in (None, False, True):
        raise AdapterError(f"{where}: {CONFIG} 'use_rslora' must be true or false, got {cfg['use_rslora']!r}")
    for key, kind, what in (("rank_pattern", int, "positive integers (ranks)"),
                            ("alpha_pattern", (int, float), "positive numbers")):
        pat = cfg.get(key) or {}
        if not isinstance(pat, dict) or not all(_positive(v, kind) for v in pat.values()):
            raise AdapterError(f"{where}: {CONFIG} '{key}' must map module names to {what}, got {pat!r}")
        for k in pat:
            _regex(k, f"'{key}' key", where, _pattern_re(k))
        cfg[key] = pat
    tm = cfg.get("target_modules")
    if not (isinstance(tm, str) or isinstance(tm, list) and tm and all(isinstance(t, str) for t in tm)):
        raise AdapterError(f"{where}: {CONFIG} 'target_modules' must be a module name list or a regex, got {tm!r}")
    if isinstance(tm, str):
        _regex(tm, "'target_modules'", where)
    return cfg


def check_targets(cfg: dict, targets, name: str, path: Path):
    """A target_modules list naming a module the build does not adapt is refused up front (a regex
    is checked through the tensors it produced)."""
    tm = cfg["target_modules"]
    if isinstance(tm, list):
        unknown = sorted({t.rsplit(".", 1)[-1] for t in tm} - set(targets))
        if unknown:
            raise AdapterError(f"LoRA adapter '{name}' ({path}): target_modules {unknown} are not modules this "
                               f"build adapts ({', '.join(targets)}; --lora-target-modules)")


def _float32(st: SafetensorsFile, key: str, where: str):
    """A LoRA weight as float32; an integer, bool or fp8 tensor is refused rather than cast (an
    int8 A or B is a quantized adapter without its scales: cast, it would serve garbage)."""
    if st.dtype(key) not in FLOAT_DTYPES:
        raise AdapterError(f"{where}: tensor '{key}' is {st.dtype(key)}; LoRA weights are floating point "
                           f"({', '.join(FLOAT_DTYPES)})")
    try:
        return st.float32(key)
    except (OSError, ValueError) as e:  # the file changed or went away under the mapping
        raise AdapterError(f"{where}: {WEIGHTS}: cannot read tensor '{key}' ({e})") from None


def load_peft(path, name: str) -> Adapter:
    """The adapter in `path` as float32 deltas with their scales."""
    path = Path(path)
    cfg = read_config(path, name)
    where = f"LoRA adapter '{name}' ({path})"
    f = path / WEIGHTS
    if not f.is_file():
        other = " (adapter_model.bin is a pickle: save it with safe_serialization=True)" \
            if (path / "adapter_model.bin").exists() else ""
        raise AdapterError(f"{where}: no {WEIGHTS}{other}")
    try:
        st = SafetensorsFile(f)
    except (ModelDirError, ValueError, OSError, RecursionError) as e:   # RecursionError: a nested header
        raise AdapterError(f"{where}: {WEIGHTS} is not a readable safetensors file: {e}") from None
    parts: dict[str, dict] = {}
    try:
        for key in st.names():
            m = _KEY.match(key)
            if m is None or not key.startswith(PREFIX):
                raise AdapterError(f"{where}: tensor '{key}' is not a LoRA A or B weight "
                                   f"({PREFIX}<module>.lora_A.weight / .lora_B.weight)")
            module = m["module"][len(PREFIX):]
            if m["ab"] in parts.setdefault(module, {}):
                raise AdapterError(f"{where}: two lora_{m['ab']} tensors for module '{module}'")
            parts[module][m["ab"]] = (key, _float32(st, key, where))
    finally:
        st.close()
    out = Adapter(name, str(path))
    for module, ab in sorted(parts.items()):
        for need in "AB":
            if need not in ab:
                raise AdapterError(f"{where}: module '{module}' has a lora_{'B' if need == 'A' else 'A'} "
                                   f"weight but no lora_{need}")
        (ka, a), (kb, b) = ab["A"], ab["B"]
        rk = _pattern_key(cfg["rank_pattern"], module)
        r = cfg["rank_pattern"][rk] if rk is not None else cfg["r"]
        if a.ndim != 2 or a.shape[0] != r:
            raise AdapterError(f"{where}: tensor '{ka}' is {list(a.shape)}, {CONFIG} gives module '{module}' "
                               f"rank {r}: [{r}, K] expected")
        ak = _pattern_key(cfg["alpha_pattern"], module)
        alpha = cfg["alpha_pattern"][ak] if ak is not None else cfg["lora_alpha"]
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        out.modules[module] = ModuleDelta(a, b, float(scale))
    return out
