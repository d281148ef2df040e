"""The plan's names and versions, which the compiler writes and the runtime reads.

Each is defined here once: a plan or a tuning manifest from one side is read by the other
through these names, so they cannot drift apart.
"""
SCHEMA = "infc.plan/2"
TUNE_MANIFEST_VERSION = 2  # `infc tune prepare` writes it, `infc tune run` reads it; 2: plan/2 caches

# every dtype a plan names, in bytes an element; a packed dtype's elements are PACKED a byte
# along the last dimension (quantized weights' codes: compiler/quant/scheme.py)
DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "f8e4m3": 1, "u8": 1}
PACKED = {"u4": 2, "e2m1": 2}


NO_MAX_LEN = 1 << 30      # a model whose config sets no longest sequence (ALiBi's, a spec without max_len)


def plan_max_len(plan: dict) -> int:
    """The longest sequence a plan's model takes: its config's max_len (a spec's `max_len:` symbol,
    max_position_embeddings for most families), or NO_MAX_LEN where the spec names none."""
    return int((plan.get("config") or {}).get("max_len") or NO_MAX_LEN)


def nbytes(dtype: str, shape) -> int:
    """Bytes of a tensor of `shape` (static ints) in `dtype`, packed dtypes included."""
    n = 1
    for d in shape[:-1]:
        n *= d
    last = shape[-1] if len(shape) else 1
    if dtype in PACKED:
        return n * -(-last // PACKED[dtype])
    return n * last * DTYPE_BYTES[dtype]

# the value that orders a cache write before its reads (a launch output that is no buffer)
CACHE_MARKER = "cache"

STEP_METADATA = {
    "positions": {"shape": ["T"], "dtype": "i32", "doc": "absolute position of each token"},
    "seq_starts": {"shape": ["B+1"], "dtype": "i32", "doc": "first token row of each sequence"},
    "context_lens": {"shape": ["B"], "dtype": "i32", "doc": "KV length after this step"},
    "last_rows": {"shape": ["B"], "dtype": "i32", "doc": "row of each sequence's last token"},
    "slot_mapping": {"shape": ["T"], "dtype": "i32", "doc": "KV slot each new token writes"},
    "block_tables": {"shape": ["B", "max_pages"], "dtype": "i32", "doc": "KV pages per sequence"},
}
# Only in a plan that declares a slot cache (its kernels read it; plans without one are unchanged)
STATE_SLOTS = {"state_slots": {"shape": ["B"], "dtype": "i32",
                               "doc": "slot of each sequence in the slot caches (conv, recurrent state)"}}


# Only in a plan built with --enable-lora (compiler/passes/add_lora.py)
def lora_metadata(slots: int) -> dict:
    """lora_slots, and the rows grouped by slot that the kernels read (runtime/lora/groups.py),
    for S = max_loras + 1 adapter slots."""
    return {"lora_slots": {"shape": ["T"], "dtype": "i32",
                           "doc": "adapter slot of each token's request (0: no adapter)"},
            "lora_rows": {"shape": ["T"], "dtype": "i32",
                          "doc": "the rows in adapter slot order (a stable sort of lora_slots)"},
            "lora_segs": {"shape": [slots + 1], "dtype": "i32",
                          "doc": "slot s's rows: lora_rows[lora_segs[s]:lora_segs[s + 1]]"}}


def step_metadata(caches: dict, lora: int | None = None) -> dict:
    """The step metadata the plan's kernels read: STEP_METADATA, plus state_slots when a cache
    keeps one entry per sequence (kind "slot"), plus lora_metadata(lora) in a LoRA plan of lora
    adapter slots."""
    out = dict(STEP_METADATA)
    if any(c["kind"] == "slot" for c in caches.values()):
        out.update(STATE_SLOTS)
    if lora:
        out.update(lora_metadata(lora))
    return out
