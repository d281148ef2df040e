"""The narrow phase's merged attention launch (compiler/passes/merge_prologues.py):
qk_norm_rope_cache of the new token inside attention_decode, under the interpreter. Against the
two kernels run one after the other: the same output bits and the same K/V written at the token's
slot (the interpreter's sums do not depend on the tile layout), and against the two ops' numpy
references. GQA groups of 1, 4 and 8, head dims not a power of two, partial rotary, llama3 and
YaRN scaling, norms on and off, several splits (the merge), a sliding window with a softcap, and
attention sinks (GPT-OSS: the launch's last input, after the cache)."""
import numpy as np
import pytest
import torch

from infc.compiler.ops import REGISTRY

from exhaustive import EXHAUSTIVE

from .harness import poison, rand, rel_err, render, run
from .test_attention_kernels import LLAMA3, PS, TOL, YARN, Paged, kv_caches

# hq, hkv, d, context lens (the new token is each one's last key), qk attrs, tune, attention attrs
CASES = [
    (8, 2, 64, [40, 300], dict(q_norm=True, k_norm=True), {"NUM_SPLITS": 4, "BLOCK_N": 16}, {}),
    (2, 2, 64, [17], dict(q_norm=False, k_norm=False, scaling=LLAMA3), {}, {}),
    (4, 2, 64, [70, 5], dict(q_norm=True, k_norm=True, scaling=YARN, rotary_dim=32),
     {"NUM_SPLITS": 8, "BLOCK_N": 16}, {}),
    (6, 2, 96, [77], dict(q_norm=False, k_norm=True), {"NUM_SPLITS": 2, "BLOCK_N": 32}, {}),
    (8, 1, 64, [600], dict(q_norm=True, k_norm=True), {"NUM_SPLITS": 8, "BLOCK_N": 32}, {}),
    (2, 1, 128, [150], dict(q_norm=False, k_norm=False), {"NUM_SPLITS": 2, "BLOCK_N": 16},
     {"softcap": 50.0, "window": 48, "scale": 0.1}),
    (8, 2, 64, [40, 300], dict(q_norm=False, k_norm=False, scaling=YARN), {"NUM_SPLITS": 4, "BLOCK_N": 16},
     {"window": 37, "sinks": True}),                                         # GPT-OSS-like
]


@pytest.mark.parametrize("hq,hkv,d,lens,qk,tune,extra", CASES)
def test_merged_attention_decode(hq, hkv, d, lens, qk, tune, extra, gate=0):
    """gate: columns after [q | k | v] in each row (Qwen3.5's output gate), never read."""
    gen = np.random.default_rng(hq * 31 + d + len(lens))
    B = len(lens)
    qk_attrs = {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "eps": 1e-6,
                "theta": 500000.0 if qk.get("scaling") else 1000000, "scaling": qk.get("scaling"),
                "rotary_dim": qk.get("rotary_dim"), "q_norm": qk["q_norm"], "k_norm": qk["k_norm"]}
    attn_attrs = {"kv_heads": hkv, "scale": extra.get("scale"), "window": extra.get("window"),
                  "softcap": extra.get("softcap")}
    sink_in, sinks = [], ()
    if extra.get("sinks"):
        attn_attrs["has_sinks"] = True
        sink_in = [("sinks", [hq], "f32", "weight")]
        sinks = (torch.from_numpy(gen.standard_normal(hq).astype(np.float32) * 3),)
    page = Paged(gen, [(L - 1, 1) for L in lens], hkv, d)
    slots = [page.pages[b][(L - 1) // PS] * PS + (L - 1) % PS for b, L in enumerate(lens)]
    for s in slots:                           # the new token's key and value: the launch writes them
        page.k_cache.view(-1, hkv, d)[s] = float("nan")
        page.v_cache.view(-1, hkv, d)[s] = float("nan")
    qkv = rand((B, (hq + 2 * hkv) * d + gate), gen=gen, scale=3.0)
    qkv[:, (hq + 2 * hkv) * d:] = float("nan")
    norms = [(1 + 0.3 * rand((d,), gen=gen).float()).to(torch.bfloat16) for _ in range(qk["q_norm"] + qk["k_norm"])]
    meta = {"meta:positions": torch.tensor([L - 1 for L in lens], dtype=torch.int32),
            "meta:slot_mapping": torch.tensor(slots, dtype=torch.int32)}
    qk_in = [("qkv", ["T", (hq + 2 * hkv) * d + gate], "bf16")]
    qk_in += [("q_norm", [d], "bf16", "weight")] * qk["q_norm"] + [("k_norm", [d], "bf16", "weight")] * qk["k_norm"]
    norm_b = {f"in:{i + 1}": w for i, w in enumerate(norms)}
    dims = {"T": B, "B": B}

    # the two kernels, one after the other, on a copy of the caches
    caches = {"cache:k": page.k_cache.clone(), "cache:v": page.v_cache.clone()}
    unmerged = page.bindings() | caches
    k1 = render("qk_norm_rope_cache", "qk_norm_rope_cache", qk_in, [("q", ["T", hq, d], "bf16"), ("cache", [], "", "cache")],
                attrs=qk_attrs, caches=kv_caches(hkv, d))
    q = poison((B, hq, d))
    run(k1, {"in:0": qkv, "out:0": q, **norm_b, **meta, **caches}, dims)
    k2 = render("attention_decode", "attention_cached", [("q", ["T", hq, d], "bf16"), ("cache", [], "", "cache")] + sink_in,
                [("o", ["T", hq, d], "bf16")], attrs=attn_attrs, caches=kv_caches(hkv, d), tune=tune)
    o_two = poison((B, hq, d))
    run(k2, {"in:0": q, "out:0": o_two, **unmerged, **({"in:2": sinks[0]} if sinks else {})}, dims)

    # the merged launch: inputs [qkv, norms..., cache], outputs [cache, o]
    prologue = {"op": "qk_norm_rope_cache", "inputs": len(qk_in), "output": 0, "value": "q", "writes": 1,
                "attrs": qk_attrs}
    k = render("attention_decode", "attention_cached", qk_in + [("cache", [], "", "cache")] + sink_in,
               [("cache", [], "", "cache"), ("o", ["T", hq, d], "bf16")], attrs=attn_attrs,
               caches=kv_caches(hkv, d), tune=tune, prologue=prologue, narrow=True)
    o = poison((B, hq, d))
    sink_b = {f"in:{len(qk_in) + 1}": sinks[0]} if sinks else {}
    scratch = run(k, {"in:0": qkv, **norm_b, "out:1": o, **meta, **sink_b, **page.bindings()}, dims)
    assert torch.equal(o, o_two)
    bits = lambda t: t.view(torch.int16)                             # noqa: E731 (NaN pages too)
    assert torch.equal(bits(page.k_cache), bits(caches["cache:k"]))
    assert torch.equal(bits(page.v_cache), bits(caches["cache:v"]))
    assert not any(torch.isnan(page.k_cache.view(-1, hkv, d)[s]).any() for s in slots)
    assert all(int(c) == 0 for c in scratch["counter"][:B * hkv])          # the split counters reset

    # and the references: qk_norm_rope_cache (writes the float32 caches), then attention
    ctx = page.ctx
    ctx.meta.slot_mapping = np.asarray(slots, np.int64)
    ctx.positions = np.asarray([L - 1 for L in lens], np.int64)
    want_q, _ = REGISTRY["qk_norm_rope_cache"].reference(ctx, qkv.float().numpy(), *[w.float().numpy() for w in norms],
                                                          **qk_attrs)
    want = REGISTRY["attention_cached"].reference(ctx, want_q, None, *[t.numpy() for t in sinks], **attn_attrs)
    assert rel_err(o.float().numpy(), want) <= TOL


@pytest.mark.parametrize("case", [0, 2])
def test_merged_attention_decode_reads_q_k_v_of_a_wider_row(case):
    """The merged prologue on rows of [q | k | v | gate] (Qwen3.5): the same as on [q | k | v]."""
    hq, hkv, d, lens, qk, tune, extra = CASES[case]
    test_merged_attention_decode(hq, hkv, d, lens, qk, tune, extra, gate=hq * d)


def test_the_merged_attention_needs_a_narrow_step():
    from infc.compiler.codegen.render import TemplateError
    qk_attrs = {"q_heads": 4, "kv_heads": 2, "head_dim": 64, "eps": 1e-6, "theta": 1e6, "scaling": None,
                "rotary_dim": None, "q_norm": False, "k_norm": False}
    prologue = {"op": "qk_norm_rope_cache", "inputs": 1, "output": 0, "value": "q", "writes": 1, "attrs": qk_attrs}
    with pytest.raises(TemplateError, match="narrow_step"):
        render("attention_decode", "attention_cached", [("qkv", ["T", 512], "bf16"), ("cache", [], "", "cache")],
               [("cache", [], "", "cache"), ("o", ["T", 4, 64], "bf16")],
               attrs={"kv_heads": 2, "scale": None, "window": None, "softcap": None}, caches=kv_caches(2, 64),
               prologue=prologue)


# A speculative verify step (runtime/engine/speculative/): sequence i's n new tokens after c cached
# are n one-token rows at c .. c + n - 1 sharing its pages, so a row reads keys that its
# sequence's earlier rows write in the same launch. specs (c, n) per sequence; rows run in reverse
# token order (the interpreter runs programs in grid order, so every row's programs run before
# those of the rows that write its step's keys): the merged launch against
# qk_norm_rope_cache then attention_decode on the same rows (bit for bit, K/V included) and
# against the references (the mixed step: causal among each sequence's new tokens).
# the fast one: 4 new keys across a split's edge (14, 15 | 16, 17) and a plain decode row; the rest
# (q_len up to 8, GQA 1 / 4 / 8, llama3 / YaRN / partial rotary, window + softcap, sinks) with
# --exhaustive
VERIFY = [
    (4, 1, 64, [(14, 4), (9, 1)], dict(q_norm=True, k_norm=True), {"NUM_SPLITS": 2, "BLOCK_N": 16}, {}),
    pytest.param(8, 2, 64, [(30, 5), (300, 1)], dict(q_norm=True, k_norm=True), {"NUM_SPLITS": 4, "BLOCK_N": 16}, {},
                 marks=EXHAUSTIVE),
    pytest.param(2, 2, 64, [(21, 8)], dict(q_norm=False, k_norm=True, scaling=LLAMA3), {"NUM_SPLITS": 2, "BLOCK_N": 16},
                 {}, marks=EXHAUSTIVE),
    pytest.param(8, 1, 64, [(600, 8)], dict(q_norm=True, k_norm=True), {"NUM_SPLITS": 8, "BLOCK_N": 32}, {},
                 marks=EXHAUSTIVE),
    pytest.param(4, 2, 64, [(70, 3), (5, 2)], dict(q_norm=True, k_norm=True, scaling=YARN, rotary_dim=32),
                 {"NUM_SPLITS": 8, "BLOCK_N": 16}, {}, marks=EXHAUSTIVE),
    pytest.param(2, 1, 128, [(150, 4)], dict(q_norm=False, k_norm=False), {"NUM_SPLITS": 2, "BLOCK_N": 16},
                 {"softcap": 50.0, "window": 48, "scale": 0.1}, marks=EXHAUSTIVE),
    pytest.param(8, 2, 64, [(40, 3), (300, 2)], dict(q_norm=False, k_norm=False, scaling=YARN),
                 {"NUM_SPLITS": 4, "BLOCK_N": 16}, {"window": 37, "sinks": True}, marks=EXHAUSTIVE),
]


@pytest.mark.parametrize("hq,hkv,d,specs,qk,tune,extra", VERIFY)
def test_merged_attention_decode_on_a_verify_step(hq, hkv, d, specs, qk, tune, extra):
    gen = np.random.default_rng(hq * 7 + d + sum(n for _, n in specs))
    qk_attrs = {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "eps": 1e-6,
                "theta": 500000.0 if qk.get("scaling") else 1000000, "scaling": qk.get("scaling"),
                "rotary_dim": qk.get("rotary_dim"), "q_norm": qk["q_norm"], "k_norm": qk["k_norm"]}
    attn_attrs = {"kv_heads": hkv, "scale": extra.get("scale"), "window": extra.get("window"),
                  "softcap": extra.get("softcap")}
    sink_in, sinks = [], ()
    if extra.get("sinks"):
        attn_attrs["has_sinks"] = True
        sink_in = [("sinks", [hq], "f32", "weight")]
        sinks = (torch.from_numpy(gen.standard_normal(hq).astype(np.float32) * 3),)
    page = Paged(gen, specs, hkv, d)
    # token order (the references'): sequence by sequence; the kernel's rows: a shuffle of them
    tok = [(i, c + j) for i, (c, n) in enumerate(specs) for j in range(n)]
    slot = lambda i, p: page.pages[i][p // PS] * PS + p % PS               # noqa: E731
    for i, p in tok:                         # the step's keys and values: the launch writes them
        page.k_cache.view(-1, hkv, d)[slot(i, p)] = float("nan")
        page.v_cache.view(-1, hkv, d)[slot(i, p)] = float("nan")
    T = len(tok)
    order = list(reversed(range(T)))                                         # row r runs token order[r]
    qkv_tok = rand((T, (hq + 2 * hkv) * d), gen=gen, scale=3.0)
    qkv = qkv_tok[order].contiguous()
    norms = [(1 + 0.3 * rand((d,), gen=gen).float()).to(torch.bfloat16) for _ in range(qk["q_norm"] + qk["k_norm"])]
    rows = [tok[t] for t in order]
    meta = {"meta:positions": torch.tensor([p for _, p in rows], dtype=torch.int32),
            "meta:slot_mapping": torch.tensor([slot(i, p) for i, p in rows], dtype=torch.int32),
            "meta:block_tables": page.block_tables[[i for i, _ in rows]].contiguous(),
            "meta:context_lens": torch.tensor([p + 1 for _, p in rows], dtype=torch.int32),
            "meta:max_pages": page.max_pages}
    qk_in = [("qkv", ["T", (hq + 2 * hkv) * d], "bf16")]
    qk_in += [("q_norm", [d], "bf16", "weight")] * qk["q_norm"] + [("k_norm", [d], "bf16", "weight")] * qk["k_norm"]
    norm_b = {f"in:{i + 1}": w for i, w in enumerate(norms)}
    dims = {"T": T, "B": T}

    caches = {"cache:k": page.k_cache.clone(), "cache:v": page.v_cache.clone()}
    k1 = render("qk_norm_rope_cache", "qk_norm_rope_cache", qk_in, [("q", ["T", hq, d], "bf16"), ("cache", [], "", "cache")],
                attrs=qk_attrs, caches=kv_caches(hkv, d))
    q = poison((T, hq, d))
    run(k1, {"in:0": qkv, "out:0": q, **norm_b, **meta, **caches}, dims)
    k2 = render("attention_decode", "attention_cached", [("q", ["T", hq, d], "bf16"), ("cache", [], "", "cache")] + sink_in,
                [("o", ["T", hq, d], "bf16")], attrs=attn_attrs, caches=kv_caches(hkv, d), tune=tune)
    o_two = poison((T, hq, d))
    run(k2, {"in:0": q, "out:0": o_two, **meta, **caches, **({"in:2": sinks[0]} if sinks else {})}, dims)

    prologue = {"op": "qk_norm_rope_cache", "inputs": len(qk_in), "output": 0, "value": "q", "writes": 1,
                "attrs": qk_attrs}
    k = render("attention_decode", "attention_cached", qk_in + [("cache", [], "", "cache")] + sink_in,
               [("cache", [], "", "cache"), ("o", ["T", hq, d], "bf16")], attrs=attn_attrs,
               caches=kv_caches(hkv, d), tune=tune, prologue=prologue, narrow=8)
    o = poison((T, hq, d))
    sink_b = {f"in:{len(qk_in) + 1}": sinks[0]} if sinks else {}
    scratch = run(k, {"in:0": qkv, **norm_b, "out:1": o, **meta, **sink_b, "cache:k": page.k_cache,
                      "cache:v": page.v_cache}, dims)
    assert not torch.isnan(o.float()).any()
    assert torch.equal(o, o_two)
    bits = lambda t: t.view(torch.int16)                             # noqa: E731 (NaN pages too)
    assert torch.equal(bits(page.k_cache), bits(caches["cache:k"]))
    assert torch.equal(bits(page.v_cache), bits(caches["cache:v"]))
    assert all(int(c) == 0 for c in scratch["counter"][:T * hkv])

    # the references, in token order: qk_norm_rope_cache writes the float32 caches, then the
    # mixed step's causal attention over each sequence's new tokens
    ctx = page.ctx
    ctx.meta.slot_mapping = np.asarray([slot(i, p) for i, p in tok], np.int64)
    want_q, _ = REGISTRY["qk_norm_rope_cache"].reference(ctx, qkv_tok.float().numpy(),
                                                          *[w.float().numpy() for w in norms], **qk_attrs)
    want = REGISTRY["attention_cached"].reference(ctx, want_q, None, *[t.numpy() for t in sinks], **attn_attrs)
    got = np.empty_like(want)
    got[order] = o.float().numpy()
    assert rel_err(got, want) <= TOL
