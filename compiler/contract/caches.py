"""Caches: the per-sequence state a plan declares in plan["caches"], and the ONLY module that
knows how it is laid out (tests/test_cache_layout.py checks that nothing else does).

    caches[name] = {"kind": "paged" | "slot", "shape": [...], "dtype": "bf16" | "f32" | "f8e4m3",
                    "layers": [global layer indices], "scales": [one float a layer] (f8e4m3 only)}

An f8e4m3 cache (`--kv-cache-dtype fp8`, vLLM's) holds e4m3 codes with a per-tensor scale per
layer: a write stores e4m3(x / scale) (round to nearest even, saturated at +-448), a read gives
code * scale (`scale`). Host storage keeps the codes' values (float32, or torch fp8 tensors).

A paged cache holds `shape` per token; each layer's storage is [num_pages + 1, page_size, *shape]
(page num_pages is the padding page that CUDA-graph pad rows write to). A compressed paged cache
(`"every": m`, DeepSeek-V4's compressed KV entries and indexer keys) holds one row per m tokens:
the entry of tokens [e m, (e + 1) m) lives in the page of its last token, row (t % page_size) // m
of max(1, page_size // m) rows a page (`entry_address`; m and page_size must divide one another,
so for m > page_size only every (m / page_size)-th page's row is used). An entry is written when
its block completes, so a page holds only complete entries and prefix sharing, host blocks and
tiers move them with their pages unchanged. A slot cache holds `shape`
per sequence; each layer's storage is [num_slots + 1, *shape] (slot num_slots pads likewise).
Standard attention declares two paged caches, k and v, of shape [Hkv, D].

On the device every (cache, layer) is one region of one allocation, 256-byte aligned, in
plan order (cache by cache, layer by layer). Host storage (the numpy reference and CPU runner,
float32; the interpreter's torch tensors through a factory) is one array per (cache, layer).
copy_pages / copy_slot move whole pages / slots across every cache and layer: the primitives of
prefix sharing, host offload and forks.

A page as one host block (the KV tiers' unit, runtime/engine/kv_tier/): the page's bytes in every
paged (cache, layer), concatenated in plan order, page_bytes of them. HostCaches.read_pages /
write_pages and DeviceCaches.block_copies move pages to and from rows of such blocks.

State snapshots (hybrid prefix caching, runtime/engine/state_snapshots.py): a snapshot is one
slot of every slot cache and layer, kept apart from the running slots in a pool of its own. The
pool is storage of `snapshot_decl(caches)`: each slot cache declared as a paged cache of one-token
pages, so snapshot s is page s of it, and everything pages have (host blocks, block_copies, the
KV tiers' copies) works on snapshots unchanged. save_state / restore_state copy one running slot
to and from one snapshot (HostCaches: numpy; DeviceCaches: one device-to-device copy a region).
"""
from dataclasses import dataclass

import numpy as np

from .schema import DTYPE_BYTES

DTYPES = ("bf16", "f16", "f32", "f8e4m3")      # a cache's element types
FP8 = "f8e4m3"                       # the quantized KV cache's codes (needs "scales")
KINDS = ("paged", "slot")
ALIGN = 256


def check(caches: dict) -> dict:
    """Validates a plan's caches section; returns it."""
    for name, c in caches.items():
        if c.get("kind") not in KINDS:
            raise ValueError(f"cache '{name}': kind {c.get('kind')!r} is not one of {KINDS}")
        if c.get("dtype") not in DTYPES:
            raise ValueError(f"cache '{name}': dtype {c.get('dtype')!r} is not one of {list(DTYPES)}")
        if not all(isinstance(d, int) and d > 0 for d in c.get("shape", [None])):
            raise ValueError(f"cache '{name}': shape {c.get('shape')} must be positive integers")
        every = c.get("every")
        if every is not None and (c["kind"] != "paged" or not isinstance(every, int) or every < 1):
            raise ValueError(f"cache '{name}': 'every' (tokens per row) must be a positive integer "
                             f"on a paged cache, got {every!r} on a {c['kind']} cache")
        if not isinstance(c.get("layers"), list) or len(set(c["layers"])) != len(c["layers"]):
            raise ValueError(f"cache '{name}': layers must be a list of distinct layer indices")
        scales = c.get("scales")
        if (c["dtype"] == FP8) != (scales is not None):
            raise ValueError(f"cache '{name}': 'scales' go with dtype {FP8} and only with it")
        if scales is not None and (not isinstance(scales, list) or len(scales) != len(c["layers"]) or
                                   not all(isinstance(x, (int, float)) and 0 < x < float("inf") for x in scales)):
            raise ValueError(f"cache '{name}': scales must be one positive finite number per layer "
                             f"({len(c['layers'])}), got {scales}")
    return caches


def scale(c: dict, layer: int) -> float:
    """The per-tensor scale of one layer of cache declaration `c` (an FP8 cache's; 1.0 for the
    others, whose codes are their values): stored code = x / scale, value = code * scale."""
    if "scales" not in c:
        return 1.0
    return float(c["scales"][c["layers"].index(layer)])


def of_plan(plan: dict) -> dict:
    if "caches" not in plan:
        raise ValueError("the plan has no 'caches' section (a plan older than infc.plan/2? rebuild it)")
    return check(plan["caches"])


def select(caches: dict, names, layers=None) -> dict:
    """A sub-declaration: only `names`, and (when given) only `layers` of each (e.g. [0] to
    time one launch's caches in isolation)."""
    out = {}
    for n in names:
        if n not in caches:
            raise KeyError(f"no cache '{n}' (the plan declares {sorted(caches)})")
        c = caches[n]
        out[n] = dict(c, layers=list(layers) if layers is not None else list(c["layers"]))
        # an FP8 cache: the chosen layers' scales (1.0 for a stand-in layer it does not declare)
        if "scales" in c:
            out[n]["scales"] = [scale(c, l) if l in c["layers"] else 1.0 for l in out[n]["layers"]]
    return out


def _itemsize(c: dict, itemsize) -> int:
    return itemsize or DTYPE_BYTES[c["dtype"]]


def unit_shape(c: dict) -> list:
    """One token's (paged) or one sequence's (slot) shape in one layer, e.g. [KV heads, head_dim]."""
    return list(c["shape"])


def unit_elems(c: dict) -> int:
    """Elements of one token (paged) or one sequence (slot) in one layer."""
    return int(np.prod(c["shape"], dtype=np.int64))


def rows_per_page(c: dict, page_size: int) -> int:
    """Rows of one page of paged cache `c`: page_size, or for a compressed cache (every = m)
    max(1, page_size // m)."""
    m = c.get("every", 1)
    if page_size % m and m % page_size:
        raise ValueError(f"a compressed cache of one row per {m} tokens needs a page size that "
                         f"divides or is a multiple of {m}, not {page_size}")
    return max(1, page_size // m)


def entry_address(c: dict, page_size: int, pages, e):
    """(page id, row) of entry e (an int, or an array of them) of a compressed cache `c` (every =
    m) in a sequence whose block table row is `pages`: the page of the entry's last token,
    e m + m - 1."""
    m = c["every"]
    t = np.asarray(e, np.int64) * m + m - 1
    page = np.asarray(pages, np.int64)[t // page_size]
    row = (t % page_size) // m if m <= page_size else np.zeros_like(t)
    return page, row


def storage_shape(c: dict, page_size: int, num_pages: int, num_slots: int = 0) -> tuple:
    if c["kind"] == "paged":
        return (num_pages + 1, rows_per_page(c, page_size), *c["shape"])
    return (num_slots + 1, *c["shape"])


def page_bytes(caches: dict, page_size: int, itemsize: int | None = None) -> int:
    """Bytes of one page: every paged cache, every one of its layers."""
    return sum(rows_per_page(c, page_size) * unit_elems(c) * _itemsize(c, itemsize) * len(c["layers"])
               for c in caches.values() if c["kind"] == "paged")


def has_slots(caches: dict) -> bool:
    """Whether any cache keeps one entry per sequence: a plan that needs state slots (and step
    metadata `state_slots`), one per running sequence."""
    return any(c["kind"] == "slot" for c in caches.values())


def slot_bytes(caches: dict, itemsize: int | None = None) -> int:
    """Bytes of one slot: every slot cache, every one of its layers."""
    return sum(unit_elems(c) * _itemsize(c, itemsize) * len(c["layers"])
               for c in caches.values() if c["kind"] == "slot")


def snapshot_decl(caches: dict) -> dict:
    """The snapshot pool's declaration: the slot caches as paged caches (use a page size of 1):
    a page of it is one snapshot, slot_bytes of it."""
    return {n: dict(c, kind="paged") for n, c in caches.items() if c["kind"] == "slot"}


def snapshot_pool_bytes(caches: dict, num_snapshots: int, itemsize: int | None = None) -> int:
    """Bytes of a pool of num_snapshots state snapshots (unaligned)."""
    return num_snapshots * slot_bytes(caches, itemsize)


def token_bytes(caches: dict, itemsize: int | None = None) -> int:
    """Bytes of paged cache per token of context, all layers: what a decode step reads per cached
    token (the bandwidth floor's cache term); a compressed cache counts 1 / every of a row,
    rounded up over the whole."""
    import math
    paged = [c for c in caches.values() if c["kind"] == "paged"]
    lcm = math.lcm(1, *(c.get("every", 1) for c in paged))
    num = sum(unit_elems(c) * _itemsize(c, itemsize) * len(c["layers"]) * (lcm // c.get("every", 1))
              for c in paged)
    return -(-num // lcm)


def pages_for_budget(caches: dict, page_size: int, budget: int, num_slots: int = 0,
                     itemsize: int | None = None) -> int:
    """Usable pages whose storage (plus the padding page, plus num_slots + 1 slots, plus each
    region's alignment) fits in `budget` bytes. 0 or less: nothing fits. A plan with no paged
    cache needs no pages: 0."""
    per_page = page_bytes(caches, page_size, itemsize)
    if per_page == 0:
        return 0
    slots = (num_slots + 1) * slot_bytes(caches, itemsize)
    padding = ALIGN * sum(len(c["layers"]) for c in caches.values())
    return (budget - slots - padding) // per_page - 1


def storage_bytes(caches: dict, page_size: int, num_pages: int, num_slots: int = 0,
                  itemsize: int | None = None) -> int:
    """Bytes of all storage, unaligned (host arrays); Layout.nbytes is the aligned device size."""
    return (num_pages + 1) * page_bytes(caches, page_size, itemsize) + \
        (num_slots + 1) * slot_bytes(caches, itemsize)


@dataclass(frozen=True)
class Region:
    name: str
    layer: int
    offset: int          # bytes from the allocation's start
    nbytes: int
    shape: tuple         # storage shape
    dtype: str
    stride: int          # bytes of one page (paged) or one slot (slot) of this region


class Layout:
    """Where each (cache, layer) lives in one allocation."""

    def __init__(self, caches: dict, page_size: int, num_pages: int, num_slots: int = 0,
                 itemsize: int | None = None, align: int = ALIGN):
        check(caches)
        self.caches, self.page_size, self.num_pages, self.num_slots = caches, page_size, num_pages, num_slots
        self.regions: dict[tuple[str, int], Region] = {}
        pos = 0
        for name, c in caches.items():
            shape = storage_shape(c, page_size, num_pages, num_slots)
            size = _itemsize(c, itemsize)
            stride = int(np.prod(shape[1:], dtype=np.int64)) * size
            for layer in c["layers"]:
                n = shape[0] * stride
                self.regions[(name, layer)] = Region(name, layer, pos, n, shape, c["dtype"], stride)
                pos = -(-(pos + n) // align) * align
        self.nbytes = pos

    def region(self, name: str, layer: int) -> Region:
        try:
            return self.regions[(name, layer)]
        except KeyError:
            if name not in self.caches:
                raise KeyError(f"no cache '{name}' (the plan declares {sorted(self.caches)})") from None
            raise KeyError(f"cache '{name}' has no layer {layer} (its layers: "
                           f"{self.caches[name]['layers']})") from None

    def of_kind(self, kind: str) -> list[Region]:
        return [r for (n, _), r in self.regions.items() if self.caches[n]["kind"] == kind]

    @property
    def block_bytes(self) -> int:
        """Bytes of one host block (a page of every paged region, unaligned)."""
        return sum(r.stride for r in self.of_kind("paged"))

    def block_regions(self) -> list[tuple[int, int, int]]:
        """Where a host block's parts live: (offset of the region in the allocation, bytes a page,
        offset in the block) per paged (cache, layer), in block order (the module docstring)."""
        out, at = [], 0
        for r in self.of_kind("paged"):
            out.append((r.offset, r.stride, at))
            at += r.stride
        return out


def _pairs(src, dst) -> tuple[np.ndarray, np.ndarray]:
    """Page ids as arrays; the two sides must not share a page (the device copies them one run
    at a time, so a page both read and written would give order-dependent results)."""
    s = np.asarray([src] if isinstance(src, (int, np.integer)) else list(src), np.int64)
    d = np.asarray([dst] if isinstance(dst, (int, np.integer)) else list(dst), np.int64)
    if s.shape != d.shape:
        raise ValueError(f"copy_pages: {s.size} source pages, {d.size} destination pages")
    if set(s.tolist()) & set(d.tolist()):
        raise ValueError("copy_pages: a page is both a source and a destination")
    return s, d


def _numpy_zeros(shape, dtype):
    return np.zeros(shape, np.float32)


class HostCaches:
    """One host array per (cache, layer): numpy float32 by default (the reference executor, the
    CPU runner), or whatever factory(shape, dtype) makes (the interpreter: torch bf16 tensors).
    Any array type with numpy-style fancy-index assignment works for the copies."""

    def __init__(self, caches: dict, page_size: int, num_pages: int, num_slots: int = 0, factory=None):
        check(caches)
        self.caches, self.page_size, self.num_pages, self.num_slots = caches, page_size, num_pages, num_slots
        self.factory = factory or _numpy_zeros
        self.arrays = {(name, layer): self.factory(storage_shape(c, page_size, num_pages, num_slots), c["dtype"])
                       for name, c in caches.items() for layer in c["layers"]}

    def get(self, name: str, layer: int):
        try:
            return self.arrays[(name, layer)]
        except KeyError:
            if name not in self.caches:
                raise KeyError(f"no cache '{name}' (the plan declares {sorted(self.caches)})") from None
            raise KeyError(f"cache '{name}' has no layer {layer}") from None

    def _of_kind(self, kind):
        return [a for (n, _), a in self.arrays.items() if self.caches[n]["kind"] == kind]

    def copy_pages(self, src, dst):
        """Page src[i] -> page dst[i] in every paged cache and layer."""
        s, d = _pairs(src, dst)
        for a in self._of_kind("paged"):
            a[d] = a[s]

    def copy_slot(self, src: int, dst: int):
        if src == dst:
            return
        for a in self._of_kind("slot"):
            a[dst] = a[src]

    @property
    def block_bytes(self) -> int:
        """Bytes of one host block of this storage (a page of every paged cache and layer)."""
        return sum(a[0].nbytes for a in self._of_kind("paged"))

    def _paged_bytes(self) -> list:
        """Each paged (cache, layer) as uint8 [num_pages + 1, bytes of a page], in plan order."""
        out = []
        for a in self._of_kind("paged"):
            if not isinstance(a, np.ndarray):
                raise TypeError(f"host blocks need numpy cache storage, not {type(a).__name__}")
            out.append(a.reshape(a.shape[0], -1).view(np.uint8))
        return out

    def read_pages(self, pages, out: np.ndarray, rows):
        """Page pages[i] -> row rows[i] of out (uint8 [n, page_bytes]), as one host block each."""
        p, r = np.asarray(pages, np.int64), np.asarray(rows, np.int64)
        at = 0
        for a in self._paged_bytes():
            w = a.shape[1]
            out[r, at:at + w] = a[p]
            at += w
        assert at == out.shape[1], (at, out.shape)

    def write_pages(self, pages, blocks: np.ndarray, rows):
        """Row rows[i] of blocks (uint8 [n, page_bytes]) -> page pages[i]: read_pages' inverse."""
        p, r = np.asarray(pages, np.int64), np.asarray(rows, np.int64)
        at = 0
        for a in self._paged_bytes():
            w = a.shape[1]
            a[p] = blocks[r, at:at + w]
            at += w
        assert at == blocks.shape[1], (at, blocks.shape)

    def save_state(self, snapshots: "HostCaches", slot: int, snap: int):
        """Running slot `slot` -> snapshot `snap` of the pool `snapshots` (snapshot_decl's storage)."""
        for key, a in snapshots.arrays.items():
            a[snap, 0] = self.arrays[key][slot]

    def restore_state(self, snapshots: "HostCaches", snap: int, slot: int):
        """Snapshot `snap` -> running slot `slot`: save_state's inverse."""
        for key, a in snapshots.arrays.items():
            self.arrays[key][slot] = a[snap, 0]

    def grow(self, num_pages: int):
        """More pages (page contents kept at their ids; the padding page moves to the end)."""
        if num_pages <= self.num_pages:
            return
        old, n = self.arrays, self.num_pages
        self.__init__(self.caches, self.page_size, num_pages, self.num_slots, self.factory)
        for key, a in old.items():
            if self.caches[key[0]]["kind"] == "paged":
                self.arrays[key][:n] = a[:n]
            else:
                self.arrays[key][...] = a


class DeviceCaches:
    """All caches in one device allocation. ctx: the runtime's driver context (alloc, dtod,
    memset) or anything with the same methods; alloc overrides ctx.alloc (to track frees)."""

    def __init__(self, ctx, caches: dict, page_size: int, num_pages: int, num_slots: int = 0,
                 alloc=None, zero: bool = True):
        self.ctx = ctx
        self.layout = Layout(caches, page_size, num_pages, num_slots)
        self.num_pages, self.num_slots, self.page_size = num_pages, num_slots, page_size
        self.nbytes = self.layout.nbytes
        self.base = (alloc or ctx.alloc)(max(self.nbytes, 1))
        if zero and self.nbytes:
            ctx.memset(self.base, self.nbytes)

    def ptr(self, name: str, layer: int) -> int:
        return self.base + self.layout.region(name, layer).offset

    def region(self, name: str, layer: int) -> tuple[int, int]:
        """(device pointer, bytes) of one (cache, layer)'s storage."""
        r = self.layout.region(name, layer)
        return self.base + r.offset, r.nbytes

    def copy_pages(self, src, dst):
        """Page src[i] -> page dst[i] in every paged cache and layer (async, on the context's
        stream). Runs of consecutive ids on both sides are one copy each."""
        s, d = _pairs(src, dst)
        runs = []
        for a, b in zip(s.tolist(), d.tolist()):
            if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
                runs[-1][2] += 1
            else:
                runs.append([a, b, 1])
        for r in self.layout.of_kind("paged"):
            at = self.base + r.offset
            for a, b, n in runs:
                self.ctx.dtod(at + b * r.stride, at + a * r.stride, n * r.stride)

    def block_copies(self, pages, rows, row_bytes: int) -> list[tuple[int, int, int, int, int]]:
        """The 2D copies that move page pages[i] to / from row rows[i] of host blocks (rows
        row_bytes apart, one block each: the module docstring's order): (device address, offset
        in the host rows, bytes a page, pages, device pitch) a run of consecutive pages and rows
        per paged (cache, layer); the host side's pitch is row_bytes."""
        runs = []
        for a, b in zip(np.asarray(pages, np.int64).tolist(), np.asarray(rows, np.int64).tolist()):
            if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
                runs[-1][2] += 1
            else:
                runs.append([a, b, 1])
        if self.layout.block_bytes != row_bytes:
            raise ValueError(f"host blocks of {row_bytes} bytes, but a page is {self.layout.block_bytes} bytes")
        return [(self.base + offset + a * stride, b * row_bytes + at, stride, n, stride)
                for offset, stride, at in self.layout.block_regions() for a, b, n in runs]

    def _state_copies(self, snapshots: "DeviceCaches", slot: int, snap: int, to_snapshot: bool):
        for r in self.layout.of_kind("slot"):
            s = snapshots.layout.region(r.name, r.layer)
            assert s.stride == r.stride, (r, s)
            running, kept = self.base + r.offset + slot * r.stride, snapshots.base + s.offset + snap * s.stride
            self.ctx.dtod(*((kept, running) if to_snapshot else (running, kept)), r.stride)

    def save_state(self, snapshots: "DeviceCaches", slot: int, snap: int):
        """Running slot `slot` -> snapshot `snap` of `snapshots` (snapshot_decl's storage): one
        device-to-device copy a slot (cache, layer), on the context's stream (after the steps
        issued before it, before those issued after)."""
        self._state_copies(snapshots, slot, snap, True)

    def restore_state(self, snapshots: "DeviceCaches", snap: int, slot: int):
        """Snapshot `snap` -> running slot `slot`: save_state's inverse."""
        self._state_copies(snapshots, slot, snap, False)

    def copy_slot(self, src: int, dst: int):
        if src == dst:
            return
        for r in self.layout.of_kind("slot"):
            at = self.base + r.offset
            self.ctx.dtod(at + dst * r.stride, at + src * r.stride, r.stride)
