"""`infc tune run`: the GPU half of tuning. cuda-python and numpy only: never torch, never the
compiler; everything comes from the folder `infc tune prepare` wrote (manifest.json, bin/).

For each (template, shape key) of the manifest, at each of its step sizes:
  * allocate the launch's tensors: activations with random bf16/f32 contents (i32 inputs within
    their bound), weights and the caches the launch names (one layer of each, laid out by
    compiler/contract/caches.py) in rotating copies that together pass 3x the L2
    size, so every timed launch streams its weights (and KV) from HBM as a decode step does,
    while activations stay in L2 as they do between launches; step metadata from
    runtime/step.build_step (valid block tables, slots, positions); zeroed scratch per candidate;
  * run every candidate once from a reset state and compare its outputs with the baseline's
    ({} = what the build renders today) within bf16 tolerance: a candidate that disagrees, does
    not load, or leaves its counter scratch non-zero is dropped, never chosen;
  * time each survivor as a CUDA Graph of `inner` launches (cycling through the copies), the
    median over `reps` event-timed replays, interleaved over the candidates in rounds so clock
    drift hits them all alike.
The per-candidate score is the geometric mean over step sizes. A shape gets a table entry only
when its best candidate beats the baseline by more than `threshold` (3 %); otherwise its entry
is removed. The pure parts (step_metadata, agree, select_best, merge_table) import no driver.
"""
import copy as _copy
import datetime
import json
import math
from pathlib import Path

import numpy as np

from infc.compiler.contract import caches
from infc.compiler.contract.bind import (CACHE_MARKER, LORA_SET_WORDS, LORA_SETS, KernelInfo, Resolver, eval_int,
                                         grid as launch_grid, scratch_sizes)
from infc.compiler.contract.schema import TUNE_MANIFEST_VERSION as MANIFEST_VERSION, nbytes as dtype_nbytes
from ..engine.step import Chunk, build_step

THRESHOLD = 0.03          # store an entry only when it beats the baseline by more than this
ROUNDS = 5                # timing rounds, interleaved over candidates
COLD_FACTOR = 3           # rotating weight/KV copies total at least this many L2 sizes
TARGET_GRAPH_US = 500.0   # a timed graph replay lasts about this long
_PERIOD = 1_048_573       # random data repeats with a prime period: never aligned with rows
REPO = Path(__file__).resolve().parents[2]


# --- pure helpers ----------------------------------------------------------------------------

def step_metadata(phase: str, T: int, B: int, context_len: int, page_size: int, seed: int = 0):
    """Valid metadata for a step of T tokens over B sequences: (arrays, num_pages, max_pages).

    decode (and wide, narrow): B sequences of one new token each, KV lengths context_len, context_len - 3, ...;
    prefill: T tokens split over B sequences with no cached prefix; short: the same after
    context_len cached tokens each (a prefix hit, what a short step's split attention serves);
    mixed: B - 1 decode rows and
    one chunk of T - B + 1 tokens after context_len cached ones. Pages are a random permutation
    of 0 .. num_pages-1 (scattered, as after some serving); page num_pages is the spare that
    pads block-table rows (cache storage holds num_pages + 1 pages, as in the runner)."""
    if phase in ("decode", "wide", "narrow", "verify"):   # wide: a decode step of many sequences; narrow,
                                                          # verify: of a few
        if T != B:
            raise ValueError(f"a decode step has T == B (got T={T}, B={B})")
        chunks = [(max(context_len - 3 * b, 1) - 1, 1) for b in range(B)]
    elif phase in ("prefill", "short"):     # short: few tokens (compiler/tune.py SHORT_DIMS)
        if T < B:
            raise ValueError(f"a prefill step of {T} tokens cannot cover {B} sequences")
        cached = context_len if phase == "short" else 0
        chunks = [(cached, T // B + (1 if b < T % B else 0)) for b in range(B)]
    elif phase == "mixed":
        if T < B:
            raise ValueError(f"a mixed step of {T} tokens cannot cover {B} sequences")
        chunks = [(max(context_len - 3 * b, 1) - 1, 1) for b in range(B - 1)] + [(context_len, T - B + 1)]
    else:
        raise ValueError(f"unknown phase '{phase}'")
    need = [-(-(s + n) // page_size) for s, n in chunks]
    num_pages = sum(need)
    perm = np.random.default_rng(seed).permutation(num_pages)
    pages, at = {}, 0
    for i, n in enumerate(need):
        pages[i] = [int(p) for p in perm[at: at + n]]
        at += n
    width = max(need) + 1
    m = build_step([Chunk(i, [0] * n, s) for i, (s, n) in enumerate(chunks)], pages.__getitem__,
                   page_size, width)
    bt = m.block_tables.copy()
    for i, n in enumerate(need):
        bt[i, n:] = num_pages                       # the spare page, as the runner pads
    arrays = {"positions": m.positions, "seq_starts": m.seq_starts, "context_lens": m.context_lens,
              "last_rows": m.last_rows, "slot_mapping": m.slot_mapping, "block_tables": bt,
              "state_slots": np.arange(B),          # slot caches: one slot per sequence (B of them)
              # a LoRA build's rows all take adapter slot 1 (random tables, as every weight here),
              # so a merged LoRA site times its shrink and delta, not slot 0's early exits
              "lora_slots": np.ones(T)}
    return {k: np.ascontiguousarray(v, np.int32) for k, v in arrays.items()}, num_pages, width


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even."""
    b = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(u: np.ndarray) -> np.ndarray:
    return (np.asarray(u, np.uint16).astype(np.uint32) << 16).view(np.float32)


def host_data(t: dict, shape: list[int], seed: int) -> np.ndarray:
    """Random contents for one tensor: activations N(0, 1), matrices N(0, 1/K) so outputs stay
    O(1), 1-D weights (norm scales) 1 + N(0, 0.01); i32 inputs uniform in [0, t["high"])."""
    n = int(np.prod(shape)) if shape else 1
    rng = np.random.default_rng(seed)
    if t["dtype"] in QUANT_CODES:
        return quant_codes(t["dtype"], shape, rng)
    if t["dtype"] == "i32":
        return rng.integers(0, max(int(t.get("high", 1)), 1), n, dtype=np.int32)
    base = rng.standard_normal(min(n, _PERIOD)).astype(np.float32)
    if t["kind"] == "weight" and len(shape) == 1:
        base = 1.0 + 0.1 * base
    elif t["kind"] == "weight":
        base = base / np.float32(math.sqrt(shape[-1]))
    if t["dtype"] == "bf16":
        base = to_bf16(base)
    elif t["dtype"] == "f16":
        base = base.astype(np.float16)
    elif t["dtype"] != "f32":
        raise ValueError(f"tensor '{t['name']}': no random fill for dtype {t['dtype']}")
    return np.resize(base, n)


# a quantized weight's code dtypes (compiler/quant/scheme.py): random codes, no fp8 NaN
QUANT_CODES = ("f8e4m3", "u8", "u4", "e2m1")


def quant_codes(dtype: str, shape: list[int], rng) -> np.ndarray:
    """Random codes of a quantized weight, as stored (u4 / e2m1: two a byte along the last dim):
    every byte value but e4m3's NaNs (0x7f, 0xff), which a real checkpoint never holds."""
    n = dtype_nbytes(dtype, shape)
    raw = rng.integers(0, 256, n, dtype=np.uint8)
    if dtype == "f8e4m3":
        raw[(raw & 0x7f) == 0x7f] &= 0xfe
    return raw


def moe_grouping(ids: np.ndarray, experts: int) -> dict:
    """moe_align's outputs for routing ids [T, k] (compiler/ops/moe.py): rows i32 [E, T] (expert
    e's tokens first, in token order) and counts i32 [E]; what the grouped MoE kernels read.
    The op's own reference computes them (its one home)."""
    from infc.compiler.ops.moe import align
    rows, counts = align(None, ids, experts)
    return {"rows": rows, "counts": counts}


def as_float(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "f8e4m3":                   # an FP8 KV cache's codes
        from infc.compiler.contract.safetensors_io import E4M3
        return E4M3[raw.view(np.uint8)]
    if dtype == "bf16":
        return from_bf16(raw.view(np.uint16))
    if dtype == "f16":
        return raw.view(np.float16).astype(np.float32)
    if dtype == "f32":
        return raw.view(np.float32)
    return raw.view(np.int32).astype(np.float64)


def agree(got: np.ndarray, want: np.ndarray, rel_l2: float = 1e-2, rel_max: float = 5e-2):
    """bf16 tolerance against the baseline: relative L2 error <= rel_l2 and no element off by more
    than rel_max of the reference's largest |value|; any non-finite value fails. -> (ok, why)."""
    g = np.asarray(got, np.float64).reshape(-1)
    w = np.asarray(want, np.float64).reshape(-1)
    if g.shape != w.shape:
        return False, f"shape {g.shape} != {w.shape}"
    if not np.isfinite(g).all():
        return False, "non-finite output (unwritten or bad math)"
    d = np.abs(g - w)
    scale = max(float(np.abs(w).max(initial=0.0)), 1e-30)
    err = float(np.linalg.norm(g - w) / max(float(np.linalg.norm(w)), 1e-30))
    worst = float(d.max(initial=0.0)) / scale
    ok = err <= rel_l2 and worst <= rel_max
    return ok, f"rel L2 {err:.1e}, max {worst:.1e}"


def select_best(results: dict, default, threshold: float = THRESHOLD):
    """results: candidate -> {"us": float | None, "ok": bool}. The fastest correct candidate when
    it beats the default by more than `threshold`, else the default (None if the default itself
    has no time: nothing can be chosen)."""
    base = results.get(default, {})
    if not base.get("ok") or base.get("us") is None:
        return None
    good = [(r["us"], str(c), c) for c, r in results.items() if r.get("ok") and r.get("us") is not None]
    us, _, best = min(good)
    return best if us < base["us"] * (1.0 - threshold) else default


def merge_table(table: dict, template: str, key: str, tune: dict | None, base_tune: dict | None = None) -> dict:
    """A copy of the tuning table with `key`'s entry set to `tune` ({} or None: removed, the
    shape keeps the template's default). base_tune is what the candidates were rendered on top
    of: it must still be the table's template default, or the timings no longer apply."""
    out = _copy.deepcopy(table)
    tpls = out.setdefault("templates", {})
    entry = tpls.setdefault(template, {})
    if base_tune is not None and dict(entry.get("default", {})) != dict(base_tune):
        raise ValueError(f"tuning table's default for '{template}' is {entry.get('default', {})}, "
                         f"but the candidates were prepared on {base_tune}: run `infc tune prepare` again")
    if tune:
        entry[key] = dict(tune)
    else:
        entry.pop(key, None)
    if not entry:
        tpls.pop(template)
    return out


def dump_table(table: dict) -> str:
    return json.dumps(table, indent=1, sort_keys=True) + "\n"


def geomean(xs) -> float:
    return float(math.exp(sum(math.log(x) for x in xs) / len(xs)))


def _fmt_tune(t: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(t.items())) or "{}"


# --- the GPU side ----------------------------------------------------------------------------

def _is_marker(t: dict) -> bool:
    return t["name"] == CACHE_MARKER or t["kind"] in ("cache", "kv")


class _Case:
    """One manifest entry at one step size on the device: its tensors, metadata, caches."""

    def __init__(self, drv, ctx, manifest: dict, entry: dict, dims: dict, l2_bytes: int, seed: int):
        self.drv, self.ctx, self.entry, self.dims = drv, ctx, entry, dims
        self.allocs = []
        page_size = manifest["page_size"]
        arrays, num_pages, self.width = step_metadata(entry["phase"], dims["T"], dims["B"],
                                                      manifest["context_len"], page_size, seed)
        self.meta = {}
        for name, a in arrays.items():
            self.meta[name] = self._alloc(a.nbytes)
            ctx.htod(self.meta[name], a)
            ctx.sync()
        tensors = {}
        for role, ts in (("in", entry["inputs"]), ("out", entry["outputs"])):
            for t in ts:
                if _is_marker(t):
                    continue
                rec = tensors.setdefault(t["name"], {"t": t, "roles": set()})
                rec["roles"].add(role)
        self.tensors = tensors
        # the caches the launch names (and any a candidate addresses), layer 0 of each
        names = list(entry.get("caches", []))
        for c in entry["candidates"]:
            for _, _, src in c["meta"]["params"]:
                if src.startswith("cache:") and src[6:] not in names:
                    names.append(src[6:])
        self.cache_decl = caches.select(manifest["caches"], names, layers=[0])
        self.cache_written = any(_is_marker(t) for t in entry["outputs"])
        self.cache_bytes = caches.Layout(self.cache_decl, page_size, num_pages,
                                         dims["B"]).nbytes if names else 0
        for rec in tensors.values():
            t = rec["t"]
            rec["shape"] = [eval_int(d, dims) for d in t["shape"]]
            rec["nbytes"] = dtype_nbytes(t["dtype"], rec["shape"])
        cold = sum(r["nbytes"] for r in tensors.values() if r["t"]["kind"] == "weight") + self.cache_bytes
        self.copies = 1 if cold == 0 else max(1, min(64, -(-COLD_FACTOR * l2_bytes // cold)))
        self.init = {}
        for i, (name, rec) in enumerate(sorted(tensors.items())):
            t = rec["t"]
            if t["kind"] == "weight":
                host = host_data(t, rec["shape"], seed + 1 + i)
                rec["ptrs"] = [self._alloc(rec["nbytes"]) for _ in range(self.copies)]
                ctx.htod(rec["ptrs"][0], host)
                ctx.sync()
                for p in rec["ptrs"][1:]:
                    ctx.dtod(p, rec["ptrs"][0], rec["nbytes"])
                continue
            rec["ptrs"] = [self._alloc(rec["nbytes"])]
            if "in" in rec["roles"]:
                self.init[name] = host_data(t, rec["shape"], seed + 1 + i)
        for name, rec in tensors.items():
            if "derive" in rec["t"] and name in self.init:
                d = rec["t"]["derive"]
                self.init[name] = moe_grouping(self.init[d["ids"]].reshape(tensors[d["ids"]]["shape"]),
                                               d["experts"])[d["moe_align"]].reshape(-1)
        self.caches, self.cache_init = [], {}
        if names:
            self.caches = [caches.DeviceCaches(ctx, self.cache_decl, page_size, num_pages, dims["B"],
                                               alloc=self._alloc, zero=False) for _ in range(self.copies)]
            for j, r in enumerate(self.caches[0].layout.regions.values()):
                t = {"name": f"cache:{r.name}", "kind": "cache", "dtype": r.dtype}
                self.cache_init[r.name] = host_data(t, [int(np.prod(r.shape))], seed + 101 + j)
            for dev in self.caches:
                for name, host in self.cache_init.items():
                    ctx.htod(dev.ptr(name, 0), host)
                    ctx.sync()
        ctx.sync()

    def _alloc(self, nbytes: int) -> int:
        p = self.ctx.alloc(nbytes)
        self.allocs.append(p)
        return p

    def reset(self):
        """Inputs back to their initial contents, outputs poisoned (0xFF: NaN / -1)."""
        keep = []
        for name, rec in self.tensors.items():
            if rec["t"]["kind"] == "weight":
                continue
            if name in self.init:
                keep.append(self.ctx.htod(rec["ptrs"][0], self.init[name]))
            else:
                self.ctx.memset(rec["ptrs"][0], rec["nbytes"], 0xFF)
        if self.caches and self.cache_written:
            for name, host in self.cache_init.items():
                keep.append(self.ctx.htod(self.caches[0].ptr(name, 0), host))
        self.ctx.sync()

    def outputs(self) -> dict:
        out = {}
        for name, rec in self.tensors.items():
            if "out" not in rec["roles"]:
                continue
            raw = np.empty(rec["nbytes"], np.uint8)
            self.ctx.dtoh(raw, rec["ptrs"][0])
            self.ctx.sync()
            out[name] = as_float(raw, rec["t"]["dtype"])
        if self.caches and self.cache_written:
            for name in self.cache_init:
                ptr, nbytes = self.caches[0].region(name, 0)
                raw = np.empty(nbytes, np.uint8)
                self.ctx.dtoh(raw, ptr)
                self.ctx.sync()
                out[f"cache:{name}"] = as_float(raw, self.cache_decl[name]["dtype"])
        return out

    def values(self, meta: dict, scratch: dict, copy: int, kid: str) -> list:
        def tensor(name, layer):
            ptrs = self.tensors[name]["ptrs"]
            return ptrs[copy % len(ptrs)]

        resolver = Resolver(
            tensor=tensor, cache=lambda name, layer: self.caches[copy % self.copies].ptr(name, 0),
            meta=lambda n: self.width if n == "max_pages" else self.meta[n],
            scratch=lambda k, n: scratch[n], dim=self.dims.__getitem__,
            scale=lambda name, layer: 1.0)          # an FP8 cache's scale: the timing is the same
        # layer: the copy's index, so launches back to back differ in it as a program's do (a LoRA
        # site's sets of sync words, gemv.py.j2 LORA_SETS); the tensors and caches ignore it here
        return resolver.values(meta, [t["name"] for t in self.entry["inputs"]],
                               [t["name"] for t in self.entry["outputs"]], layer=copy, kernel=kid)

    def free(self):
        self.ctx.sync()
        for p in self.allocs:
            self.ctx.free(p)
        self.allocs = []


class _Cand:
    """One candidate kernel bound to a _Case: loaded, its scratch zeroed, args packed per copy."""

    def __init__(self, drv, case: _Case, cand: dict, bin_dir: Path):
        self.drv, self.case, self.cand = drv, case, cand
        ctx, meta = case.ctx, cand["meta"]
        kid = cand["kernel"]
        k = KernelInfo(kid, meta, info=json.loads((bin_dir / f"{kid}.json").read_text()))
        self.block, self.shared = k.block, k.shared
        self.fn = drv.Module((bin_dir / f"{kid}.cubin").read_bytes()).function(k.info["name"], self.shared)
        self.grid = launch_grid(meta, case.dims)
        if self.grid[0] * self.grid[1] * self.grid[2] == 0:
            raise RuntimeError(f"empty grid {self.grid} at {case.dims}")
        self.scratch, self.scratch_bytes = {}, {}
        for name, nbytes in scratch_sizes(meta, case.dims).items():
            self.scratch_bytes[name] = max(nbytes, 4)
            self.scratch[name] = case._alloc(self.scratch_bytes[name])
            ctx.memset(self.scratch[name], self.scratch_bytes[name], 0)
        gscratch = case._alloc(k.global_scratch_bytes(case.dims)) if k.global_scratch else 0
        # at least two argument sets where the layer is a parameter (values: launches back to back
        # at different layers)
        n_args = max(case.copies, 2 if any(src == "layer:" for _, _, src in meta["params"]) else 1)
        self.args = [drv.PackedArgs(*k.arg_lists(case.values(meta, self.scratch, c, kid), gscratch))
                     for c in range(n_args)]
        self.samples: list[float] = []
        self.issued = 0
        self.graph = None
        self.e0, self.e1 = ctx.event(), ctx.event()
        ctx.sync()

    def launch(self, copy: int | None = None):
        """Launch with argument set `copy`, or the one after the last launch's: launches follow
        each other through the sets (a LoRA site's layer differs back to back, as in a program)."""
        i = self.issued if copy is None else copy
        self.drv.launch(self.case.ctx, self.fn, self.grid, self.block, self.shared, self.args[i % len(self.args)])
        self.issued = i + 1

    def graph_launches(self, inner: int) -> int:
        """inner rounded up to whole rounds of the argument sets: a graph replayed after itself
        then never launches one set twice in a row."""
        return -(-inner // len(self.args)) * len(self.args)

    def counters_clear(self) -> bool:
        """Scratch counters must be left zero (the kernel's contract: graphs replay it); a LoRA
        site's sets of sync words all but the last launch's (gemv.py.j2 LORA_SETS)."""
        for name, p in self.scratch.items():
            if "counter" not in name and name != LORA_SETS:
                continue
            raw = np.empty(self.scratch_bytes[name], np.uint8)
            self.case.ctx.dtoh(raw, p)
            self.case.ctx.sync()
            if name == LORA_SETS:
                n = 4 * LORA_SET_WORDS           # bytes a set
                if np.count_nonzero(raw[: len(raw) // n * n].reshape(-1, n).any(axis=1)) > 1:
                    return False
            elif raw.any():
                return False
        return True

    def warm(self, n: int) -> float:
        """n eager launches; returns a rough per-launch time (us) to size the timed graph."""
        self.e0.record()
        for _ in range(n):
            self.launch()
        self.e1.record()
        return self.e1.ms_since(self.e0) * 1e3 / max(n, 1)

    def capture(self, inner: int):
        self.inner = inner
        self.graph = self.drv.Graph(self.case.ctx, lambda: [self.launch() for _ in range(inner)])
        self.graph.launch()                 # one untimed replay
        self.case.ctx.sync()

    def sample(self, n: int):
        for _ in range(n):
            self.e0.record()
            self.graph.launch()
            self.e1.record()
            self.samples.append(self.e1.ms_since(self.e0) * 1e3 / self.inner)


def _l2_bytes(ctx) -> int:
    if getattr(ctx, "l2_bytes", None):
        return int(ctx.l2_bytes)
    from cuda.bindings import driver as cu
    from .driver import check
    return int(check(cu.cuDeviceGetAttribute(
        cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, ctx.device), "cuDeviceGetAttribute(L2)"))


def bench_entry(drv, ctx, manifest: dict, entry: dict, bin_dir: Path, reps: int, warmup: int,
                l2: int, log=print) -> dict:
    """Time every candidate of one entry at each of its step sizes.
    -> {kernel id: {"tune", "label", "ok", "why", "us" (geomean), "us_by_dims"}}."""
    res = {c["kernel"]: {"tune": c["tune"], "label": c["label"], "ok": True, "why": "",
                         "us": None, "us_by_dims": {}} for c in entry["candidates"]}
    default = entry["candidates"][0]["kernel"]
    for di, dims in enumerate(entry["dims"]):
        dkey = f"T={dims['T']},B={dims['B']}"
        case = _Case(drv, ctx, manifest, entry, dims, l2, seed=1000 * di)
        try:
            ref, timed = None, []
            for c in entry["candidates"]:
                r = res[c["kernel"]]
                if not r["ok"]:
                    continue
                try:
                    k = _Cand(drv, case, c, bin_dir)
                    case.reset()
                    k.launch(0)
                    ctx.sync()
                    outs = case.outputs()
                    if not k.counters_clear():
                        raise RuntimeError("counter scratch left non-zero")
                except (RuntimeError, OSError, ValueError, KeyError) as e:   # CudaError: RuntimeError
                    r.update(ok=False, why=f"{dkey}: {type(e).__name__}: {e}"[:300])
                    if c["kernel"] == default:
                        return res
                    continue
                if c["kernel"] == default:
                    bad = [n for n, a in outs.items() if not np.isfinite(a).all()]
                    if bad:
                        r.update(ok=False, why=f"{dkey}: baseline wrote non-finite values to {bad}")
                        return res
                    ref = outs
                else:
                    for n, a in outs.items():
                        ok, why = agree(a, ref[n])
                        if not ok:
                            r.update(ok=False, why=f"{dkey}: {n}: {why}")
                            break
                    if not r["ok"]:
                        continue
                est = k.warm(max(warmup, case.copies))
                inner = int(min(256, max(case.copies, math.ceil(TARGET_GRAPH_US / max(est, 0.5)))))
                k.capture(k.graph_launches(inner))
                timed.append(k)
            per_round = max(1, reps // ROUNDS)
            for _ in range(ROUNDS):
                for k in timed:
                    k.sample(per_round)
            for k in timed:
                r = res[k.cand["kernel"]]
                if not k.counters_clear():
                    r.update(ok=False, why=f"{dkey}: counter scratch non-zero after timing")
                    continue
                r["us_by_dims"][dkey] = float(np.median(k.samples))
        finally:
            case.free()
    for r in res.values():
        if r["ok"] and len(r["us_by_dims"]) == len(entry["dims"]):
            r["us"] = geomean(r["us_by_dims"].values())
        elif r["ok"]:
            r.update(ok=False, why=r["why"] or "not timed")
    return res


def run(dir, write=None, reps: int = 50, warmup: int = 10, threshold: float = THRESHOLD,
        results_dir=None, any_gpu: bool = False, templates=None, driver=None, log=print) -> dict:
    """Time the prepared candidates on this GPU, write the results file and the tuning table."""
    import importlib
    log = log or (lambda *a: None)
    drv = driver or importlib.import_module(".driver", __package__)
    d = Path(dir)
    try:
        manifest = json.loads((d / "manifest.json").read_text())
    except FileNotFoundError:
        raise ValueError(f"{d}: no manifest.json (run `infc tune prepare` first)") from None
    if manifest.get("version") != MANIFEST_VERSION:
        raise ValueError(f"{d}: manifest version {manifest.get('version')}, this infc reads "
                         f"{MANIFEST_VERSION}: run `infc tune prepare` again")
    if not manifest.get("compiled"):
        raise ValueError(f"{d}: prepared with --no-compile; there are no cubins to time")
    ctx = drv.Context()
    tag = manifest["gpu"]
    if tag.lower() not in ctx.name.lower() and not any_gpu:
        raise ValueError(f"this GPU is '{ctx.name}', the manifest is for the {tag} table "
                         f"(--any-gpu to time it here anyway)")
    l2 = _l2_bytes(ctx)
    log(f"infc tune run: {manifest['model']} on {ctx.name} (L2 {l2 / 2**20:.0f} MiB), "
        f"{len(manifest['entries'])} shape keys, reps {reps}")
    table_path = Path(write) if write else d / f"{tag}.json"
    start = REPO / "codegen_templates" / "tuning" / f"{tag}.json"
    src = table_path if table_path.exists() else start
    table = json.loads(src.read_text()) if src.exists() else {"gpu": tag, "templates": {}}
    if table.get("gpu", tag) != tag:
        raise ValueError(f"{table_path} is the table of '{table.get('gpu')}', not {tag}")

    from infc.records import commit, save
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    now = commit()
    note = (f"filled by `infc tune run` on {ctx.name}, {stamp}, commit "
            f"{now if now != 'unknown' else manifest.get('commit', 'unknown')}")
    data = {"gpu": ctx.name, "commit": now, "prepared_at_commit": manifest.get("commit"),
            "date": stamp, "model": manifest["model"], "table": tag, "threshold": threshold,
            "reps": reps, "rounds": ROUNDS, "context_len": manifest["context_len"],
            "dims": manifest["dims"], "l2_bytes": l2,
            "method": (f"per candidate: a CUDA Graph of N launches cycling through weight/KV copies "
                       f"totalling >= {COLD_FACTOR}x L2 (weights stream from HBM, activations stay in "
                       f"L2); median over reps event-timed replays / N, interleaved over candidates "
                       f"in {ROUNDS} rounds; geometric mean over step sizes; outputs checked against "
                       f"the baseline within bf16 tolerance"),
            "note": manifest.get("note"), "entries": []}

    def write_out():
        # after every shape: a run cut short still leaves a valid table and its measurements
        table["note"] = note
        table_path.parent.mkdir(parents=True, exist_ok=True)
        table_path.write_text(dump_table(table))
        return save("tune", data, results_dir)

    rows = []
    for entry in manifest["entries"]:
        if templates and entry["template"] not in templates:
            continue
        res = bench_entry(drv, ctx, manifest, entry, d / "bin", reps, warmup, l2, log)
        default = entry["candidates"][0]["kernel"]
        chosen = select_best(res, default, threshold)
        base_us = res[default]["us"]
        rec = {"template": entry["template"], "shape_key": entry["shape_key"], "phase": entry["phase"],
               "launches_per_step": entry["launches_per_step"], "dims": entry["dims"],
               "default_us": base_us, "candidates": [dict(r, kernel=k) for k, r in res.items()],
               "skipped_at_prepare": entry.get("skipped", [])}
        if chosen is None:
            rec.update(best_us=None, best_tune=None, stored=False, error=res[default]["why"])
            rows.append((entry, None, None, "baseline failed: " + res[default]["why"][:60]))
        else:
            best_us, best = min((r["us"], k) for k, r in res.items() if r["ok"] and r["us"] is not None)
            tune = res[chosen]["tune"] if chosen != default else {}
            rec.update(best_us=best_us, best_kernel=best, best_tune=res[best]["tune"],
                       chosen_kernel=chosen, stored=bool(tune), stored_tune=tune)
            table = merge_table(table, entry["template"], entry["shape_key"], tune, entry["base_tune"])
            rows.append((entry, base_us, best_us,
                         _fmt_tune(res[best]["tune"]) + ("" if tune else "  (kept default)")))
        data["entries"].append(rec)
        path = write_out()
        b = f"{base_us:.2f}" if base_us is not None else "-"
        log(f"  {entry['template']} {entry['shape_key']}: default {b} us, {rows[-1][3]}")
    path = write_out()
    log("")
    log(f"{'template':<18} {'shape key':<50} {'default us':>10} {'best us':>9}  best tune")
    for entry, base_us, best_us, text in rows:
        b = f"{base_us:10.2f}" if base_us is not None else f"{'-':>10}"
        s = f"{best_us:9.2f}" if best_us is not None else f"{'-':>9}"
        log(f"{entry['template']:<18} {entry['shape_key']:<50} {b} {s}  {text}")
    saved = {}
    for rec in data["entries"]:
        if rec.get("stored"):
            chosen_us = next(c["us"] for c in rec["candidates"] if c["kernel"] == rec["chosen_kernel"])
            saved[rec["phase"]] = saved.get(rec["phase"], 0.0) + \
                (rec["default_us"] - chosen_us) * rec["launches_per_step"]
    for phase, us in sorted(saved.items()):
        log(f"{phase}: the stored entries save about {us:.1f} us per step at the timed sizes")
    log(f"\nwrote {table_path} and {path}")
    return {"table": table, "table_path": str(table_path), "results_path": str(path),
            "entries": data["entries"]}
