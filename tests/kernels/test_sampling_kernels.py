"""Sampling kernels under the interpreter: sample_argmax and log_softmax exactly / to fp32
precision, and sample statistically against runtime/engine/sampling.py filtered_probs.

`sample` takes ROWS rows per program (tune key): production renders ROWS = 1; the statistical
tests use many rows per program so that thousands of draws stay fast under the interpreter,
and one test proves ROWS does not change any token.
"""
import numpy as np
import pytest
import torch

from infc.runtime.engine.sampling import SamplingParams, filtered_probs, logprobs_of

from .harness import poison, render, run

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")   # log(0) of a zero uniform: -inf


def sampling_kernel(name, V, **tune):
    return render(name, name, [], [], config={"V": V}, tune=tune)


def logits_rows(B, V, gen, scale=2.0):
    return torch.from_numpy((gen.standard_normal((B, V)) * scale).astype(np.float32))


@pytest.mark.parametrize("B,V,block", [(3, 50, None), (5, 1000, 256), (2, 151936, None)])
def test_sample_argmax(B, V, block):
    gen = np.random.default_rng(V)
    logits = logits_rows(B, V, gen)
    logits[0, [7, 3 * V // 4]] = logits[0].max() + 1.0          # a tie: the lower index wins
    if B > 2:
        logits[2, [V - 1, 1]] = logits[2].max() + 1.0
    k = sampling_kernel("sample_argmax", V, **({"BLOCK": block} if block else {}))
    out, host = poison((B,), "i32"), poison((B,), "i32")
    run(k, {"in:0": logits, "out:0": out, "out:1": host}, {"T": B, "B": B})
    assert np.array_equal(out.numpy(), np.argmax(logits.numpy(), axis=1))
    assert out[0] == 7
    assert np.array_equal(host.numpy(), out.numpy())       # the host's copy of the ids


@pytest.mark.parametrize("B,V,block", [(3, 50, None), (4, 1000, 256), (1, 151936, None)])
def test_log_softmax(B, V, block):
    gen = np.random.default_rng(V)
    logits = logits_rows(B, V, gen, scale=4.0)
    logits[0, ::7] = float("-inf")                               # masked vocabulary entries
    k = sampling_kernel("log_softmax", V, **({"BLOCK": block} if block else {}))
    out = poison((B, V), "f32")
    run(k, {"in:0": logits, "out:0": out}, {"T": B, "B": B})
    want = np.stack([logprobs_of(row) for row in logits.numpy()])
    assert np.array_equal(np.isinf(out.numpy()), np.isinf(want))
    assert np.allclose(out.numpy(), want, rtol=1e-5, atol=2e-5)


def sample_bindings(logits, params, seeds, steps):
    B = logits.shape[0]
    return {"in:0": logits,
            "in:1": torch.tensor([p.temperature for p in params], dtype=torch.float32),
            "in:2": torch.tensor([p.top_k for p in params], dtype=torch.int32),
            "in:3": torch.tensor([p.top_p for p in params], dtype=torch.float32),
            "in:4": torch.tensor([p.min_p for p in params], dtype=torch.float32),
            "in:5": torch.as_tensor(np.asarray(seeds, np.int64)),
            "in:6": torch.as_tensor(np.asarray(steps, np.int32)),
            "out:0": poison((B,), "i32"), "out:1": poison((B,), "i32")}


def draw(kernel, logits, params, seeds, steps):
    """The drawn ids; the kernel's two outputs (device ids, the host's copy) must agree."""
    b = sample_bindings(logits, params, seeds, steps)
    run(kernel, b, {"T": logits.shape[0], "B": logits.shape[0]})
    assert np.array_equal(b["out:1"].numpy(), b["out:0"].numpy())
    return b["out:0"].numpy()


V_SMALL = 50
N_DRAWS = 2000
CONFIGS = {
    "temperature": SamplingParams(temperature=1.0),
    "top_k": SamplingParams(temperature=0.7, top_k=10),
    "top_p": SamplingParams(temperature=1.0, top_p=0.8),
    "min_p": SamplingParams(temperature=1.0, min_p=0.1),
    "all": SamplingParams(temperature=1.3, top_k=20, top_p=0.9, min_p=0.05),
    "top_k_ties": None,              # top_k set below, where the k-th value is tied
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sample_distribution(name):
    """N draws of one row's distribution (distinct seeds, and steps) against filtered_probs:
    never a token outside the kept set; each token's count within 5 sigma of its expectation;
    total-variation distance below its expectation bound plus a McDiarmid margin (false
    failure probability < 1e-4 for a correct sampler)."""
    p = CONFIGS[name]
    gen = np.random.default_rng(len(name))
    row = (gen.standard_normal(V_SMALL) * 1.5).astype(np.float32)
    if name == "top_k_ties":
        row = np.round(row * 2) / 2                              # many exact ties
        desc = np.sort(row)[::-1]
        k = next(k for k in range(4, V_SMALL) if desc[k - 1] == desc[k])
        p = SamplingParams(temperature=0.5, top_k=k)             # the k-th value is tied: all kept
        assert (row >= desc[k - 1]).sum() > k
    want = filtered_probs(row, p)
    n = N_DRAWS
    seeds = np.arange(n, dtype=np.int64) * 1_000_003 + 17
    seeds[n // 2:] = 424242                                      # the other half: one seed, many steps
    steps = np.where(np.arange(n) < n // 2, 5, np.arange(n))
    k = sampling_kernel("sample", V_SMALL, ROWS=1024, BLOCK=16)        # 4 tokens per lane: the in-lane walk
    tokens = draw(k, torch.from_numpy(np.tile(row, (n, 1))), [p] * n, seeds, steps)

    assert ((tokens >= 0) & (tokens < V_SMALL)).all()
    assert (want[tokens] > 0).all(), f"drew tokens outside the kept set: {sorted(set(tokens[want[tokens] == 0]))}"
    counts = np.bincount(tokens, minlength=V_SMALL)
    sigma = np.sqrt(n * want * (1 - want))
    assert (np.abs(counts - n * want) <= 5 * sigma + 1).all(), (counts, np.round(n * want, 1))
    tv = 0.5 * np.abs(counts / n - want).sum()
    bound = 0.5 * np.sqrt(want * (1 - want) / n).sum() + np.sqrt(np.log(1e4) / (2 * n))
    assert tv < bound, (tv, bound)


def mixed_batch(gen, V):
    """Rows with every kind of parameter; greedy rows with a tie at the max."""
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.8, top_k=3), SamplingParams(temperature=0.0, top_k=5, top_p=0.5),
              SamplingParams(temperature=1.2, top_p=0.7), SamplingParams(temperature=1.0, min_p=0.2),
              SamplingParams(temperature=0.6, top_k=12, top_p=0.95, min_p=0.01), SamplingParams(temperature=2.0)]
    logits = logits_rows(len(params), V, gen)
    logits[0, [3, 9]] = logits[0].max() + 0.5
    logits[3, [V - 2, 4]] = logits[3].max() + 0.5
    return logits, params


def test_sample_greedy_rows_and_rows_per_program():
    gen = np.random.default_rng(1)
    V = 100
    logits, params = mixed_batch(gen, V)
    B = len(params)
    seeds, steps = np.arange(B) * 31 + 5, np.full(B, 2)
    one = draw(sampling_kernel("sample", V), logits, params, seeds, steps)
    assert one[0] == 3 and one[3] == 4                               # temperature 0: argmax, lowest index
    for i, p in enumerate(params):
        if p.temperature:
            assert filtered_probs(logits[i].numpy(), p)[one[i]] > 0
    # many rows per program (with a partial last program), another top-k method and split: the
    # same tokens (the draw order, lane-major, depends on BLOCK: it stays)
    for tune in [dict(ROWS=4, SPLIT=2), dict(ROWS=16, SPLIT=16)]:
        assert np.array_equal(draw(sampling_kernel("sample", V, **tune), logits, params, seeds, steps), one)


def test_sample_reproducible():
    gen = np.random.default_rng(2)
    V = 64
    k = sampling_kernel("sample", V, ROWS=32)
    logits, params = mixed_batch(gen, V)
    B = len(params)
    seeds, steps = np.arange(B) * 7 + 100, np.arange(B) + 1
    first = draw(k, logits, params, seeds, steps)
    assert np.array_equal(draw(k, logits, params, seeds, steps), first)
    # another batch composition: reversed, and with other rows around; each row keeps its token
    order = np.arange(B)[::-1].copy()
    extra_logits, extra_params = mixed_batch(np.random.default_rng(3), V)
    big_logits = torch.cat([logits[order], extra_logits])
    big = draw(k, big_logits, [params[i] for i in order] + extra_params,
               np.concatenate([seeds[order], seeds + 1]), np.concatenate([steps[order], steps]))
    assert np.array_equal(big[:B], first[order])

    # the stream: a flat distribution, one row per (seed, step)
    flat = torch.zeros(96, V)
    p = [SamplingParams(temperature=1.0)] * 96
    by_seed = draw(k, flat, p, np.arange(96) + 1, np.zeros(96))          # different seeds, same step
    by_step = draw(k, flat, p, np.full(96, 9), np.arange(96))            # same seed, different steps
    same = draw(k, flat, p, np.full(96, 9), np.full(96, 4))              # same seed and step
    assert len(set(by_seed)) > 40 and len(set(by_step)) > 40              # ~50 expected of 64
    assert len(set(same)) == 1 and same[0] == by_step[4]
    negative = draw(k, flat[:8], p[:8], -np.arange(1, 9) * 2 ** 40, np.zeros(8))   # any int64 seed
    assert ((negative >= 0) & (negative < V)).all()


def test_sample_full_vocab():
    """V = 151936 (Qwen): every token inside the kept set; greedy rows exact; one row per program
    (top-k by radix select) draws the same tokens as four (top-k by the split search)."""
    V = 151936
    gen = np.random.default_rng(4)
    logits = logits_rows(4, V, gen, scale=3.0)
    params = [SamplingParams(temperature=0.9, top_k=40), SamplingParams(temperature=1.0, top_p=0.9),
              SamplingParams(temperature=0.7, top_k=1000, top_p=0.5, min_p=0.02), SamplingParams(temperature=0.0)]
    seeds, steps = [11, 12, 13, 14], [0, 0, 0, 0]
    tokens = draw(sampling_kernel("sample", V, ROWS=4, BLOCK=16384, SPLIT=16), logits, params, seeds, steps)
    for i, p in enumerate(params):
        if p.temperature:
            probs = filtered_probs(logits[i].numpy(), p)
            assert probs[tokens[i]] > 0, (i, int((probs > 0).sum()))
    assert tokens[3] == int(np.argmax(logits[3].numpy()))
    one = draw(sampling_kernel("sample", V, BLOCK=16384, SPLIT=16), logits[[0, 2]], [params[0], params[2]],
               seeds[0::2], steps[0::2])
    assert np.array_equal(one, tokens[0::2])
