"""Two builds of one model give the same bits: greedy tokens and the logits of every step, for a
few random prompts, batch 1, the decode steps through the CUDA Graphs as served. For a change that
must not move a number (a prefetch, a launch attribute): it fails on the first differing step.

    python3 tests/gpu/same_tokens.py ARTIFACT_A ARTIFACT_B MODEL_DIR [--tokens 48]
"""
import argparse
import sys

import numpy as np


def run(artifact: str, model_dir: str, prompts: list[list[int]], n_out: int) -> list[tuple]:
    from infc.runtime.cuda.runner import CudaRunner
    from infc.runtime.engine.runner import RowSampling
    from infc.runtime.engine.sampling import SamplingParams
    from infc.runtime.engine.step import Chunk, build_step
    longest = max(len(p) for p in prompts) + n_out
    r = CudaRunner(artifact, model_dir, max_num_batched_tokens=longest, max_num_seqs=8,
                   buckets=[1, 2, 4, 8], num_pages=longest // r_page(artifact) + 64)
    greedy = [RowSampling(SamplingParams(temperature=0.0), 0, 0)]
    out = []
    try:
        for prompt in prompts:
            pages = {0: list(range(-(-longest // r.page_size)))}
            step = lambda toks, start: build_step([Chunk(0, toks, start)], pages.__getitem__, r.page_size)  # noqa: E731
            logits = r.logits(step(prompt, 0)).copy()
            toks, rows = [], [logits[0]]
            tok = int(np.argmax(logits[0]))
            for i in range(n_out):
                toks.append(tok)
                lg = r.logits(step([tok], len(prompt) + i)).copy()
                rows.append(lg[0])
                tok = int(np.argmax(lg[0]))
            out.append((toks, np.stack(rows)))
            # the served path too: the GPU sampler over the graphs
            t = r.execute(step(prompt, 0), greedy)[0].token
            assert t == toks[0], (t, toks[0])
    finally:
        r.close()
    return out


def r_page(artifact: str) -> int:
    import json
    from pathlib import Path
    return int(json.loads((Path(artifact) / "plan.json").read_text())["build"]["page_size"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("model_dir")
    ap.add_argument("--tokens", type=int, default=48)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(100, 150000, n)] for n in (5, 37, 300)]
    ra = run(a.a, a.model_dir, prompts, a.tokens)
    rb = run(a.b, a.model_dir, prompts, a.tokens)
    bad = 0
    for i, ((ta, la), (tb, lb)) in enumerate(zip(ra, rb)):
        same_bits = la.shape == lb.shape and np.array_equal(la.view(np.uint32), lb.view(np.uint32))
        print(f"prompt {i} ({len(prompts[i])} tokens): tokens {'same' if ta == tb else 'DIFFER'}, "
              f"logits of {len(la)} steps {'bit-identical' if same_bits else 'DIFFER'}")
        bad += (ta != tb) + (not same_bits)
    print("same_tokens:", "PASS" if not bad else f"FAIL ({bad})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
