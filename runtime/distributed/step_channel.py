"""The wire between rank 0 and its worker processes (one process per GPU): each step's StepMeta
(with, for overlapped steps, its rows' sampling and the tokens fed from the step before), frees,
stop, acknowledgements, errors and (CPU tests) a collective's arrays, with no pickle.

A frame is a fixed header and a list of named items; numpy arrays travel as their raw bytes,
their dtype and shape in the item header:

    frame  := magic b"INFC" | u16 version | u16 kind | u32 item count | item*
    item   := u8 tag | u8 name length | name (ascii) | payload
        tag INT:  i64
        tag STR:  u32 length | utf-8 bytes
        tag NONE: (nothing)
        tag ARR:  u8 dtype code | u8 ndim | i64 * ndim shape | raw bytes (C order, little-endian)

On a stream socket every frame is prefixed by its u64 length. Decoding checks every length, code
and name and raises ChannelError (a ValueError) with what was wrong; a StepMeta frame must carry
exactly StepMeta's fields. Only ints, strings and raw array bytes cross: no Python objects.

Kinds (rank 0 -> worker unless said):

    STEP     step index, StepMeta's fields: run the step, rank 0 samples (encode_step / meta_of)
    LAUNCH   a STEP's items, its rows' sampling and fed tokens: an overlapped step, every rank
             samples every row (encode_launch / launch_of)
    DP_STEP  a STEP's items and its rows' sampling, logprobs included: a data-parallel rank's
             own step, which that rank samples (encode_dp_step / dp_step_of)
    DP_LAUNCH
             a DP_STEP's items and its fed tokens (as LAUNCH's): an overlapped data-parallel
             step, launched on that rank; the ACK answering it carries the samples of the step
             that rank launched before if that is still uncollected, else none
             (encode_dp_launch / dp_launch_of)
    DP_COLLECT
             step index: collect that launched data-parallel step (the last one launched); its
             ACK carries its samples (encode_dp_collect / dp_collect_of)
    FREE     seq_ids i64 [n]: forget these sequences
    STOP     (nothing): every rank closes together
    ACK      worker -> rank 0: step index (startup: -1 and the runner's shape); a DP_STEP's
             also carries the rank's samples (encode_samples / samples_of); a DP_LAUNCH's or
             DP_COLLECT's carries the samples of the step its index names, or (a DP_LAUNCH with
             no step pending) the launched step's index alone (dp_reply_of)
    ERROR    worker -> rank 0: message, the worker's traceback
    HELLO    worker -> rank 0 on connecting: token, rank, role
    ARRAYS   either way: a collective's inputs (the CPU exchange)
    BYTES    data: what rank 0 shares at startup (the NCCL id)
"""
import dataclasses
import math
import select
import socket
import struct
import time

import numpy as np

from ..engine.step import StepMeta

MAGIC = b"INFC"
VERSION = 1
_HEAD = struct.Struct("<4sHHI")
_LEN = struct.Struct("<Q")
MAX_FRAME = 1 << 34                  # 16 GiB: a corrupt length prefix is refused, not allocated

# kinds
STEP, FREE, STOP, ACK, ERROR, HELLO, ARRAYS, BYTES, LAUNCH, DP_STEP, DP_LAUNCH, DP_COLLECT = range(1, 13)
KIND_NAMES = {STEP: "step", FREE: "free", STOP: "stop", ACK: "ack", ERROR: "error",
              HELLO: "hello", ARRAYS: "arrays", BYTES: "bytes", LAUNCH: "launch",
              DP_STEP: "data-parallel step", DP_LAUNCH: "data-parallel launch",
              DP_COLLECT: "data-parallel collect"}

# item tags
_INT, _STR, _NONE, _ARR = range(1, 5)
_DTYPES = {1: np.dtype("<i4"), 2: np.dtype("<i8"), 3: np.dtype("<f4"), 4: np.dtype("<f2"),
           5: np.dtype("<f8"), 6: np.dtype("u1"), 7: np.dtype("?"), 8: np.dtype("<u4"),
           9: np.dtype("<i2")}
_CODES = {d: c for c, d in _DTYPES.items()}


class ChannelError(ValueError):
    """A malformed frame, or a frame of the wrong kind or fields."""
    engine_fatal = True          # the ranks no longer agree on the steps


class PeerGone(ConnectionError):
    """The other end closed (a worker or rank 0 exited or was killed), or did not answer in time."""
    engine_fatal = True


# -- frames -----------------------------------------------------------------------------------
def encode(kind: int, items: list[tuple[str, object]]) -> bytes:
    """items: [(name, int | str | None | np.ndarray)] -> one frame."""
    if kind not in KIND_NAMES:
        raise ChannelError(f"unknown frame kind {kind}")
    parts = [_HEAD.pack(MAGIC, VERSION, kind, len(items))]
    for name, v in items:
        nb = name.encode("ascii")
        if len(nb) > 255:
            raise ChannelError(f"item name {name!r} is longer than 255 bytes")
        if isinstance(v, np.ndarray):
            a = np.ascontiguousarray(v)
            code = _CODES.get(a.dtype.newbyteorder("<"))
            if code is None:
                raise ChannelError(f"{name}: dtype {a.dtype} cannot go on the channel "
                                   f"(one of {sorted(str(d) for d in _CODES)})")
            if a.ndim > 255:
                raise ChannelError(f"{name}: {a.ndim} dimensions")
            a = a.astype(_DTYPES[code], copy=False)
            parts += [struct.pack("<BB", _ARR, len(nb)), nb, struct.pack("<BB", code, a.ndim),
                      struct.pack(f"<{a.ndim}q", *a.shape), a.tobytes()]
        elif v is None:
            parts += [struct.pack("<BB", _NONE, len(nb)), nb]
        elif isinstance(v, (bool, int, np.integer)):
            parts += [struct.pack("<BB", _INT, len(nb)), nb, struct.pack("<q", int(v))]
        elif isinstance(v, str):
            sb = v.encode("utf-8")
            parts += [struct.pack("<BB", _STR, len(nb)), nb, struct.pack("<I", len(sb)), sb]
        else:
            raise ChannelError(f"{name}: a {type(v).__name__} cannot go on the channel "
                               f"(int, str, None or a numpy array)")
    return b"".join(parts)


def decode(frame) -> tuple[int, list[tuple[str, object]]]:
    """One frame -> (kind, items); arrays are fresh, writable copies."""
    buf = memoryview(frame).cast("B")
    n = len(buf)
    if n < _HEAD.size:
        raise ChannelError(f"a frame of {n} bytes is shorter than the {_HEAD.size}-byte header")
    magic, version, kind, count = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ChannelError(f"bad magic {bytes(magic)!r}: not an infc step-channel frame")
    if version != VERSION:
        raise ChannelError(f"step-channel version {version}, this side speaks {VERSION}")
    if kind not in KIND_NAMES:
        raise ChannelError(f"unknown frame kind {kind}")
    pos = _HEAD.size

    def take(k: int, what: str) -> memoryview:
        nonlocal pos
        if k < 0 or pos + k > n:
            raise ChannelError(f"truncated frame: {what} needs {k} bytes at offset {pos}, "
                               f"the frame has {n}")
        out = buf[pos: pos + k]
        pos += k
        return out

    items = []
    for i in range(count):
        tag, ln = struct.unpack("<BB", take(2, f"item {i}'s header"))
        try:
            name = bytes(take(ln, f"item {i}'s name")).decode("ascii")
        except UnicodeDecodeError:
            raise ChannelError(f"item {i}: its name is not ascii") from None
        if tag == _INT:
            (v,) = struct.unpack("<q", take(8, name))
        elif tag == _STR:
            (ls,) = struct.unpack("<I", take(4, name))
            try:
                v = bytes(take(ls, name)).decode("utf-8")
            except UnicodeDecodeError:
                raise ChannelError(f"{name}: not utf-8") from None
        elif tag == _NONE:
            v = None
        elif tag == _ARR:
            code, ndim = struct.unpack("<BB", take(2, f"{name}'s dtype"))
            if code not in _DTYPES:
                raise ChannelError(f"{name}: unknown dtype code {code}")
            shape = struct.unpack(f"<{ndim}q", take(8 * ndim, f"{name}'s shape"))
            if any(s < 0 for s in shape):
                raise ChannelError(f"{name}: negative shape {shape}")
            dt = _DTYPES[code]
            size = math.prod(shape) * dt.itemsize
            if size > n:
                raise ChannelError(f"{name}: shape {shape} of {dt} needs {size} bytes, the frame "
                                   f"has {n}")
            v = np.frombuffer(take(size, f"{name}'s data"), dt).reshape(shape).copy()
        else:
            raise ChannelError(f"item {i} ({name!r}): unknown tag {tag}")
        items.append((name, v))
    if pos != n:
        raise ChannelError(f"{n - pos} trailing bytes after {count} items")
    return kind, items


# -- steps ------------------------------------------------------------------------------------
_META_FIELDS = [f.name for f in dataclasses.fields(StepMeta)]
_META_OPTIONAL = {f.name for f in dataclasses.fields(StepMeta) if f.default is None}
_META_TYPES = {f.name: (np.ndarray if "ndarray" in str(f.type) else f.type)
               for f in dataclasses.fields(StepMeta)}


def _step_items(meta: StepMeta, step: int) -> list:
    """What every step frame starts with: the step's index, then every StepMeta field by name."""
    return [("step", step)] + [(f, getattr(meta, f)) for f in _META_FIELDS]


def encode_step(meta: StepMeta, step: int = 0) -> bytes:
    """A STEP frame: the step's index, then every StepMeta field by name."""
    return encode(STEP, _step_items(meta, step))


def decode_step(frame) -> tuple[int, StepMeta]:
    kind, items = decode(frame)
    return meta_of(kind, items)


def meta_of(kind: int, items: list) -> tuple[int, StepMeta]:
    if kind in (LAUNCH, DP_STEP, DP_LAUNCH):      # a step frame with the rows' sampling after it
        items = items[:1 + len(_META_FIELDS)]
    elif kind != STEP:
        raise ChannelError(f"expected a step frame, got {KIND_NAMES[kind]}")
    names = [k for k, _ in items]
    if names != ["step"] + _META_FIELDS:
        raise ChannelError(f"a step frame with fields {names}; StepMeta has {_META_FIELDS} "
                           f"(rank 0 and this worker run different infc versions?)")
    d = dict(items)
    for f in _META_FIELDS:
        v, want = d[f], _META_TYPES[f]
        if not (isinstance(v, want) or (v is None and f in _META_OPTIONAL)):
            raise ChannelError(f"step field {f}: got {type(v).__name__}, StepMeta wants "
                               f"{want.__name__}{' or None' if f in _META_OPTIONAL else ''}")
    return d.pop("step"), StepMeta(**d)


# -- overlapped steps: a step, its rows' sampling and its fed tokens ---------------------------
# a row's logits processing (engine/logits_process.py): penalties and their token counts, its
# logit_bias, its one bitmask (allowed_token_ids and a structured output's, combined); the
# flat arrays hold every row's entries in row order, *_n how many are each row's
_PROC_FIELDS = [("rep", "<f8"), ("freq", "<f8"), ("pres", "<f8"), ("pen_n", "<i4"), ("pen_ids", "<i4"),
                ("pen_counts", "<i4"), ("pen_prompt", "?"), ("bias_n", "<i4"), ("bias_ids", "<i4"),
                ("bias", "<f4"), ("has_mask", "?"), ("masks", "<i4")]
_FLAT = {"banned", "feed", "pen_ids", "pen_counts", "pen_prompt", "bias_ids", "bias", "masks"}
_ROW_FIELDS = [("row", "<i4"), ("temperature", "<f8"), ("top_k", "<i4"), ("top_p", "<f8"),
               ("min_p", "<f8"), ("sample_step", "<i4"), ("banned_n", "<i4"), ("banned", "<i8"),
               *_PROC_FIELDS, ("feed", "<i4")]
# a data-parallel rank samples its own rows for the engine: logprobs too (-1: none), no feed
_DP_ROW_FIELDS = [f for f in _ROW_FIELDS if f[0] != "feed"] + [("logprobs", "<i4")]
# an overlapped data-parallel step: those and the fed tokens
_DP_LAUNCH_FIELDS = _DP_ROW_FIELDS + [("feed", "<i4")]


def _row_items(sampling: list, fields: list, feed=()) -> list:
    """The rows' sampling as arrays (one entry per row that samples), then their seeds as one
    decimal string (a seed is any Python int)."""
    rows = [(b, s) for b, s in enumerate(sampling) if s is not None]
    p = [s.params for _, s in rows]
    arrays = {
        "row": [b for b, _ in rows], "temperature": [x.temperature for x in p],
        "top_k": [x.top_k for x in p], "top_p": [x.top_p for x in p], "min_p": [x.min_p for x in p],
        "sample_step": [s.step for _, s in rows], "banned_n": [len(s.banned) for _, s in rows],
        "banned": [t for _, s in rows for t in s.banned], "feed": [list(f) for f in feed],
        "logprobs": [-1 if x.logprobs is None else x.logprobs for x in p], **_proc_arrays(rows)}
    items = [(n, np.asarray(arrays[n], dt).reshape((-1, 2) if n == "feed" else (-1,))) for n, dt in fields]
    return items + [("seeds", ",".join(str(s.seed) for _, s in rows))]


def _proc_arrays(rows: list) -> dict:
    from ..engine.logits_process import bias_arrays, row_mask
    pens = [s.penalties for _, s in rows]
    biases = [bias_arrays(s.params) for _, s in rows]
    masks = [row_mask(s) for _, s in rows]
    def flat(parts, dt):
        return np.concatenate([np.asarray(x, dt) for x in parts]) if parts else np.zeros(0, dt)
    return {"rep": [1.0 if x is None else x.repetition for x in pens],
            "freq": [0.0 if x is None else x.frequency for x in pens],
            "pres": [0.0 if x is None else x.presence for x in pens],
            "pen_n": [0 if x is None else x.ids.size for x in pens],
            "pen_ids": flat([x.ids for x in pens if x is not None], np.int32),
            "pen_counts": flat([x.counts for x in pens if x is not None], np.int32),
            "pen_prompt": flat([x.in_prompt for x in pens if x is not None], bool),
            "bias_n": [ids.size for ids, _ in biases], "bias_ids": flat([i for i, _ in biases], np.int32),
            "bias": flat([b for _, b in biases], np.float32), "has_mask": [m is not None for m in masks],
            "masks": flat([m for m in masks if m is not None], np.int32)}


def _proc_of(d: dict, n: int, what: str) -> list[dict]:
    """Each row's RowSampling fields (penalties, bitmask) and logit_bias, from _proc_arrays's."""
    from ..engine.logits_process import Penalties
    if int(d["pen_n"].sum()) != len(d["pen_ids"]) or int(d["bias_n"].sum()) != len(d["bias_ids"]) \
            or not len(d["pen_ids"]) == len(d["pen_counts"]) == len(d["pen_prompt"]) \
            or len(d["bias_ids"]) != len(d["bias"]):
        raise ChannelError(f"a {what} frame whose logits-processing fields disagree in length")
    masked = int(d["has_mask"].sum())
    W = len(d["masks"]) // masked if masked else 0
    if W * masked != len(d["masks"]):
        raise ChannelError(f"a {what} frame whose bitmasks are not whole rows")
    out, pen_at, bias_at, mask_at = [], 0, 0, 0
    for i in range(n):
        k, nb = int(d["pen_n"][i]), int(d["bias_n"][i])
        pen = None
        if k or d["rep"][i] != 1.0 or d["freq"][i] != 0.0 or d["pres"][i] != 0.0:
            pen = Penalties(float(d["rep"][i]), float(d["freq"][i]), float(d["pres"][i]),
                            d["pen_ids"][pen_at:pen_at + k], d["pen_counts"][pen_at:pen_at + k],
                            d["pen_prompt"][pen_at:pen_at + k])
        bias = dict(zip(d["bias_ids"][bias_at:bias_at + nb].tolist(), d["bias"][bias_at:bias_at + nb].tolist()))
        mask = None
        if d["has_mask"][i]:
            mask, mask_at = d["masks"][mask_at:mask_at + W], mask_at + W
        out.append({"penalties": pen, "logit_bias": bias or None, "bitmask": mask})
        pen_at, bias_at = pen_at + k, bias_at + nb
    return out


def _rows_of(what: str, rest: list, fields: list, B: int) -> tuple[list, dict]:
    """The items after a frame's StepMeta -> (sampling rows [RowSampling | None] * B, the arrays)."""
    from ..engine.runner import RowSampling
    from ..engine.sampling import SamplingParams
    names = [n for n, _ in rest]
    if names != [n for n, _ in fields] + ["seeds"]:
        raise ChannelError(f"a {what} frame with sampling fields {names}")
    d = dict(rest)
    seeds = [int(x) for x in d["seeds"].split(",")] if d["seeds"] else []
    n = len(d["row"])
    per_row = [f for f, _ in fields if f != "row" and f not in _FLAT]
    if not all(len(d[f]) == n for f in per_row) or len(seeds) != n \
            or int(d["banned_n"].sum()) != len(d["banned"]):
        raise ChannelError(f"a {what} frame whose sampling fields disagree in length")
    if n and (d["row"].min() < 0 or d["row"].max() >= B):
        raise ChannelError(f"a {what} frame samples rows {d['row'].tolist()} of a {B}-row step")
    sampling, at = [None] * B, 0
    proc = _proc_of(d, n, what)
    for i, b in enumerate(d["row"].tolist()):
        banned = tuple(d["banned"][at:at + int(d["banned_n"][i])].tolist())
        at += len(banned)
        top = int(d["logprobs"][i]) if "logprobs" in d else -1
        params = SamplingParams(max_tokens=None, temperature=float(d["temperature"][i]),
                                top_k=int(d["top_k"][i]), top_p=float(d["top_p"][i]),
                                min_p=float(d["min_p"][i]), logprobs=None if top < 0 else top,
                                logit_bias=proc[i]["logit_bias"])
        sampling[b] = RowSampling(params, seeds[i], int(d["sample_step"][i]), banned,
                                  bitmask=proc[i]["bitmask"], penalties=proc[i]["penalties"])
    return sampling, d


def encode_launch(meta: StepMeta, step: int, sampling: list, feed) -> bytes:
    """A LAUNCH frame: the STEP frame's items, then what a rank needs to sample every row as rank
    0 does (its logits are the same bits, so its tokens are too): each sampling row's index,
    temperature, top-k, top-p, min-p, seed (a decimal string: any Python int), step and banned
    ids; then `feed`, the (row, prev_row) pairs whose tokens come from the step before."""
    return encode(LAUNCH, _step_items(meta, step) + _row_items(sampling, _ROW_FIELDS, feed))


def launch_of(kind: int, items: list) -> tuple[int, StepMeta, list, list]:
    """A LAUNCH frame's items -> (step, meta, sampling rows [RowSampling | None] * B, feed)."""
    k, meta = meta_of(kind, items)
    if kind != LAUNCH:
        raise ChannelError(f"expected a launch frame, got {KIND_NAMES[kind]}")
    sampling, d = _rows_of("launch", items[1 + len(_META_FIELDS):], _ROW_FIELDS, meta.B)
    return k, meta, sampling, [tuple(f) for f in d["feed"].tolist()]


# -- data-parallel steps: each rank its own step, sampled by that rank ---------------------------
def _rank_step_items(meta: StepMeta, step: int, sampling: list) -> list:
    """A data-parallel rank's step frame's first items; every row of its step has a sampling entry."""
    if len(sampling) != meta.B:
        raise ChannelError(f"{len(sampling)} sampling rows for a step of {meta.B} sequences")
    return _step_items(meta, step)


def encode_dp_step(meta: StepMeta, step: int, sampling: list) -> bytes:
    """A DP_STEP frame: the STEP frame's items, then the rows' sampling as in a LAUNCH frame plus
    each row's logprobs (-1: none), without fed tokens. sampling: [RowSampling | None] * meta.B."""
    return encode(DP_STEP, _rank_step_items(meta, step, sampling) + _row_items(sampling, _DP_ROW_FIELDS))


def dp_step_of(kind: int, items: list) -> tuple[int, StepMeta, list]:
    """A DP_STEP frame's items -> (step, meta, sampling rows [RowSampling | None] * B)."""
    if kind != DP_STEP:
        raise ChannelError(f"expected a data-parallel step frame, got {KIND_NAMES[kind]}")
    k, meta = meta_of(kind, items)
    sampling, _ = _rows_of("data-parallel step", items[1 + len(_META_FIELDS):], _DP_ROW_FIELDS, meta.B)
    return k, meta, sampling


# -- overlapped data-parallel steps: launched on each rank, their samples read a step later -------
def encode_dp_launch(meta: StepMeta, step: int, sampling: list, feed) -> bytes:
    """A DP_LAUNCH frame: a DP_STEP frame's items (the rows' sampling, logprobs included), then
    `feed` as a LAUNCH frame has it: the (row, prev_row) pairs whose tokens are what this rank
    sampled in row prev_row of the step it launched before."""
    return encode(DP_LAUNCH, _rank_step_items(meta, step, sampling)
                  + _row_items(sampling, _DP_LAUNCH_FIELDS, feed))


def dp_launch_of(kind: int, items: list) -> tuple[int, StepMeta, list, list]:
    """A DP_LAUNCH frame's items -> (step, meta, sampling rows [RowSampling | None] * B, feed)."""
    if kind != DP_LAUNCH:
        raise ChannelError(f"expected a data-parallel launch frame, got {KIND_NAMES[kind]}")
    k, meta = meta_of(kind, items)
    sampling, d = _rows_of("data-parallel launch", items[1 + len(_META_FIELDS):], _DP_LAUNCH_FIELDS,
                           meta.B)
    feed = [tuple(f) for f in d["feed"].tolist()]
    if any(not 0 <= row < meta.T or prev < 0 for row, prev in feed):
        raise ChannelError(f"a data-parallel launch frame feeds {feed} into a step of {meta.T} tokens")
    return k, meta, sampling, feed


def encode_dp_collect(step: int) -> bytes:
    """A DP_COLLECT frame: collect launched data-parallel step `step`."""
    return encode(DP_COLLECT, [("step", step)])


def dp_collect_of(kind: int, items: list) -> int:
    """A DP_COLLECT frame's items -> the step to collect."""
    if kind != DP_COLLECT or [n for n, _ in items] != ["step"] or not isinstance(items[0][1], int):
        raise ChannelError(f"expected a data-parallel collect frame with its step, got "
                           f"{KIND_NAMES[kind]} with {[n for n, _ in items]}")
    return items[0][1]


def dp_reply_of(kind: int, items: list) -> tuple[int, list | None]:
    """A worker's answer to DP_LAUNCH / DP_COLLECT -> (step, samples [Sample | None] * B), or
    (the launched step, None) for a DP_LAUNCH's ACK that carries no samples."""
    if kind == ACK and [n for n, _ in items] == ["step"]:
        return items[0][1], None
    return samples_of(kind, items)


_SAMPLE_FIELDS = ["step", "token", "logprob", "top_n", "top_token", "top_logprob"]
_I32_MAX = np.iinfo(np.int32).max


def encode_samples(step: int, samples: list) -> bytes:
    """The ACK of a DP_STEP: the step index and the rank's samples [Sample | None] * B as arrays:
    token i32 [B] (-1: no sample), logprob f64 [B] (NaN: none), top_n i32 [B] (-1: no top list),
    and the top lists flattened in row order, top_token i32 and top_logprob f64 [sum of top_n]."""
    B = len(samples)
    token = np.full(B, -1, np.int32)
    logprob = np.full(B, np.nan, np.float64)
    top_n = np.full(B, -1, np.int32)
    tops = []
    for b, s in enumerate(samples):
        if s is None:
            continue
        if not 0 <= s.token <= _I32_MAX:           # -1 says "no sample": a real id never is
            raise ChannelError(f"row {b}: token id {s.token} cannot go on the channel")
        token[b] = s.token
        if s.logprob is not None:
            logprob[b] = s.logprob
        if s.top is not None:
            top_n[b] = len(s.top)
            tops += s.top
    top_token = np.asarray([t for t, _ in tops], np.int32)
    top_logprob = np.asarray([lp for _, lp in tops], np.float64)
    return encode(ACK, [("step", step), ("token", token), ("logprob", logprob), ("top_n", top_n),
                        ("top_token", top_token), ("top_logprob", top_logprob)])


def samples_of(kind: int, items: list) -> tuple[int, list]:
    """A DP_STEP's ACK -> (step, samples [Sample | None] * B)."""
    from ..engine.runner import Sample
    names = [n for n, _ in items]
    if kind != ACK or names != _SAMPLE_FIELDS:
        raise ChannelError(f"expected the ack of a data-parallel step with {_SAMPLE_FIELDS}, got "
                           f"{KIND_NAMES[kind]} with {names}")
    d = dict(items)
    token, logprob, top_n = d["token"], d["logprob"], d["top_n"]
    B = len(token)
    if len(logprob) != B or len(top_n) != B or len(d["top_token"]) != len(d["top_logprob"]) \
            or int(top_n[top_n > 0].sum()) != len(d["top_token"]):
        raise ChannelError("an ack whose sample fields disagree in length")
    if (top_n < -1).any() or (top_n[token < 0] != -1).any():
        raise ChannelError(f"an ack with top list lengths {top_n.tolist()} for tokens {token.tolist()}")
    samples, at = [None] * B, 0
    for b in np.flatnonzero(token >= 0).tolist():
        top = None
        if top_n[b] >= 0:
            n = int(top_n[b])
            top = list(zip(d["top_token"][at:at + n].tolist(), d["top_logprob"][at:at + n].tolist()))
            at += n
        lp = float(logprob[b])
        samples[b] = Sample(int(token[b]), None if np.isnan(lp) else lp, top)
    return d["step"], samples


# -- sockets ----------------------------------------------------------------------------------
def send_frame(sock: socket.socket, frame: bytes, what: str = "peer"):
    try:
        if len(frame) < 65536:
            sock.sendall(_LEN.pack(len(frame)) + frame)
        else:                               # no copy of a large frame
            sock.sendall(_LEN.pack(len(frame)))
            sock.sendall(frame)
    except OSError as e:               # BrokenPipe, ConnectionReset: the peer is gone
        raise PeerGone(f"{what}: the connection is closed ({e.__class__.__name__}: {e})") from None


def _recv_exact(sock: socket.socket, k: int, deadline: float | None, what: str,
                watch=()) -> bytearray:
    out = bytearray(k)
    view = memoryview(out)
    got = 0
    while got < k:
        wait = None if deadline is None else deadline - time.monotonic()
        if wait is not None and wait <= 0:
            raise PeerGone(f"{what}: no answer within the timeout")
        r, _, _ = select.select([sock, *watch], [], [], wait)
        if not r:
            raise PeerGone(f"{what}: no answer within the timeout")
        if sock not in r:                   # a watched sentinel fired: that process exited
            raise PeerGone(f"{what}: the process exited")
        try:
            m = sock.recv_into(view[got:], k - got)
        except OSError as e:
            raise PeerGone(f"{what}: the connection is broken ({e})") from None
        if m == 0:
            raise PeerGone(f"{what}: the connection closed (the process exited or was killed)")
        got += m
    return out


def recv_frame(sock: socket.socket, timeout: float | None = None, what: str = "peer",
               watch=()) -> bytearray:
    """The next frame's bytes. timeout: seconds for the whole frame (None: wait forever);
    watch: file descriptors (process sentinels) whose readiness means the peer died."""
    deadline = None if timeout is None else time.monotonic() + timeout
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size, deadline, what, watch))
    if n > MAX_FRAME:
        raise ChannelError(f"{what}: a frame length of {n} bytes (corrupt stream)")
    return _recv_exact(sock, n, deadline, what, watch)


def recv(sock: socket.socket, timeout: float | None = None, what: str = "peer", watch=()):
    """(kind, items) of the next frame."""
    return decode(recv_frame(sock, timeout, what, watch))
