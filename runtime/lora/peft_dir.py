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
import json
import math
import re
from pathlib import Path

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


def _pattern_key(patterns: dict, module: str) -> str | None:
    """The rank_pattern / alpha_pattern key that names `module` (PEFT: the key, a regex, matches
    the end of the module's dotted name), else None."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def _number(cfg: dict, key: str, where: str, kind=(int, float), positive=True):
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, kind) or (positive and not v > 0):
        raise AdapterError(f"{where}: {CONFIG} '{key}' must be a positive number, got {v!r}")
    return v


def read_config(path: Path, name: str) -> dict:
    where = f"LoRA adapter '{name}' ({path})"
    f = path / CONFIG
    if not path.is_dir():
        raise AdapterError(f"{where}: no such directory")
    if not f.is_file():
        raise AdapterError(f"{where}: no {CONFIG} (a PEFT LoRA adapter directory has one)")
    try:
        cfg = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise AdapterError(f"{where}: {CONFIG} is not JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{where}: {CONFIG} must be a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: {CONFIG} peft_type is {cfg['peft_type']!r}; only LORA adapters are served")
    _number(cfg, "r", where, int)
    _number(cfg, "lora_alpha", where)
    for key, ok in _REFUSED.items():
        if key in cfg and cfg[key] not in ok:
            raise AdapterError(f"{where}: {CONFIG} '{key}': {cfg[key]!r} is not supported (a LoRA slot holds "
                               f"A and B only)")
    for key in ("rank_pattern", "alpha_pattern"):
        pat = cfg.get(key) or {}
        if not isinstance(pat, dict) or any(isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0
                                            for v in pat.values()):
            raise AdapterError(f"{where}: {CONFIG} '{key}' must map module names to positive numbers, got {pat!r}")
        cfg[key] = pat
    tm = cfg.get("target_modules")
    if not (isinstance(tm, str) or isinstance(tm, list) and tm and all(isinstance(t, str) for t in tm)):
        raise AdapterError(f"{where}: {CONFIG} 'target_modules' must be a module name list or a regex, got {tm!r}")
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
    except (ModelDirError, ValueError, OSError) as e:
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
            parts[module][m["ab"]] = (key, st.float32(key))
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
