"""block_copy (the KV tiers' copies, runtime/cuda/kv_copies.py) under the interpreter: device pages
to host blocks and back move the bytes HostCaches.read_pages / write_pages move (random bytes,
scattered pages and rows, caches of different page sizes, a slot cache left alone, the state
snapshot pool's layout), words of 4 and 2 bytes, regions of one word a vector and of four."""
import numpy as np
import pytest
import torch

from infc.compiler.codegen.render import block_copy_words, render_block_copy
from infc.compiler.contract import caches as C
from infc.runtime.cuda.block_copy_args import pairs, region_table

from .harness import run

KV = {"k": {"kind": "paged", "shape": [2, 8], "dtype": "bf16", "layers": [0, 1, 3]},
      "v": {"kind": "paged", "shape": [3, 4], "dtype": "bf16", "layers": [0, 1, 3]},
      "conv": {"kind": "slot", "shape": [3, 5], "dtype": "f32", "layers": [2]}}
ODD = {"k": {"kind": "paged", "shape": [3, 5], "dtype": "bf16", "layers": [0, 2]},
       "v": {"kind": "paged", "shape": [7], "dtype": "f32", "layers": [0, 2]}}
WIDE = {"k": {"kind": "paged", "shape": [2, 8], "dtype": "bf16", "layers": [0, 1]},
        "v": {"kind": "paged", "shape": [4, 8], "dtype": "bf16", "layers": [0, 1]}}
NP = {"bf16": np.uint16, "f32": np.float32}


def _device(decl, ps, num_pages, rng):
    """Random storage as HostCaches (the reference) and the same bytes laid out as on the device."""
    host = C.HostCaches(decl, ps, num_pages, 2, factory=lambda shape, d: np.zeros(shape, NP[d]))
    layout = C.Layout(decl, ps, num_pages, 2)
    dev = rng.integers(0, 256, layout.nbytes, dtype=np.uint8)
    for (name, layer), a in host.arrays.items():
        a.view(np.uint8)[...] = rng.integers(0, 256, a.view(np.uint8).shape, dtype=np.uint8)
        r = layout.region(name, layer)
        dev[r.offset:r.offset + r.nbytes] = a.reshape(-1).view(np.uint8)
    return host, layout, dev


def _launch(kernel, layout, dev, slab, pages, rows, to_host):
    word = kernel.meta["word"]
    table = region_table(layout, word, kernel.meta["constexprs"]["VEC"])
    assert table is not None
    pr = np.zeros((len(pages) + 3, 2), np.int32)          # a table longer than the batch
    n = pairs(pages, rows, pr)
    w = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
    run(kernel, {"arg:dev": torch.from_numpy(dev).view(w), "arg:host": torch.from_numpy(slab.reshape(-1)).view(w),
                 "arg:pairs": torch.from_numpy(pr), "arg:regions": torch.from_numpy(table),
                 "arg:n_regions": len(table), "arg:row_words": slab.shape[1] // word, "arg:to_host": int(to_host)},
        {"N": n * len(table)})


@pytest.mark.parametrize("decl,ps,want", [(KV, 4, (4, 1)), (ODD, 3, (2, 1)), (WIDE, 4, (4, 4)),
                                          (C.snapshot_decl(KV), 1, (4, 1))])
def test_blocks_move_as_host_blocks(decl, ps, want):
    rng = np.random.default_rng(ps + len(decl))
    plan = {"caches": decl}
    k = render_block_copy(plan, ps)
    assert plan["block_copy"] == k.id and block_copy_words(plan, ps) == want
    assert (k.meta["word"], k.meta["constexprs"]["VEC"]) == want
    host, layout, dev = _device(decl, ps, 10, rng)
    assert layout.block_bytes == host.block_bytes
    slab = rng.integers(0, 256, (7, layout.block_bytes), dtype=np.uint8)
    before = slab.copy()
    pages, rows = [7, 2, 3, 9, 4], [4, 0, 1, 6, 2]         # scattered, a run of two in the middle
    _launch(k, layout, dev, slab, pages, rows, True)
    want_slab = before.copy()
    host.read_pages(pages, want_slab, rows)
    assert slab.tobytes() == want_slab.tobytes()          # rows 3 and 5 untouched too
    # restored to other pages of a device whose every byte changed
    dev_before = rng.integers(0, 256, dev.size, dtype=np.uint8)
    dev[:] = dev_before
    back = [1, 5, 6, 8, 0]
    _launch(k, layout, dev, slab, back, rows, False)
    want_dev = dev_before.copy()
    for (name, layer), a in host.arrays.items():
        r = layout.region(name, layer)
        got = dev[r.offset:r.offset + r.nbytes]
        if decl[name]["kind"] != "paged":
            assert (got == want_dev[r.offset:r.offset + r.nbytes]).all()   # slot caches untouched
            continue
        host.write_pages(back, slab, rows)
        exp = want_dev[r.offset:r.offset + r.nbytes].reshape(a.shape[0], -1).copy()
        src = host.get(name, layer).reshape(a.shape[0], -1).view(np.uint8)
        exp[back] = src[back]
        assert got.tobytes() == exp.tobytes(), (name, layer)
    # no byte outside the regions' pages moved (alignment gaps, the padding page)
    mask = np.ones(dev.size, bool)
    for offset, stride, _ in layout.block_regions():
        for p in back:
            mask[offset + p * stride:offset + (p + 1) * stride] = False
    assert (dev[mask] == dev_before[mask]).all()


def test_a_table_that_breaks_the_vector_is_refused():
    layout = C.Layout(ODD, 3, 4)
    assert region_table(layout, 2, 1) is not None
    assert region_table(layout, 4, 1) is None and region_table(layout, 2, 2) is None


def test_only_a_build_for_the_host_tier_has_the_kernel():
    """Plans stay as they were unless built for --kv-offloading-size; a plan without paged caches
    has nothing to copy either way."""
    from infc.compiler.codegen.render import render_plan

    def plan(decl):
        return {"programs": {}, "outputs": {}, "buffers": {}, "weights": {}, "config": {}, "caches": decl}
    off, on = plan(KV), plan(KV)
    plain = render_plan(off, {}, 16)
    tier = render_plan(on, {}, 16, kv_offloading=True)
    assert "block_copy" not in off and set(tier) - set(plain) == {on["block_copy"]}
    assert tier[on["block_copy"]].meta["word"] == 4
    slots_only = plan({"conv": KV["conv"]})
    assert set(render_plan(slots_only, {}, 16, kv_offloading=True)) == set(plain) and "block_copy" not in slots_only
