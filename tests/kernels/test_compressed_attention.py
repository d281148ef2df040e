"""compressed_attention's Triton kernel (codegen_templates/triton/compressed_attention.py.j2) under
the interpreter against the numpy reference (itself checked against transformers in
tests/test_deepseek_v4_attention.py): two steps over three sequences (new ones, then
continuations over cached tokens: the slot's partial block and the CSA overlap carried across),
head counts and dims not powers of two, pages of 8 against blocks of 4 (two entries a page) and 16
(an entry every other page), the indexer's choices with -1 holes. Every cache starts NaN, so a
read of anything not written shows; the kernel's caches after each step equal the reference's."""
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
STEPS = [[(0, 13, 0), (1, 6, 0), (2, 1, 0)], [(1, 7, 6), (0, 1, 13), (2, 16, 1)]]   # seq 2 completes an HCA block (m 16)


def i32(a):
    return torch.tensor(np.asarray(a), dtype=torch.int32)


# block_n 2: the window's keys and the 3 chosen entries each span several blocks of the loops
@pytest.mark.parametrize("rate,overlap,topk,block_n", [(4, True, 3, 2), pytest.param(16, False, None, None, marks=EXHAUSTIVE)],
                         ids=["csa", "hca"])
def test_compressed_attention_kernel(rate, overlap, topk, block_n):
    gen = np.random.default_rng(rate)
    H, D, R, window = 3, 24, 8, 5
    W = 2 * D if overlap else D
    attrs = dict(rate=rate, window=window, scale=None, cache="c", eps=1e-6, theta=160000.0, scaling=YARN,
                 rotary_dim=R, has_index=topk is not None)
    op = REGISTRY["compressed_attention"]
    types = [TensorType(s, "f32") for s in (("T", H, D), ("T", D), (H,), ("T", W), ("T", W), (rate, W), (D,))]
    if topk:
        types.append(TensorType(("T", topk), "i32"))
    decl = {n: dict(c, layers=[0], dtype="f32") for n, c in op.caches(types, attrs).items()}
    pages = SeqPages(decl, page_size=PAGE, num_pages=16, num_slots=4)
    for a in pages.storage.arrays.values():
        a[...] = np.nan
    k = render("compressed_attention", "compressed_attention",
               [(f"x{i}", t.shape, "f32") for i, t in enumerate(types[:7])] +
               ([("index", ["T", topk], "i32")] if topk else []),
               [("o", ["T", H, D], "f32")], attrs=attrs, phase="prefill", page_size=PAGE,
               caches={n: {kk: v for kk, v in c.items() if kk != "layers"} for n, c in decl.items()},
               tune={"BLOCK_N": block_n} if block_n else None)
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
        bind = {f"in:{i}": torch.from_numpy(np.ascontiguousarray(a)) for i, a in enumerate(args)}
        bind.update({f"cache:{n}": before[(n, 0)] for n in decl})
        bind.update({"out:0": out, "meta:seq_starts": i32(ctx.meta.seq_starts), "meta:context_lens":
                     i32(ctx.meta.context_lens), "meta:slot_mapping": i32(ctx.meta.slot_mapping),
                     "meta:block_tables": i32(ctx.meta.block_tables), "meta:max_pages": ctx.meta.block_tables.shape[1],
                     "meta:state_slots": i32(ctx.meta.state_slots)})
        run(k, bind, {"T": T, "B": ctx.B})
        assert not torch.isnan(out).any()
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)
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


def test_indexer_topk_kernel():
    """indexer_topk's kernel: the same two steps (blocks of 4 in pages of 8), 5 heads of 24 dims,
    the top 3 of the visible keys (fewer visible early: -1 after them): the same choices as the
    reference (as sets: the order among near-equal scores may differ by rounding), the same keys."""
    gen = np.random.default_rng(11)
    Hi, Di, R, rate, topk = 5, 24, 8, 4, 3
    attrs = dict(rate=rate, topk=topk, cache="ikv", eps=1e-6, theta=160000.0, scaling=YARN, rotary_dim=R)
    op = REGISTRY["indexer_topk"]
    types = [TensorType(s, "f32") for s in (("T", Hi, Di), ("T", Hi), ("T", 2 * Di), ("T", 2 * Di), (rate, 2 * Di), (Di,))]
    decl = {n: dict(c, layers=[0], dtype="f32") for n, c in op.caches(types, attrs).items()}
    pages = SeqPages(decl, page_size=PAGE, num_pages=16, num_slots=4)
    for a in pages.storage.arrays.values():
        a[...] = np.nan
    k = render("indexer_topk", "indexer_topk", [(f"x{i}", t.shape, "f32") for i, t in enumerate(types)],
               [("idx", ["T", topk], "i32")], attrs=attrs, phase="prefill", page_size=PAGE,
               caches={n: {kk: v for kk, v in c.items() if kk != "layers"} for n, c in decl.items()})
    bias = gen.standard_normal((rate, 2 * Di)).astype(np.float32)
    norm = (1 + 0.2 * gen.standard_normal(Di)).astype(np.float32)
    for step in STEPS:
        ctx = pages.context([Chunk(s, list(range(n)), c) for s, n, c in step])
        T = ctx.T
        args = [gen.standard_normal((T, Hi, Di)).astype(np.float32), gen.standard_normal((T, Hi)).astype(np.float32),
                gen.standard_normal((T, 2 * Di)).astype(np.float32), gen.standard_normal((T, 2 * Di)).astype(np.float32),
                bias, norm]
        before = {key: torch.from_numpy(a.copy()) for key, a in pages.storage.arrays.items()}
        want = op.reference(ctx, *args, **attrs)
        out = torch.full((T, topk), -7777, dtype=torch.int32)
        bind = {f"in:{i}": torch.from_numpy(np.ascontiguousarray(a)) for i, a in enumerate(args)}
        bind.update({f"cache:{n}": before[(n, 0)] for n in decl})
        bind.update({"out:0": out, "meta:seq_starts": i32(ctx.meta.seq_starts), "meta:context_lens":
                     i32(ctx.meta.context_lens), "meta:block_tables": i32(ctx.meta.block_tables),
                     "meta:max_pages": ctx.meta.block_tables.shape[1], "meta:state_slots": i32(ctx.meta.state_slots)})
        run(k, bind, {"T": T, "B": ctx.B})
        got = out.numpy()
        assert (got >= 0).sum() == (want >= 0).sum() and (got >= 0).sum() > T      # several chosen, holes too
        for t in range(T):
            assert set(got[t][got[t] >= 0]) == set(want[t][want[t] >= 0]), t
            assert (got[t] >= 0).tolist() == (want[t] >= 0).tolist(), t          # -1 only after the chosen
        np.testing.assert_allclose(np.nan_to_num(before[("ikv", 0)].numpy()),
                                   np.nan_to_num(pages.storage.arrays[("ikv", 0)]), rtol=1e-4, atol=1e-5)
