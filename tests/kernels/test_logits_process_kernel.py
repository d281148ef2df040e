"""The logits_process sampler kernel under the interpreter against the numpy reference
(runtime/engine/logits_process.py): mixed rows (penalties, bias, bans, bitmasks, nothing), V not
a multiple of the block, random f32 logits of both signs."""
import numpy as np
import pytest
import torch

from infc.runtime.cuda.logits_process_args import pack_rows
from infc.runtime.engine.logits_process import process_logits
from logits_rows import mixed_rows

from .harness import render, run

V = 300            # not a multiple of BLOCK (64) nor of 32 (the bitmask's words)


def run_kernel(logits, rows, **tune):
    k = render("logits_process", "logits_process", [], [], config={"V": logits.shape[1]}, tune=tune)
    args = pack_rows(rows, logits.shape[1])
    out = torch.from_numpy(logits.copy())
    names = ["rows", "rep", "freq", "pres", "start", "tok", "count", "flag", "bias", "mask_row", "masks"]
    b = {"in:0": out, **{f"in:{i + 1}": torch.from_numpy(np.ascontiguousarray(getattr(args, n)))
                         for i, n in enumerate(names)}}
    run(k, b, {"T": args.rows.size, "B": args.rows.size})
    return out.numpy()


@pytest.mark.parametrize("tune", [{"BLOCK": 64, "EBLOCK": 16}, {"BLOCK": 32, "EBLOCK": 8, "CHUNK": 128}, {}])
def test_logits_process_kernel_matches_the_reference(tune):
    gen = np.random.default_rng(41)
    logits = (gen.standard_normal((6, V)) * 3).astype(np.float32)
    rows = mixed_rows(gen, V)
    got = run_kernel(logits, rows, **tune)
    for b, s in enumerate(rows):
        want = logits[b] if s is None else process_logits(logits[b], s)
        assert np.array_equal(np.isinf(got[b]), np.isinf(want)), b
        assert np.allclose(got[b], want, rtol=1e-6, atol=1e-5), (b, np.abs(got[b] - want).max())
    assert np.array_equal(got[1], logits[1]) and np.array_equal(got[2], logits[2])
    assert not np.array_equal(got[0], logits[0]) and np.isinf(got[4]).sum() == V - 40
