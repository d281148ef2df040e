"""The KV-event wire format, as vLLM publishes it and the KV-aware routers decode it (docs/serving.md,
"KV events"): one msgpack message a batch, written with msgspec.

    batch          [ts, [event, ...], data_parallel_rank]
    BlockStored    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                    lora_id, medium, lora_name]
    BlockRemoved   ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared ["AllBlocksCleared"]

Positional arrays with the class name first (msgspec's array_like structs with tag=True): the
encoding every consumer decodes. llm-d's KV-cache indexer reads the fields by position, Dynamo's
KV router takes a tagged array or a tagged map; vLLM releases since 2026 send the events as maps
keyed by field name, which the same consumers decode too, but older ones read arrays only. Fields
past lora_name (extra_keys, group_idx, ...) are optional in vLLM and left off, as its
omit_defaults leaves them off when unset.

A block hash is an unsigned 64-bit integer: the last 8 bytes, big-endian, of the block manager's
sha256 prefix hash. vLLM sends the same cut by default (an int, not the digest's bytes) because
Dynamo decodes hashes as 64-bit integers only; llm-d takes the last 8 bytes of a bytes hash, so
both read the same number. A block's hash names its whole prefix (block_manager.py), so a parent
hash is the hash of the block before it in the same sequence.

Imported only when events are on: msgspec is needed by nothing else in the runtime.
"""
import msgspec


class Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(_Event):
    pass


def block_hash(h: bytes) -> int:
    """The wire's 64-bit block hash of a prefix hash."""
    return int.from_bytes(h[-8:], "big")


def event(raw: tuple, block_size: int):
    """The wire struct of one event as the block manager recorded it (kv_events.py)."""
    kind = raw[0]
    if kind == "stored":
        _, hashes, parent, tokens, lora, medium = raw
        return BlockStored([block_hash(h) for h in hashes], None if parent is None else block_hash(parent),
                           tokens, block_size, None if lora is None else int(lora[1]), medium,
                           None if lora is None else lora[0])
    if kind == "removed":
        return BlockRemoved([block_hash(h) for h in raw[1]], raw[2])
    if kind == "cleared":
        return AllBlocksCleared()
    raise ValueError(f"unknown KV event {kind!r}")


def _int(o):
    """A token id a runner left as a numpy integer is written as the integer it is."""
    if hasattr(o, "__index__"):
        return o.__index__()
    raise TypeError(f"a KV event cannot carry {type(o).__name__}")


def encode(ts: float, events: list[tuple], block_size: int, rank: int) -> bytes:
    """One batch's payload (msgspec's module-level encoder: safe from any thread)."""
    return msgspec.msgpack.encode(Batch(ts, [event(e, block_size) for e in events], rank), enc_hook=_int)
