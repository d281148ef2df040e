"""DeepSeek-V4's compressed attention kernels under the interpreter against the numpy references
(themselves checked against transformers in tests/test_deepseek_v4_attention.py), as
split_compression lowers the spec's ops: compress_write (codegen_templates/triton/compress_write.py.j2:
the window's rows and each completed block's entry) and compress_carry (the step's rows into the
slot's partial blocks), then compressed_attention.py.j2 or indexer_topk.py.j2 over the caches they
wrote; all a program a token row. Three steps over three
sequences (new ones, then continuations over cached tokens: the slot's partial block and the CSA
overlap carried across), head counts and dims not powers of two, pages of 8 against blocks of 4
(two entries a page) and 16 (an entry every other page), the indexer's choices with -1 holes.
Every cache starts NaN, so a read of anything not written shows; the kernels' caches after each
step equal the reference's (the spec-level op's, compression included)."""
import numpy as np
import pytest
import torch

from infc.compiler.ir import TensorType
from infc.compiler.ops import REGISTRY
from infc.runtime.engine.step import Chunk
from infc.runtime.reference.executor import SeqPages
from tests.exhaustive import EXHAUSTIVE

from .harness import render, run

PAGE = 8
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32,
        "beta_slow": 1, "attention_factor": 1.0}
# seq 2 completes an HCA block (m 16); seq 0 reaches 6 CSA entries (two of the indexer's blocks of 4)
STEPS = [[(0, 13, 0), (1, 6, 0), (2, 1, 0)], [(1, 7, 6), (0, 1, 13), (2, 16, 1)], [(0, 11, 14), (1, 1, 13)]]


def i32(a):
    return torch.tensor(np.asarray(a), dtype=torch.int32)


def _meta(ctx):
    return {"meta:seq_starts": i32(ctx.meta.seq_starts), "meta:context_lens": i32(ctx.meta.context_lens),
            "meta:slot_mapping": i32(ctx.meta.slot_mapping), "meta:block_tables": i32(ctx.meta.block_tables),
            "meta:max_pages": ctx.meta.block_tables.shape[1], "meta:state_slots": i32(ctx.meta.state_slots)}


def _caches(op, types, attrs):
    return {n: dict(c, layers=[0], dtype="f32") for n, c in op.caches(types, attrs).items()}


def _pages(decl):
    pages = SeqPages(decl, page_size=PAGE, num_pages=16, num_slots=4)
    for a in pages.storage.arrays.values():
        a[...] = np.nan
    return pages


def _render(template, op, types, out, attrs, decl, tune=None):
    names = [(f"x{i}", t.shape, t.dtype) if t else ("cache", [], "f32", "marker") for i, t in enumerate(types)]
    return render(template, op, names, [out] if out else [], attrs=attrs, phase="prefill", page_size=PAGE,
                  caches={n: {kk: v for kk, v in c.items() if kk != "layers"} for n, c in decl.items()}, tune=tune)


def _writer(types, attrs, rows):
    """compress_write's and compress_carry's kernels for the compressor inputs types[:4] (and the
    window's rows), and a run of both over a step's bindings."""
    wattrs = {a: attrs[a] for a in ("rate", "cache", "eps", "theta", "scaling", "rotary_dim")}
    if rows:
        wattrs["has_rows"] = True
    decl = _caches(REGISTRY["compress_write"], types, wattrs)
    write = _render("compress_write", "compress_write", types, None, wattrs, decl, tune={"BLOCK_C": 8})   # 4 chunks of 24 + pad
    cattrs = {"rate": attrs["rate"], "cache": attrs["cache"], "overlap": types[0].shape[1] == 2 * types[3].shape[0]}
    ctypes = types[:3] + [None]
    cdecl = _caches(REGISTRY["compress_carry"], ctypes, cattrs)
    assert all(decl[n] == c for n, c in cdecl.items())          # the slot as the writer declares it
    carry = _render("compress_carry", "compress_carry", ctypes, None, cattrs, cdecl)

    def launch(bind, dims):
        run(write, bind, dims)
        run(carry, {k: v for k, v in bind.items() if k not in ("in:3", "in:4")}, dims)
    return launch, decl


def _check_caches(decl, before, pages, ctx):
    for n in decl:
        got, ref = before[(n, 0)].numpy(), pages.storage.arrays[(n, 0)]
        if decl[n]["kind"] == "slot":       # the rows of each sequence's last positions (the
            rows = got.shape[1]             # reference also zero-fills a new slot's others)
            for b, _, n_new, cached in ctx.seqs:
                s_ = int(ctx.meta.state_slots[b])
                for p_ in range(max(0, cached + n_new - rows), cached + n_new):
                    np.testing.assert_allclose(got[s_, p_ % rows], ref[s_, p_ % rows], rtol=1e-6, atol=1e-6)
            continue
        assert np.array_equal(np.isnan(got), np.isnan(ref)), n
        np.testing.assert_allclose(np.nan_to_num(got), np.nan_to_num(ref), rtol=1e-4, atol=1e-5, err_msg=n)


# block_n 2, block_h 2: the window's keys and the 3 chosen entries span several key blocks, the 3
# heads two head blocks (the second half empty)
@pytest.mark.parametrize("rate,overlap,topk", [(4, True, 3), pytest.param(16, False, None, marks=EXHAUSTIVE)],
                         ids=["csa", "hca"])
def test_compressed_attention_kernel(rate, overlap, topk):
    gen = np.random.default_rng(rate)
    H, D, R, window = 3, 24, 8, 5
    W = 2 * D if overlap else D
    attrs = dict(rate=rate, window=window, scale=None, cache="c", eps=1e-6, theta=160000.0, scaling=YARN,
                 rotary_dim=R, has_index=topk is not None)
    op = REGISTRY["compressed_attention"]
    types = [TensorType(s, "f32") for s in (("T", H, D), ("T", D), (H,), ("T", W), ("T", W), (rate, W), (D,))]
    if topk:
        types.append(TensorType(("T", topk), "i32"))
    decl = _caches(op, types, attrs)
    pages = _pages(decl)
    writer, wdecl = _writer(types[3:7] + [types[1]], attrs, rows=True)
    assert set(wdecl) == set(decl)
    rattrs = {a: attrs[a] for a in ("rate", "window", "scale", "cache")} | ({"has_index": True} if topk else {})
    rtypes = [types[0], None, types[2]] + types[7:]
    reader = _render("compressed_attention", "compressed_attention_cached", rtypes, ("o", ["T", H, D], "f32"), rattrs,
                     _caches(REGISTRY["compressed_attention_cached"], rtypes, rattrs), tune={"BLOCK_N": 2, "BLOCK_H": 2})
    sinks = gen.standard_normal(H).astype(np.float32)
    bias = gen.standard_normal((rate, W)).astype(np.float32)
    norm = (1 + 0.2 * gen.standard_normal(D)).astype(np.float32)
    for step in STEPS:
        ctx = pages.context([Chunk(s, list(range(n)), c) for s, n, c in step])
        T = ctx.T
        q, kv = gen.standard_normal((T, H, D)).astype(np.float32), gen.standard_normal((T, D)).astype(np.float32)
        ckv, cgate = gen.standard_normal((T, W)).astype(np.float32), gen.standard_normal((T, W)).astype(np.float32)
        args = [q, kv, sinks, ckv, cgate, bias, norm]
        if topk:
            index = np.full((T, topk), -1, np.int32)
            for b, start, n, cached in ctx.seqs:
                for i in range(n):
                    vis = (cached + i + 1) // rate
                    pick = gen.permutation(vis)[:topk - 1]             # at most topk - 1: a -1 hole
                    index[start + i, :len(pick)] = gen.permutation(pick)
            args.append(index)
        before = {key: torch.from_numpy(a.copy()) for key, a in pages.storage.arrays.items()}
        want = op.reference(ctx, *args, **attrs)
        out = torch.full((T, H, D), float("nan"))
        t_ = lambda a: torch.from_numpy(np.ascontiguousarray(a))    # noqa: E731
        caches = {f"cache:{n}": before[(n, 0)] for n in decl}
        writer({"in:0": t_(ckv), "in:1": t_(cgate), "in:2": t_(bias), "in:3": t_(norm), "in:4": t_(kv),
                     **caches, **_meta(ctx)}, {"T": T, "B": ctx.B})
        bind = {"in:0": t_(q), "in:2": t_(sinks), "out:0": out, **caches, **_meta(ctx)}
        if topk:
            bind["in:3"] = t_(index)
        run(reader, bind, {"T": T, "B": ctx.B})
        assert not torch.isnan(out).any()
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)
        _check_caches(decl, before, pages, ctx)


def _indexer(topk, block_n):
    Hi, Di, R, rate = 5, 24, 8, 4
    attrs = dict(rate=rate, topk=topk, cache="ikv", eps=1e-6, theta=160000.0, scaling=YARN, rotary_dim=R)
    op = REGISTRY["indexer_topk"]
    types = [TensorType(s, "f32") for s in (("T", Hi, Di), ("T", Hi), ("T", 2 * Di), ("T", 2 * Di), (rate, 2 * Di), (Di,))]
    decl = _caches(op, types, attrs)
    writer, _ = _writer(types[2:6], attrs, rows=False)
    rattrs = {a: attrs[a] for a in ("rate", "topk", "cache")}
    rtypes = [types[0], types[1], None]
    reader = _render("indexer_topk", "indexer_topk_cached", rtypes, ("idx", ["T", topk], "i32"), rattrs,
                     _caches(REGISTRY["indexer_topk_cached"], rtypes, rattrs), tune={"BLOCK_N": block_n})
    return op, attrs, decl, writer, reader


def _run_indexer(op, attrs, decl, writer, reader, pages, ctx, args):
    before = {key: torch.from_numpy(a.copy()) for key, a in pages.storage.arrays.items()}
    want = op.reference(ctx, *args, **attrs)
    out = torch.full((ctx.T, attrs["topk"]), -7777, dtype=torch.int32)
    t_ = lambda a: torch.from_numpy(np.ascontiguousarray(a))    # noqa: E731
    caches = {f"cache:{n}": before[(n, 0)] for n in decl}
    writer({f"in:{i}": t_(a) for i, a in enumerate(args[2:6])} | caches | _meta(ctx), {"T": ctx.T, "B": ctx.B})
    run(reader, {"in:0": t_(args[0]), "in:1": t_(args[1]), "out:0": out, **caches, **_meta(ctx)},
        {"T": ctx.T, "B": ctx.B})
    _check_caches(decl, before, pages, ctx)
    return out.numpy(), want


def test_indexer_topk_kernel():
    """indexer_topk's kernel: the steps above (blocks of 4 in pages of 8), 5 heads of 24 dims, the
    top 3 of the visible keys (fewer visible early: -1 after them), scored 2 at a time into blocks
    of 4 (two blocks for seq 0's 6 entries, the second partial): the reference's choices in its
    order (score descending), the same keys."""
    gen = np.random.default_rng(11)
    op, attrs, decl, writer, reader = _indexer(topk=3, block_n=2)
    pages = _pages(decl)
    Di, rate = 24, 4
    bias = gen.standard_normal((rate, 2 * Di)).astype(np.float32)
    norm = (1 + 0.2 * gen.standard_normal(Di)).astype(np.float32)
    holes = False
    for step in STEPS:
        ctx = pages.context([Chunk(s, list(range(n)), c) for s, n, c in step])
        T = ctx.T
        args = [gen.standard_normal((T, 5, Di)).astype(np.float32), gen.standard_normal((T, 5)).astype(np.float32),
                gen.standard_normal((T, 2 * Di)).astype(np.float32), gen.standard_normal((T, 2 * Di)).astype(np.float32),
                bias, norm]
        got, want = _run_indexer(op, attrs, decl, writer, reader, pages, ctx, args)
        assert (got >= 0).sum() > T                              # several chosen
        holes |= bool((got < 0).any())
        np.testing.assert_array_equal(got, want)
    assert holes                                                 # and -1 holes (early steps)


def test_indexer_topk_ties_go_to_the_lower_index():
    """Equal scores: every token's compressor rows alike and the queries zero on the rotated dims,
    so the entries after the first (block 0 has no overlap) score exactly alike; the reference's
    stable order keeps the lower index first, and so must the packed sort keys. One sequence of
    27 tokens: 6 entries, the top 5 (block of 8, scored 4 at a time)."""
    gen = np.random.default_rng(5)
    op, attrs, decl, writer, reader = _indexer(topk=5, block_n=4)
    pages = _pages(decl)
    Di, rate, T = 24, 4, 27
    ctx = pages.context([Chunk(0, list(range(T)), 0)])
    q = gen.standard_normal((T, 5, Di)).astype(np.float32)
    q[:, :, Di - 8:] = 0.0
    row = gen.standard_normal(2 * Di).astype(np.float32)
    args = [q, np.abs(gen.standard_normal((T, 5))).astype(np.float32), np.tile(row, (T, 1)),
            np.tile(gen.standard_normal(2 * Di).astype(np.float32), (T, 1)),
            np.zeros((rate, 2 * Di), np.float32), np.ones(Di, np.float32)]
    got, want = _run_indexer(op, attrs, decl, writer, reader, pages, ctx, args)
    last = want[T - 1]
    assert sorted(last[last > 0].tolist()) == last[last > 0].tolist() and len(last[last > 0]) >= 4   # ties, in index order
    np.testing.assert_array_equal(got, want)
