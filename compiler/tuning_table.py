"""The GPUs' tuning tables (codegen_templates/tuning/<gpu>.json) and the page size each names.

Apart from build.py so that a server that reuses its artifact learns the page size without
importing the compiler (its passes, YAML and graph libraries)."""
import json
from pathlib import Path

from infc.config import DEFAULT_PAGE_SIZE

from .contract.errors import SpecError

GPUS = ("h100", "h200")
TUNING = Path(__file__).resolve().parent.parent / "codegen_templates" / "tuning"


def load_tuning(gpu: str, overlay: dict | None = None) -> dict:
    """The GPU's tuning table, with `overlay` ({template: {shape key or "default": {tunable:
    value}}}) laid over it: an experiment's variant of a kernel built without editing the table."""
    if gpu not in GPUS:
        raise SpecError(f"unknown gpu '{gpu}' (known: {', '.join(GPUS)})", None)
    table = json.loads((TUNING / f"{gpu}.json").read_text())
    for template, keys in (overlay or {}).items():
        entries = table.setdefault("templates", {}).setdefault(template, {})
        for key, tune in keys.items():
            entries[key] = {**entries.get(key, {}), **tune}
    return table


def default_page_size(gpu: str) -> int:
    """The KV cache page size a build takes when none is asked: the GPU table's `page_size`, else
    16 (vLLM's). A table names a larger page where its measurements chose it: 64-token pages let
    the flash attention take a tile of keys by TMA (one page a tile; bench/NOTES.md, tenth session)."""
    return int(load_tuning(gpu).get("page_size", DEFAULT_PAGE_SIZE))
