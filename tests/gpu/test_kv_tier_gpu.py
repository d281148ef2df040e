"""The KV tiers' block_copy kernel on the GPU (runtime/cuda/kv_copies.py): one launch a batch moves
the same bytes as the driver's 2D copies (one per (cache, layer) and run), saves and restores, for
qwen3-4b's caches (36 layers of K and V, 16-token pages), caches of odd sizes (2-byte words) and
Qwen3.5's state snapshot pool; and what a batch costs the engine thread (host µs to issue it) and
the copy stream, each way, printed. The kernel is compiled here (compiler/codegen/aot.py). And the
engine with the host tier on (qwen3-4b's served build, block_copy in its plan): a prefix restored
from the host tier gives the tokens and logprobs the same prefix gave from the KV cache, bit for
bit."""
import time

import numpy as np
import pytest

from infc.compiler.codegen.aot import compile_kernels
from infc.compiler.codegen.render import render_block_copy
from infc.compiler.contract import caches as C

QWEN3_4B = {"k": {"kind": "paged", "shape": [8, 128], "dtype": "bf16", "layers": list(range(36))},
            "v": {"kind": "paged", "shape": [8, 128], "dtype": "bf16", "layers": list(range(36))}}
ODD = {"k": {"kind": "paged", "shape": [3, 5], "dtype": "bf16", "layers": [0, 2]},
       "v": {"kind": "paged", "shape": [7], "dtype": "f32", "layers": [0, 2]},
       "conv": {"kind": "slot", "shape": [3, 5], "dtype": "f32", "layers": [1]}}
QWEN35_SNAPSHOTS = C.snapshot_decl({
    "conv": {"kind": "slot", "shape": [3, 8192], "dtype": "bf16", "layers": list(range(24))},
    "recurrent": {"kind": "slot", "shape": [32, 128, 128], "dtype": "f32", "layers": list(range(24))}})


@pytest.fixture(scope="module")
def ctx():
    from infc.runtime.cuda.driver import Context
    c = Context(0)
    yield c
    c.close()


def _kernel(decl, ps, tmp_path):
    from infc.runtime.cuda.artifact import KernelFn
    from infc.runtime.cuda.driver import Module
    k = render_block_copy({"caches": decl}, ps)
    info = compile_kernels({k.id: k}, tmp_path / "bin", progress=False)["kernels"][k.id]
    fn = Module((tmp_path / "bin" / f"{k.id}.cubin").read_bytes()).function(info["name"], int(info.get("shared", 0)))
    return KernelFn(k.id, k.meta, info, fn)


@pytest.mark.parametrize("decl,ps,num_pages,batch", [(QWEN3_4B, 16, 600, 144), (ODD, 3, 50, 20),
                                                     (QWEN35_SNAPSHOTS, 1, 40, 12)])
def test_one_launch_moves_what_the_2d_copies_move(ctx, tmp_path, decl, ps, num_pages, batch):
    from infc.runtime.cuda.kv_copies import DeviceCopies
    rng = np.random.default_rng(num_pages)
    dev = C.DeviceCaches(ctx, decl, ps, num_pages, 2)
    ctx.htod(dev.base, rng.integers(0, 256, dev.nbytes, dtype=np.uint8))
    ctx.sync()
    kernel = _kernel(decl, ps, tmp_path)
    fast, plain = DeviceCopies(ctx, dev, kernel), DeviceCopies(ctx, dev)
    assert fast.kernel is not None and plain.kernel is None
    rows = 2 * batch
    a, b = fast.make_slab(rows), plain.make_slab(rows)
    a[...] = b[...] = rng.integers(0, 256, a.shape, dtype=np.uint8)
    run = list(range(10, 15))                              # one run of five, the rest scattered
    pages = run + [p for p in rng.permutation(num_pages).tolist() if p not in run][:batch - len(run)]
    slab_rows = rng.permutation(rows)[:len(pages)].tolist()
    timings = {}
    for name, c in (("kernel", fast), ("2d", plain)):
        t = time.perf_counter()
        f = c.save(pages, slab_rows)
        timings[name] = (time.perf_counter() - t) * 1e6
        c.host_wait(f)
    assert a.tobytes() == b.tobytes()
    # restore into other pages: the kernel's device bytes equal the 2D copies'
    back = rng.permutation(num_pages)[:len(pages)].tolist()
    results = {}
    for name, c in (("kernel", fast), ("2d", plain)):
        ctx.htod(dev.base, np.zeros(dev.nbytes, np.uint8))
        ctx.sync()
        t = time.perf_counter()
        f = c.load(back, slab_rows)
        timings[name + " load"] = (time.perf_counter() - t) * 1e6
        c.host_wait(f)
        results[name] = ctx.dtoh(np.empty(dev.nbytes, np.uint8), dev.base)
        ctx.sync()
    assert results["kernel"].tobytes() == results["2d"].tobytes()
    assert results["kernel"].any()
    mb = len(pages) * fast.block_bytes / 1e6
    print(f"\n  {len(pages)} blocks of {fast.block_bytes} bytes ({mb:.1f} MB): engine thread µs to issue "
          + ", ".join(f"{k} {v:.0f}" for k, v in timings.items())
          + f"; copy stream ms: kernel save {fast.last_ms(True):.2f} load {fast.last_ms(False):.2f}, "
          f"2d save {plain.last_ms(True):.2f} load {plain.last_ms(False):.2f}")
    fast.close()
    plain.close()


@pytest.mark.parametrize("timing", ["write-back", "eager", "at-compute"])
def test_a_host_tier_hit_equals_the_kv_cache_hit(monkeypatch, timing):
    """qwen3-4b (dummy weights) served with --kv-offloading-size: prompt P (whole blocks) is
    computed, then P + a quarter block decodes 6 tokens on P's blocks from the KV cache; P's
    blocks are then demoted to the host tier (the KV cache forgets them) and the same prompt again
    restores them from there: the same steps on the same KV bytes, so the same tokens and logprobs
    exactly. Blocks saved when their pages near eviction (write-back, the default: here only by the
    demotion, the cache having room), when their sequence ends (INFC_KV_SAVE_EAGER) and as their
    step is issued (INFC_KV_SAVE_AT_COMPUTE)."""
    import models
    from infc.backend import load_backend
    from infc.runtime.engine.sampling import SamplingParams
    env = {"eager": "INFC_KV_SAVE_EAGER", "at-compute": "INFC_KV_SAVE_AT_COMPUTE"}.get(timing)
    if env:
        monkeypatch.setenv(env, "1")
    b = load_backend(models.REPO / ".cache" / "gpu" / "configs" / "qwen3-4b", device="cuda", load_format="dummy",
                     enable_prefix_caching=True, kv_offloading_size=2, max_model_len=4096, asynchronous=False,
                     log=None)
    e = b.engine
    try:
        assert e.tiers is not None and e.tiers.copies.kernel is not None     # the staged saves
        rng = np.random.default_rng(12)
        ps = b.page_size
        p = rng.integers(0, b.vocab_size, 24 * ps).tolist()
        q = p + rng.integers(0, b.vocab_size, ps // 4).tolist()       # with its 6 tokens, in one block
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)

        def run(prompt, rid):
            e.add_request(prompt, params, rid)
            got = []
            while e.has_unfinished():
                got += [(t, lp["logprob"]) for o in e.step() for t, lp in zip(o.token_ids, o.logprobs)]
            return got

        run(p, "p")
        hbm = run(q, "q-hbm")
        st = e.tiers.stats
        if timing == "write-back":
            assert st.bytes_to_host == 0                    # nothing near eviction yet
        else:
            assert st.bytes_to_host >= 24 * e.tiers.block_bytes      # P's blocks, saved already
        e.tiers.demote(e.bm)
        assert st.bytes_to_host >= 24 * e.tiers.block_bytes
        host = run(q, "q-host")
        assert st.host_hit_tokens >= 24 * ps, st.host_hit_tokens
        assert host == hbm
        e.bm.check()
    finally:
        getattr(e.runner, "close", lambda: None)()
