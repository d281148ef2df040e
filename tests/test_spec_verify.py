"""runtime/engine/speculative/verify.py: greedy verification token by token, and the sampled
rule's output distribution against the target's by a chi-square test over seeded draws (fixed
seeds: deterministic; rejecting at p <= 1e-4, so a correct rule passes for all but
rare seeds and a rule off by a few percent of mass fails by orders of magnitude)."""
import math

import numpy as np
import pytest
from exhaustive import EXHAUSTIVE

from infc.runtime.engine.sampling import SamplingParams, filtered_probs, sample
from infc.runtime.engine.speculative.verify import Verdict, verify, verify_greedy, verify_sampled

V = 8
N = 20_000
ALPHA = 1e-4


def chi2_sf(stat: float, df: int) -> float:
    """P(chi2_df >= stat), exact for integer df (no scipy here): the Poisson tail for even df,
    erfc plus the half-integer terms for odd."""
    h = stat / 2
    if df % 2 == 0:
        return math.exp(-h) * sum(h ** j / math.factorial(j) for j in range(df // 2))
    return math.erfc(math.sqrt(h)) + math.exp(-h) * sum(
        h ** (j - 0.5) / math.gamma(j + 0.5) for j in range(1, (df + 1) // 2))


def test_chi2_sf_at_known_quantiles():
    for df, x, p in [(1, 3.8415, 0.05), (2, 18.4207, 1e-4), (3, 7.8147, 0.05), (4, 23.5127, 1e-4), (24, 36.4150, 0.05)]:
        assert chi2_sf(x, df) == pytest.approx(p, rel=1e-3), df


def chi2_check(counts: np.ndarray, want: np.ndarray):
    """counts drawn from want? Nothing where want is 0; cells expecting < 5 pooled into one."""
    counts, want = counts.ravel(), want.ravel()
    assert counts[want == 0].sum() == 0, f"drew outcomes of probability 0: {np.flatnonzero(counts * (want == 0))}"
    n = counts.sum()
    exp = n * want
    big = exp >= 5
    obs_cells = np.append(counts[big], counts[~big & (want > 0)].sum())
    exp_cells = np.append(exp[big], exp[~big & (want > 0)].sum())
    if exp_cells[-1] == 0:
        obs_cells, exp_cells = obs_cells[:-1], exp_cells[:-1]
    stat = float(((obs_cells - exp_cells) ** 2 / exp_cells).sum())
    df = len(exp_cells) - 1
    assert chi2_sf(stat, df) > ALPHA, f"chi2 {stat:.1f} on {df} degrees of freedom: p = {chi2_sf(stat, df):.2g}"


def probs(gen, params: SamplingParams, shape=()) -> np.ndarray:
    """Target rows as the sampler sees them: random logits through filtered_probs."""
    logits = gen.standard_normal(shape + (V,)).astype(np.float32) * 1.5
    return np.apply_along_axis(filtered_probs, -1, logits, params)


def draws(gen, q: np.ndarray, n: int) -> np.ndarray:
    """n proposer draws from q (inverse CDF: the proposer's randomness, apart from the verifier's)."""
    return np.minimum(np.searchsorted(np.cumsum(q), gen.random(n), side="right"), V - 1)


# ---- greedy ----

@pytest.mark.parametrize("target, draft, want", [
    ([5, 6, 7, 8], [5, 6, 7], Verdict(3, [5, 6, 7, 8])),     # all accepted: the bonus token
    ([5, 6, 7, 8], [4, 6, 7], Verdict(0, [5])),              # the first differs: the target's
    ([5, 6, 7, 8], [5, 6, 1], Verdict(2, [5, 6, 7])),        # the last differs
    ([5, 9, 7, 8], [5, 6, 7], Verdict(1, [5, 9])),           # a later match does not count
    ([5, 6, 7, 8], [6, 5, 7], Verdict(0, [5])),              # nor a token of another position
    ([3], [], Verdict(0, [3])),                              # no draft: a plain decode step
])
def test_greedy(target, draft, want):
    assert verify_greedy(target, draft) == want
    assert verify_greedy(np.array(target, np.int64), np.array(draft, np.int32)) == want


def test_verify_at_temperature_0_is_the_samplers_argmax():
    """Ties at the max go to the lowest id, as sampling.sample's argmax: a draft of the other tied
    id is rejected, so greedy output stays token-identical to non-speculative decoding."""
    gen = np.random.default_rng(3)
    logits = gen.standard_normal((3, V)).astype(np.float32)
    logits[1, [2, 6]] = logits[1].max() + 1
    params = SamplingParams(temperature=0.0)
    want = [sample(row, params, None) for row in logits]
    assert want[1] == 2
    got = verify(logits, [want[0], 6], params, None)
    assert got == Verdict(1, [want[0], 2])
    assert verify(logits, want[:2], params, None) == Verdict(2, want)


# ---- sampled ----

def test_no_draft_draws_as_the_sampler():
    """k = 0: the same token as sampling.sample from the same generator state, seed by seed."""
    gen = np.random.default_rng(4)
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
    logits = gen.standard_normal((1, V)).astype(np.float32)
    for seed in range(50):
        want = sample(logits[0], params, np.random.default_rng(seed))
        assert verify(logits, [], params, np.random.default_rng(seed)) == Verdict(0, [want])


def wrong_rule(p, draft, q, rng):
    """Accept with p/q but on rejection draw from p itself, not the residual: biased to the draft."""
    x = draft[0]
    qx = 1.0 if q is None else q[0, x]
    if rng.random() * qx < p[0, x]:
        return Verdict(1, [x, int(rng.choice(V, p=p[1]))])
    return Verdict(0, [int(rng.choice(V, p=p[0]))])


# p: the target's filters; q: a dense draft distribution, one truncated (zero where p is not,
# so the residual carries that mass), or None with a fixed draft token (n-gram), of positive
# probability under p or filtered out of p (then always rejected)
CASES = {
    "dense_q_top_k": (SamplingParams(temperature=1.0, top_k=5), "dense"),
    "truncated_q_top_p": (SamplingParams(temperature=0.7, top_p=0.8), "truncated"),
    "one_hot_min_p": (SamplingParams(temperature=1.3, min_p=0.05), "one_hot"),
    "one_hot_outside_top_k": (SamplingParams(temperature=1.0, top_k=3), "one_hot_outside"),
}


def first_tokens(name: str, rule) -> tuple[np.ndarray, np.ndarray]:
    """N first emitted tokens of a 1-token draft under CASES[name]; the target's p for them."""
    params, kind = CASES[name]
    gen = np.random.default_rng(sorted(CASES).index(name) + 10)
    p = probs(gen, params, (2,))
    if kind == "one_hot":
        q, xs = None, np.full(N, int(np.argsort(p[0])[-2]))      # the second likeliest: both branches
    elif kind == "one_hot_outside":
        q, xs = None, np.full(N, int(np.flatnonzero(p[0] == 0)[0]))
    else:
        q = gen.dirichlet(np.ones(V))
        if kind == "truncated":
            q[np.argsort(p[0])[-2:]] = 0                         # the target's two likeliest
            q /= q.sum()
        xs = draws(gen, q, N)
    qs = None if q is None else q[None]
    rng = np.random.default_rng(1234)
    tokens = np.array([rule(p, [int(x)], qs, rng).tokens[0] for x in xs])
    return np.bincount(tokens, minlength=V), p[0]


# about 0.6 s each: the fast suite keeps a dense and a one-hot q (the joint test below covers a
# dense q's other branches again)
FAST = ("dense_q_top_k", "one_hot_min_p")


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=EXHAUSTIVE) for n in CASES])
def test_first_token_has_the_targets_distribution(name):
    counts, p = first_tokens(name, verify_sampled)
    chi2_check(counts, p)


@pytest.mark.parametrize("name", [n if n == FAST[0] else pytest.param(n, marks=EXHAUSTIVE) for n in FAST])
def test_the_chi2_check_catches_a_rule_without_the_residual(name):
    """The same check on wrong_rule fails: the test has the power to see a rule that is not exact."""
    counts, p = first_tokens(name, wrong_rule)
    with pytest.raises(AssertionError, match="chi2"):
        chi2_check(counts, p)


def test_a_one_hot_draft_outside_the_targets_support_is_always_rejected():
    """p(x) = 0 (filtered out by top_k): never accepted, the token drawn from p (x excluded)."""
    gen = np.random.default_rng(5)
    p = probs(gen, SamplingParams(temperature=1.0, top_k=3), (2,))
    x = int(np.flatnonzero(p[0] == 0)[0])
    rng = np.random.default_rng(6)
    for _ in range(300):
        got = verify_sampled(p, [x], None, rng)
        assert got.accepted == 0 and p[0, got.tokens[0]] > 0, got


def test_two_emitted_tokens_have_the_targets_joint_distribution():
    """Drafts of 2 tokens (and of 1 on odd draws, so that the bonus token is the second) from a
    draft model whose second distribution depends on its first token, against a target whose does
    too: the first two emitted tokens (a second step from the first when only one is emitted)
    have the joint P1(a) P2(b | a) of sampling the target twice."""
    gen = np.random.default_rng(7)
    params = SamplingParams(temperature=0.9, top_k=6, top_p=0.95)
    P1, P2, P3 = probs(gen, params), probs(gen, params, (V,)), probs(gen, params, (V, V))
    Q1, Q2 = gen.dirichlet(np.ones(V)), gen.dirichlet(np.full(V, 0.5), size=V)
    rng = np.random.default_rng(99)
    d1s = draws(gen, Q1, N)
    counts = np.zeros((V, V), np.int64)
    accepted = np.zeros(3, np.int64)
    for i, (d1, u) in enumerate(zip(d1s, gen.random(N))):
        if i % 2:
            got = verify_sampled(np.stack([P1, P2[d1]]), [int(d1)], Q1[None], rng)
        else:
            d2 = min(int(np.searchsorted(np.cumsum(Q2[d1]), u, side="right")), V - 1)
            got = verify_sampled(np.stack([P1, P2[d1], P3[d1, d2]]), [int(d1), d2], np.stack([Q1, Q2[d1]]), rng)
        accepted[got.accepted] += 1
        a = got.tokens[0]
        if len(got.tokens) >= 2:
            b = got.tokens[1]
        else:                                                    # the next step, drafting from a
            d = int(draws(gen, Q2[a], 1)[0])
            b = verify_sampled(np.stack([P2[a], P3[a, d]]), [d], Q2[a][None], rng).tokens[0]
        counts[a, b] += 1
    assert (accepted > N // 20).all(), accepted                  # every branch of the rule ran
    chi2_check(counts, P1[:, None] * P2)


def test_rows_off_by_less_than_the_tolerance_are_renormalized():
    """An f32 softmax's rounding (here 5e-5) is accepted and drawn from as its normalized self."""
    gen = np.random.default_rng(8)
    p = gen.dirichlet(np.ones(V), size=3) * (1 + 5e-5)
    q = gen.dirichlet(np.ones(V), size=2) * (1 - 5e-5)
    rng = np.random.default_rng(9)
    got = [verify_sampled(p, [int(draws(gen, q[0], 1)[0]), int(draws(gen, q[1], 1)[0])], q, rng).accepted
           for _ in range(200)]
    assert set(got) == {0, 1, 2}                                 # rejections and bonus draws both ran


# ---- malformed input ----

def test_errors_name_what_and_where():
    p = np.full((3, V), 1 / V)
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"target_tokens must hold len\(draft\) \+ 1 = 3 .* got 2"):
        verify_greedy([1, 2], [1, 2])
    with pytest.raises(ValueError, match=r"draft\[1\] = -1 is not a token id"):
        verify_greedy([1, 2, 3], [1, -1])
    with pytest.raises(ValueError, match="draft must be a 1-d sequence of token ids"):
        verify_greedy([1, 2], [1.5])
    with pytest.raises(ValueError, match=r"target_probs must have len\(draft\) \+ 1 = 2 rows.*got 3"):
        verify_sampled(p, [1], None, rng)
    with pytest.raises(ValueError, match=r"draft\[0\] = 8 is not a token id in \[0, 8\)"):
        verify_sampled(p, [8, 1], None, rng)
    with pytest.raises(ValueError, match="target_probs row 2 sums to .*pass probabilities, not logits"):
        bad = p.copy()
        bad[2, 0] += 0.01
        verify_sampled(bad, [1, 2], None, rng)
    with pytest.raises(ValueError, match=r"target_probs\[1, 3\] = nan"):
        bad = p.copy()
        bad[1, 3] = np.nan
        verify_sampled(bad, [1, 2], None, rng)
    with pytest.raises(ValueError, match=r"target_probs must be \[rows, V\]"):
        verify_sampled(p[0], [], None, rng)
    with pytest.raises(ValueError, match=r"draft_probs must be \[len\(draft\), V\] = \[2, 8\], got \[3, 8\]"):
        verify_sampled(p, [1, 2], p, rng)
    q = np.full((2, V), 1 / V)
    q[1] = np.eye(V)[0]
    with pytest.raises(ValueError, match="draft token 2 at position 1 has probability 0 under draft_probs"):
        verify_sampled(p, [1, 2], q, rng)
    with pytest.raises(ValueError, match=r"verify: logits must be \[k \+ 1, V\]"):
        verify(np.zeros(V), [], SamplingParams(), rng)
