"""compiler/contract/caches.py: the one module that knows cache layouts (docs/architecture.md, contract 10).

Part 1 checks that nothing else computes one: every Python source under compiler/, runtime/,
infc/, bench/, server/ and tests/ (but caches.py and this file) is parsed, and these are errors:
  * arithmetic that mixes cache geometry (kv_heads, head_dim) with storage sizes (page_size,
    num_pages, layers, itemsize, DTYPE_BYTES, ...), or that works on a layout's own quantities
    (page_bytes, kv_layer_bytes, ...): a hand-made bytes-per-page or per-token formula or
    region offset, as the runners, benches and tuner each had before;
  * reading the plan/1 `kv_cache` section, or a cache entry's geometry straight out of a
    `["caches"][name]["shape" | "layers"]` chain;
  * a plan/1 kernel parameter source "kv:k" / "kv:v" (now "cache:NAME").
What it cannot see: a formula split over several statements through variables with other names.
The rules are themselves tested on the old code they replaced (test_the_rules_catch_...).

Part 2 tests caches.py: sizes, budgets, the device layout, host storage (numpy and torch) and the
page / slot copies, whose device version must move the same bytes as the host one.
"""
import ast
from pathlib import Path

import numpy as np
import pytest

from infc.compiler.contract import caches as C

from fake_cuda import FakeContext

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("compiler", "runtime", "infc", "bench", "server", "tests")
ALLOWED = {"compiler/contract/caches.py", "tests/test_cache_layout.py"}
# a cache's geometry: with a storage size in one expression, it is a layout formula
GEOMETRY = {"kv_heads", "head_dim", "num_key_value_heads"}
SIZES = {"page_size", "num_pages", "num_slots", "layers", "itemsize", "element_size", "DTYPE_BYTES",
         "nbytes"}
# quantities that only a layout has: any arithmetic on them is addressing storage by hand
DERIVED = {"page_bytes", "kv_bytes", "kv_layer_bytes", "kv_layers"}


def _terms(node) -> set:
    """Names, attributes and string keys an expression mentions; a called function's own name
    is not data (caches.page_bytes(decl, ps) is using the layout, not making one)."""
    out = set()
    funcs = {id(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)}
    for n in ast.walk(node):
        if id(n) in funcs:
            continue
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            out.add(n.value)
    return out


def _key(sub: ast.Subscript):
    s = sub.slice
    return s.value if isinstance(s, ast.Constant) and isinstance(s.value, str) else None


def violations(source: str) -> list[tuple[int, str]]:
    tree = ast.parse(source)
    inner = {id(c) for n in ast.walk(tree) if isinstance(n, ast.BinOp) for c in (n.left, n.right)}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.BinOp) and id(n) not in inner:         # a whole arithmetic expression
            t = _terms(n)
            if (t & GEOMETRY and t & SIZES) or t & DERIVED:
                why = ", ".join(sorted(t & (GEOMETRY | SIZES | DERIVED)))
                out.append((n.lineno, f"cache layout arithmetic ({why})"))
        if isinstance(n, ast.Subscript) and _key(n) == "kv_cache":
            out.append((n.lineno, 'reads the plan/1 section ["kv_cache"]'))
        if (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "get"
                and n.args and isinstance(n.args[0], ast.Constant) and n.args[0].value == "kv_cache"):
            out.append((n.lineno, 'reads the plan/1 section .get("kv_cache")'))
        if (isinstance(n, ast.Subscript) and _key(n) in ("shape", "layers") and isinstance(n.value, ast.Subscript)
                and isinstance(n.value.value, ast.Subscript) and _key(n.value.value) == "caches"):
            out.append((n.lineno, f'reads a cache entry\'s ["{_key(n)}"] to size it'))
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in ("kv:k", "kv:v"):
            out.append((n.lineno, f"plan/1 parameter source {n.value!r} (now cache:NAME)"))
    return out


def _sources():
    for root in ROOTS:
        for p in sorted((REPO / root).rglob("*.py")):
            rel = p.relative_to(REPO).as_posix()
            if rel not in ALLOWED and "__pycache__" not in rel:
                yield rel, p.read_text()


def test_no_module_but_caches_py_computes_a_cache_layout():
    bad = [f"{rel}:{line}: {why}" for rel, text in _sources() for line, why in violations(text)]
    assert not bad, "cache layouts belong to compiler/contract/caches.py:\n" + "\n".join(bad)


@pytest.mark.parametrize("code", [
    # what the runners, benches and the tuner computed before caches.py (plan/1)
    'kv = plan["kv_cache"]',
    'kv = plan.get("kv_cache", {})',
    'b = 2 * kv["layers"] * page_size * kv["kv_heads"] * kv["head_dim"] * 4',
    'page_bytes = self.page_size * kv["kv_heads"] * kv["head_dim"] * DTYPE_BYTES[kv["dtype"]]',
    'n = budget // (2 * self.kv_layers * page_bytes) - 1',
    'kv_per_token = 2 * kv["layers"] * kv["kv_heads"] * kv["head_dim"] * 2',
    'shape = plan["caches"]["k"]["shape"]',
    'bindings = {"kv:k": k_cache}',
    'p = self.kv + (2 * layer + 1) * self.kv_layer_bytes',
])
def test_the_rules_catch_the_layouts_they_replaced(code):
    assert violations(code), code


@pytest.mark.parametrize("code", [
    # addressing inside the page-id space (the block manager's), not a storage layout
    'slot = pages[p // page_size] * page_size + p % page_size',
    'n_pages = -(-tokens // page_size)',
    'cache[slots // ps, slots % ps] = x',
    'qkv_width = (q_heads + 2 * kv_heads) * head_dim',
    'pages = C.pages_for_budget(plan["caches"], page_size, budget)',
    'floor = weights + C.page_bytes(decl, 1) * context_len',
    'p = "cache:k"',
])
def test_the_rules_let_addressing_through(code):
    assert not violations(code), code


# -- caches.py ---------------------------------------------------------------------------------

DECL = {
    "k": {"kind": "paged", "shape": [2, 8], "dtype": "bf16", "layers": [0, 1, 3]},
    "v": {"kind": "paged", "shape": [2, 8], "dtype": "bf16", "layers": [0, 1, 3]},
    "conv": {"kind": "slot", "shape": [3, 5], "dtype": "f32", "layers": [2]},
}
PS = 4


def test_sizes():
    assert C.page_bytes(DECL, PS) == 2 * 3 * PS * 16 * 2          # k and v, 3 layers, bf16
    assert C.page_bytes(DECL, PS, itemsize=4) == 2 * 3 * PS * 16 * 4
    assert C.slot_bytes(DECL) == 15 * 4
    assert C.token_bytes(DECL) == 2 * 3 * 16 * 2
    assert C.storage_bytes(DECL, PS, 10, 2) == 11 * C.page_bytes(DECL, PS) + 3 * 15 * 4
    assert C.storage_shape(DECL["k"], PS, 10) == (11, PS, 2, 8)
    assert C.storage_shape(DECL["conv"], PS, 10, 6) == (7, 3, 5)


@pytest.mark.parametrize("budget", [10_000, 123_457, 1 << 20])
def test_pages_for_budget_is_the_most_that_fits(budget):
    n = C.pages_for_budget(DECL, PS, budget, num_slots=4)
    assert C.Layout(DECL, PS, n, 4).nbytes <= budget                  # aligned device regions too
    assert budget < C.storage_bytes(DECL, PS, n + 1, 4) + 7 * C.ALIGN   # one more page would not fit
    assert C.pages_for_budget({"s": DECL["conv"]}, PS, budget) == 0   # nothing paged: no pages


def test_layout_regions_are_aligned_disjoint_and_complete():
    lay = C.Layout(DECL, PS, num_pages=7, num_slots=3)
    regions = sorted(lay.regions.values(), key=lambda r: r.offset)
    assert [(r.name, r.layer) for r in regions] == [("k", 0), ("k", 1), ("k", 3), ("v", 0), ("v", 1),
                                                   ("v", 3), ("conv", 2)]
    for a, b in zip(regions, regions[1:]):
        assert a.offset % C.ALIGN == 0 and a.offset + a.nbytes <= b.offset
    assert lay.nbytes >= regions[-1].offset + regions[-1].nbytes
    k = lay.region("k", 3)
    assert k.shape == (8, PS, 2, 8) and k.stride == PS * 16 * 2 and k.nbytes == 8 * k.stride
    assert lay.region("conv", 2).stride == 60
    with pytest.raises(KeyError, match="no layer 2"):
        lay.region("k", 2)
    with pytest.raises(KeyError, match="no cache 'q'"):
        lay.region("q", 0)


@pytest.mark.parametrize("bad,match", [
    ({"kind": "ring"}, "kind"), ({"dtype": "fp8"}, "dtype"), ({"shape": [0, 8]}, "shape"),
    ({"layers": [1, 1]}, "layers")])
def test_bad_declarations_fail(bad, match):
    with pytest.raises(ValueError, match=match):
        C.check({"k": dict(DECL["k"], **bad)})
    with pytest.raises(ValueError, match="infc.plan/2"):
        C.of_plan({"kv_cache": {}})


def _filled(factory=None, num_pages=6, num_slots=3, seed=0):
    host = C.HostCaches(DECL, PS, num_pages, num_slots, factory)
    rng = np.random.default_rng(seed)
    for a in host.arrays.values():
        a[...] = rng.standard_normal(a.shape)
    return host


def test_host_storage_shapes_and_copies():
    host = _filled()
    assert host.get("k", 3).shape == (7, PS, 2, 8) and host.get("k", 3).dtype == np.float32
    assert host.get("conv", 2).shape == (4, 3, 5)
    before = {k: a.copy() for k, a in host.arrays.items()}
    host.copy_pages([4, 5], [0, 2])
    for (name, layer), a in host.arrays.items():
        b = before[(name, layer)]
        if name == "conv":
            assert (a == b).all()
            continue
        assert (a[0] == b[4]).all() and (a[2] == b[5]).all()
        assert (a[[1, 3, 4, 5, 6]] == b[[1, 3, 4, 5, 6]]).all()
    host.copy_slot(1, 3)
    assert (host.get("conv", 2)[3] == before[("conv", 2)][1]).all()
    with pytest.raises(ValueError, match="both a source"):
        host.copy_pages([1, 2], [2, 3])
    with pytest.raises(ValueError, match="destination"):
        host.copy_pages([1, 2], [3])
    with pytest.raises(KeyError, match="no layer 0"):
        host.get("conv", 0)


def test_host_storage_grows_in_place():
    host = _filled(num_pages=3)
    k = host.get("k", 1).copy()
    host.grow(8)
    assert host.get("k", 1).shape == (9, PS, 2, 8) and host.num_pages == 8
    assert (host.get("k", 1)[:3] == k[:3]).all()


def test_torch_storage_through_a_factory():
    torch = pytest.importorskip("torch")
    dt = {"bf16": torch.bfloat16, "f32": torch.float32}
    host = C.HostCaches(DECL, PS, 5, 2, factory=lambda shape, d: torch.full(shape, float("nan"), dtype=dt[d]))
    k = host.get("k", 0)
    assert tuple(k.shape) == (6, PS, 2, 8) and k.dtype == torch.bfloat16
    k[1] = 1.5
    host.copy_pages([1], [4])
    assert (k[4] == 1.5).all() and torch.isnan(k[3]).all()


NATIVE = {"bf16": np.uint16, "f32": np.float32}


def test_device_copies_move_the_same_bytes_as_the_host_ones():
    ctx = FakeContext()                                   # tests/fake_cuda.py
    dev = C.DeviceCaches(ctx, DECL, PS, num_pages=12, num_slots=4)
    assert ctx.read(dev.base, dev.nbytes) == bytes(dev.nbytes)                  # zeroed
    host = C.HostCaches(DECL, PS, 12, 4, factory=lambda shape, d: np.zeros(shape, NATIVE[d]))
    rng = np.random.default_rng(1)
    for (name, layer), a in host.arrays.items():
        a.view(np.uint8)[...] = rng.integers(0, 256, a.nbytes, dtype=np.uint8).reshape(a.view(np.uint8).shape)
        ptr, n = dev.region(name, layer)
        assert n == a.nbytes and ptr == dev.ptr(name, layer)
        ctx.view(ptr, n)[:] = a.reshape(-1).view(np.uint8)

    src, dst = [3, 4, 5, 9, 0], [6, 7, 8, 1, 11]         # a run of three, then single pages
    host.copy_pages(src, dst)
    ctx.num_copies = 0
    dev.copy_pages(src, dst)
    assert ctx.num_copies == 3 * 6                           # runs [3..5]->[6..8], 9->1, 0->11; 6 regions
    host.copy_slot(2, 0)
    dev.copy_slot(2, 0)
    for (name, layer), a in host.arrays.items():
        ptr, n = dev.region(name, layer)
        assert ctx.read(ptr, n) == a.tobytes(), (name, layer)


def test_reference_context_reads_and_writes_through_the_contract():
    """ctx.cache(name) is this layer's float32 storage; paged write = flat[slot_mapping[row]]."""
    from infc.runtime.reference.executor import SeqPages
    from infc.runtime.engine.step import Chunk
    pages = SeqPages({"k": DECL["k"]}, page_size=PS, num_pages=2)
    ctx = pages.context([Chunk(0, [1] * 3, 0), Chunk(1, [1] * 6, 0)], layer=3)
    assert ctx.page_size == PS and pages.storage.num_pages >= 3             # grown on demand
    new = np.arange(9 * 16, dtype=np.float32).reshape(9, 2, 8)
    cache = ctx.cache("k")
    cache.reshape(-1, 2, 8)[ctx.meta.slot_mapping] = new
    b, first, n, cached = ctx.seqs[1]
    used = ctx.meta["block_tables"][b, : -(-int(ctx.meta.context_lens[b]) // PS)]
    assert (cache[used].reshape(-1, 2, 8)[: cached + n] == new[first:first + n]).all()
    assert ctx.cache("k") is pages.storage.get("k", 3)
