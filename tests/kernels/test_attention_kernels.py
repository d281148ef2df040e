"""qk_norm_rope_cache, attention_decode and attention_prefill under the interpreter, against the
numpy references (rms, rotate, write_cache + attend_cached through the reference executor's
StepContext).

Every case uses page size 16 and a shuffled, non-contiguous page assignment; pages no sequence
owns, the tails of last pages and the block-table entries past a sequence's pages are NaN (or
point at a NaN page), so a read of a surplus key or page shows up as NaN in the output. Context
lengths are not multiples of the page or tile sizes.
"""
import math

import numpy as np
import pytest
import torch

from infc.compiler.ops import REGISTRY
from infc.compiler.ops.rms_norm import rms
from infc.compiler.ops.rope import rotate
from infc.runtime.reference.executor import SeqChunk, StepContext

from .harness import poison, rand, rel_err, render, run

PS = 16
TOL = 1e-2
LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def kv_info(hkv, d):
    return {"layers": 1, "kv_heads": hkv, "head_dim": d, "dtype": "bf16", "max_len": 1 << 17, "page_size": PS}


def cdiv(a, b):
    return -(-a // b)


class Paged:
    """A paged KV cache for sequences given as (cached, q_len), keys written for all of each
    sequence's context_len = cached + q_len positions. Sequence 1 may share sequence 0's first
    `share` pages (a shared prefix: same physical pages, same contents)."""

    def __init__(self, gen, specs, hkv, d, share=0, extra_pages=3):
        self.specs, self.B = specs, len(specs)
        lens = [c + n for c, n in specs]
        n_pages = [cdiv(L, PS) for L in lens]
        own = [n - (share if i == 1 else 0) for i, n in enumerate(n_pages)]
        total = sum(own) + extra_pages
        perm = [int(p) for p in gen.permutation(total)]
        self.poison_page = perm.pop()                 # block-table padding points here (all NaN)
        self.pages = []
        for i, n in enumerate(own):
            mine = [perm.pop() for _ in range(n)]
            self.pages.append((self.pages[0][:share] if i == 1 else []) + mine)
        self.max_pages = max(n_pages) + 2
        bt = np.full((self.B, self.max_pages), self.poison_page, np.int32)
        for i, p in enumerate(self.pages):
            bt[i, :len(p)] = p
        self.block_tables = torch.from_numpy(bt)
        self.context_lens = torch.tensor(lens, dtype=torch.int32)
        starts = np.cumsum([0] + [n for _, n in specs]).astype(np.int32)
        self.seq_starts = torch.from_numpy(starts)
        self.T = int(starts[-1])
        self.k_cache = poison((total, PS, hkv, d))
        self.v_cache = poison((total, PS, hkv, d))
        kv = {}
        for i, L in enumerate(lens):
            K, V = rand((L, hkv, d), gen=gen), rand((L, hkv, d), gen=gen)
            if i == 1 and share:
                K[:share * PS], V[:share * PS] = kv[(0, 0)][0][:share * PS], kv[(0, 0)][1][:share * PS]
            kv[(0, i)] = (K, V)
            for j in range(L):
                page = self.pages[i][j // PS]
                self.k_cache[page, j % PS], self.v_cache[page, j % PS] = K[j], V[j]
        self.kv = {key: (K.float().numpy(), V.float().numpy()) for key, (K, V) in kv.items()}
        self.ctx = StepContext([SeqChunk(i, [0] * n, c) for i, (c, n) in enumerate(specs)], self.kv)

    def bindings(self):
        return {"kv:k": self.k_cache, "kv:v": self.v_cache, "meta:block_tables": self.block_tables,
                "meta:context_lens": self.context_lens, "meta:seq_starts": self.seq_starts,
                "meta:max_pages": self.max_pages}


# ---------------------------------------------------------------------------------------------
# qk_norm_rope_cache

def _slots(gen, starts_lens, n_pages):
    """Slot of each new token: logical pages mapped to distinct random physical pages."""
    perm = list(gen.permutation(n_pages))
    slots = []
    for start, n in starts_lens:
        phys = {}
        for p in range(start, start + n):
            if p // PS not in phys:
                phys[p // PS] = perm.pop()
            page = phys[p // PS]
            slots.append(page * PS + p % PS)
    return slots


@pytest.mark.parametrize("hq,hkv,d,q_norm,k_norm,scaling,tune,seqs", [
    (4, 2, 64, True, True, None, {"BLOCK_H": 2, "BLOCK_T": 4},
     [(0, 17), (70000, 3), (4090, 12)]),                                      # qwen3-like, long position
    (8, 2, 128, False, False, LLAMA3, {"BLOCK_H": 4, "BLOCK_T": 3},
     [(0, 5), (131000, 2), (8190, 4)]),                                       # llama3 scaling
    (2, 2, 64, True, False, LLAMA3, {"BLOCK_H": 8}, [(30, 1), (90000, 1)]),  # q|k heads in one tile
    (3, 1, 24, False, True, None, {}, [(1, 7)]),                             # head_dim not a power of 2
])
def test_qk_norm_rope_cache(hq, hkv, d, q_norm, k_norm, scaling, tune, seqs):
    gen = np.random.default_rng(hq * 100 + d)
    theta = 500000.0 if scaling else 1000000
    attrs = {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "eps": 1e-6, "theta": theta, "scaling": scaling,
             "q_norm": q_norm, "k_norm": k_norm}
    inputs = [("qkv", ["T", (hq + 2 * hkv) * d], "bf16")]
    inputs += [("q_norm", [d], "bf16", "weight")] * q_norm + [("k_norm", [d], "bf16", "weight")] * k_norm
    k = render("qk_norm_rope_cache", "qk_norm_rope_cache", inputs,
               [("q", ["T", hq, d], "bf16"), ("kv", [], "bf16", "kv")], attrs=attrs,
               kv=kv_info(hkv, d), tune=tune)
    # one extra padding row (slot -1) after the sequences: it must not touch the cache
    T = sum(n for _, n in seqs) + 1
    GUARD = 5          # rows past T in every per-token buffer: a program must not touch them
    qkv = rand((T + GUARD, (hq + 2 * hkv) * d), gen=gen, scale=3.0)
    norms = [1 + 0.3 * rand((d,), gen=gen).float() for _ in range(q_norm + k_norm)]
    norms = [w.to(torch.bfloat16) for w in norms]
    n_pages = sum(cdiv(n, PS) + 1 for _, n in seqs) + 4
    slots = _slots(gen, seqs, n_pages) + [-1]
    free = [s for s in range(n_pages * PS) if s not in set(slots)]
    positions = [p for start, n in seqs for p in range(start, start + n)] + [5]
    k_cache, v_cache = poison((n_pages, PS, hkv, d)), poison((n_pages, PS, hkv, d))
    q_full = poison((T + GUARD, hq, d))
    q = q_full[:T]
    b = {"in:0": qkv[:T], "out:0": q, "kv:k": k_cache, "kv:v": v_cache,
         "meta:positions": torch.tensor(positions + [7] * GUARD, dtype=torch.int32)[:T],
         "meta:slot_mapping": torch.tensor(slots + free[:GUARD], dtype=torch.int32)[:T]}
    for i, w in enumerate(norms):
        b[f"in:{i + 1}"] = w
    run(k, b, {"T": T, "B": len(seqs) + 1})
    assert torch.isnan(q_full[T:].float()).all(), "wrote q rows past T"
    qkv = qkv[:T]

    # reference: the fused op's own numpy reference (rms + rotate + write_cache)
    ctx = StepContext([SeqChunk(i, [0] * n, s) for i, (s, n) in enumerate(seqs + [(5, 1)])], {})
    want_q, _ = REGISTRY["qk_norm_rope_cache"].reference(ctx, qkv.float().numpy(),
                                                          *[w.float().numpy() for w in norms], **attrs)
    assert rel_err(q.float().numpy(), want_q) <= TOL
    want_k = np.concatenate([ctx.kv[(0, i)][0] for i in range(len(seqs))])
    want_v = np.concatenate([ctx.kv[(0, i)][1] for i in range(len(seqs))])
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    got_slots = torch.tensor(slots[:-1])
    assert rel_err(flat_k[got_slots].float().numpy(), want_k) <= TOL
    assert np.array_equal(flat_v[got_slots].float().numpy(), want_v)              # v copied unchanged
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[got_slots] = False
    assert torch.isnan(flat_k[untouched].float()).all() and torch.isnan(flat_v[untouched].float()).all()


def test_rope_positions_beyond_4096_are_not_aliased():
    """A position table of 4096 would wrap; the rotation at 70000 must differ from 70000 % 4096."""
    gen = np.random.default_rng(7)
    d, hq = 64, 2
    attrs = {"q_heads": hq, "kv_heads": 1, "head_dim": d, "eps": 0.0, "theta": 10000.0, "scaling": None,
             "q_norm": False, "k_norm": False}
    k = render("qk_norm_rope_cache", "qk_norm_rope_cache", [("qkv", ["T", (hq + 2) * d], "bf16")],
               [("q", ["T", hq, d], "bf16"), ("kv", [], "bf16", "kv")], attrs=attrs, kv=kv_info(1, d))
    row = rand((1, (hq + 2) * d), gen=gen)
    qkv = row.repeat(2, 1)
    positions = torch.tensor([70000, 70000 % 4096], dtype=torch.int32)
    q = poison((2, hq, d))
    kc, vc = poison((2, PS, 1, d)), poison((2, PS, 1, d))
    run(k, {"in:0": qkv, "out:0": q, "kv:k": kc, "kv:v": vc, "meta:positions": positions,
            "meta:slot_mapping": torch.tensor([0, 1], dtype=torch.int32)}, {"T": 2, "B": 2})
    want = rotate(qkv[:, :hq * d].float().numpy().reshape(2, hq, d), positions.numpy(), 10000.0, None)
    assert rel_err(q[0].float().numpy(), want[0]) <= TOL
    assert rel_err(q[0].float().numpy(), want[1]) > 0.1


# ---------------------------------------------------------------------------------------------
# attention

def _attention(template, phase, page, hq, d, tune, dims):
    gen = np.random.default_rng(1)
    q = rand((page.T, hq, d), gen=gen)
    k = render(template, "attention_cached", [("q", ["T", hq, d], "bf16"), ("kv", [], "bf16", "kv")],
               [("o", ["T", hq, d], "bf16")], phase=phase, kv=kv_info(page.k_cache.shape[2], d), tune=tune)
    o_full = poison((page.T + 3, hq, d))             # rows past T must stay unwritten
    o = o_full[:page.T]
    run(k, {"in:0": q, "out:0": o, **page.bindings()}, dims)
    assert torch.isnan(o_full[page.T:].float()).all(), "wrote output rows past T"
    want = REGISTRY["attention_cached"].reference(page.ctx, q.float().numpy(), None)
    return rel_err(o.float().numpy(), want)


DECODE_CASES = [
    # hq, hkv, d, context lens, tune
    (2, 2, 64, [1, 15, 17, 70], {"NUM_SPLITS": 4, "BLOCK_N": 16}),                   # G = 1
    (4, 2, 128, [33, 600], {"NUM_SPLITS": 8, "BLOCK_N": 32, "MERGE_CHUNK": 2}),      # long context
    (8, 2, 64, [70, 5, 600], {"NUM_SPLITS": 16, "BLOCK_N": 16}),                     # G = 4, 16 splits
    (8, 2, 64, [600, 3, 129], {"NUM_SPLITS": 16, "BLOCK_N": 32, "TARGET_CTAS": 8}),  # fewer splits (ns=2)
    (4, 1, 64, [40, 200], {}),                                                       # default tune
]


@pytest.mark.parametrize("hq,hkv,d,lens,tune", DECODE_CASES)
def test_attention_decode(hq, hkv, d, lens, tune):
    gen = np.random.default_rng(len(lens) * 10 + d)
    page = Paged(gen, [(L - 1, 1) for L in lens], hkv, d)
    B = len(lens)
    assert _attention("attention_decode", "decode", page, hq, d, tune, {"T": B, "B": B}) <= TOL


def test_attention_decode_shared_prefix():
    gen = np.random.default_rng(5)
    page = Paged(gen, [(99, 1), (140, 1), (20, 1)], 2, 64, share=6)
    assert page.pages[0][:6] == page.pages[1][:6]
    assert _attention("attention_decode", "decode", page, 4, 64, {"NUM_SPLITS": 4, "BLOCK_N": 32},
                      {"T": 3, "B": 3}) <= TOL


PREFILL_CASES = [
    # hq, hkv, d, (cached, q_len) per sequence, share, tune
    (4, 2, 64, [(0, 17), (0, 1), (0, 70)], 0, {"BLOCK_M": 16, "BLOCK_N": 16}),           # prefill
    (8, 2, 128, [(32, 15), (48, 20)], 2, {"BLOCK_M": 32, "BLOCK_N": 32}),                # shared prefix
    (2, 2, 64, [(40, 1), (0, 23), (100, 1), (17, 9)], 0, {"BLOCK_M": 16, "BLOCK_N": 32}),  # mixed, G = 1
    # mixed, G = 4; prefixes 14 and 31 put the first masked tile's start right at a block's first key
    (8, 2, 64, [(69, 1), (0, 15), (14, 20), (0, 33), (5, 1), (31, 5)], 0,
     {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_B": 2}),
    (4, 2, 64, [(16, 40), (0, 3)], 0, {}),                                               # default tune
]


@pytest.mark.parametrize("hq,hkv,d,specs,share,tune", PREFILL_CASES)
def test_attention_prefill(hq, hkv, d, specs, share, tune):
    gen = np.random.default_rng(len(specs) * 10 + d + share)
    page = Paged(gen, specs, hkv, d, share=share)
    if share:
        assert page.pages[0][:share] == page.pages[1][:share]
    dims = {"T": page.T, "B": page.B}
    assert _attention("attention_prefill", "mixed", page, hq, d, tune, dims) <= TOL
