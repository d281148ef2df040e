"""Hybrid prefix caching on the GPU (issue 44 part 3): Qwen3.5's 8-layer cut at real widths (the
SDK suite's model directory and artifact: gpu_families.SERVER, prepare.py part server) served by
the engine with prefix caching on. A prompt sent again after it finished hits its cached blocks
and the state snapshot where the hit ends (restored by device copies: runtime/cuda/state_copies.py);
a prompt sharing 600 tokens hits the 512 up to the snapshot at a prefill chunk's end. Each warm run's first-token top-20
logprobs equal a cold run's (an engine with prefix caching off) within the golden gate's bf16
limits: a wrong restored state (the recurrent layers' 6 of 8) lands far outside them, as the
unrelated prompt checked last shows."""
import numpy as np
import pytest

import gpu_families
import models
from test_golden import LIMITS
from infc.runtime.engine.sampling import SamplingParams

NAME = "qwen3.5-4b-l8"
TOP = 20


def _first_top(engine, prompt, rid) -> dict:
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP, ignore_eos=True), rid)
    lp = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.logprobs:
                lp = o.logprobs[0]
    return {int(t): float(v) for t, v in lp["top"]}


def _apart(a: dict, b: dict) -> tuple:
    """(regret of a's argmax under b, mean and max |delta| over the ids in both top lists; b's
    lowest listed logprob stands for one it does not list)."""
    best = max(a, key=a.get)
    regret = max(b.values()) - b.get(best, min(b.values()))
    d = np.abs([a[t] - b[t] for t in set(a) & set(b)])
    if not d.size:                                              # no id in both lists: far apart
        return float(regret), float("inf"), float("inf")
    return float(regret), float(d.mean()), float(d.max())


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from infc.backend import load_backend
    d = tmp_path_factory.mktemp("m") / gpu_families.server_dir_name(NAME)
    gpu_families.make_model(NAME, d, **gpu_families.SERVER[NAME])
    art = models.REPO / ".cache" / "artifacts" / gpu_families.server_dir_name(NAME)
    kw = dict(device="cuda", artifact=str(art), max_model_len=4096, max_num_seqs=8, num_gpu_blocks_override=1024,
              asynchronous=False, log=None)
    # chunks of 256 tokens: snapshots at each chunk's end (256, 512, 768) and the prompt's last boundary
    warm = load_backend(d, enable_prefix_caching=True, max_num_batched_tokens=256, **kw)
    cold = load_backend(d, enable_prefix_caching=False, **kw)
    yield warm.engine, cold.engine, warm.vocab_size
    for b in (warm, cold):
        getattr(b.engine.runner, "close", lambda: None)()


def test_a_hit_restores_kv_and_state(engines):
    warm, cold, vocab = engines
    assert warm.snapshots is not None and warm.bm.enable_prefix_caching
    rng = np.random.default_rng(44)
    p = rng.integers(0, vocab, 1000).tolist()
    q = p[:600] + rng.integers(0, vocab, 300).tolist()          # shares 600 tokens with p
    want_p, want_q = _first_top(cold, p, "cp"), _first_top(cold, q, "cq")
    first = _first_top(warm, p, "p0")                           # computes p, snapshots its boundaries
    hits = warm.bm.hit_tokens
    again = _first_top(warm, p, "p1")
    hit_p = warm.bm.hit_tokens - hits
    shared = _first_top(warm, q, "q1")
    hit_q = warm.bm.hit_tokens - hits - hit_p
    print(f"{NAME}: p hit {hit_p} of 1000 tokens, q hit {hit_q} of 900; snapshots restored "
          f"{warm.snapshots.restored}")
    assert hit_p >= 1000 - 2 * warm.page_size and hit_q == 512 and warm.snapshots.restored >= 2
    for what, got, want in (("p cold in the warm engine", first, want_p), ("p hit", again, want_p),
                            ("q prefix hit", shared, want_q)):
        regret, mean, worst = _apart(want, got)
        print(f"{NAME} {what}: regret {regret:.3f} mean {mean:.4f} max {worst:.3f}")
        assert regret <= LIMITS[0] and mean <= LIMITS[1] and worst <= 2 * LIMITS[2], what
    regret, mean, worst = _apart(want_p, want_q)               # the check's power: another prompt
    print(f"{NAME} p against q (unrelated answers): regret {regret:.3f} mean {mean:.4f}")
    assert regret > LIMITS[0] or mean > LIMITS[1]
