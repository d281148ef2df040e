"""MTP speculation on the CUDA runner (issue 43): DeepSeek-V3's 5-layer cut at its published widths
(gpu_families' deepseek-v3-l5: 3 dense + 2 MoE layers, 32 routed experts) declaring one MTP layer
(num_nextn_predict_layers 1: an MoE layer at index 5 with enorm / hnorm / eh_proj / shared_head),
config-only with --load-format dummy. infc/backend.py builds (here: reuses, after
tests/gpu/prepare.py mtp) the target with its last hidden state as a plan output and the MTP
layer's own artifact, and runs the layer on a CudaRunner of its own beside the target's, its
embedding, final norm and lm_head the target's device copies. Random weights draft near chance,
so the case checks exactness and the machinery's cost, not speedup.

Opt-in (`-m mtp`, tests/gpu/conftest.py): its artifacts are not in prepare.py's default parts."""
import pytest

from infc.runtime.engine.sampling import SamplingParams
from test_spec_gpu import acceptance, config_dir, decode_all, draft_prompts, head_timings

MTP_CUT = "deepseek-v3-l5-mtp"          # tests/gpu/prepare.py's MTP_CUT
MTP_K = 3                               # prepare.py builds the target for this k (narrow_tokens_for)
SHARED = ("embed", "final_norm", "lm_head")
GREEDY = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)]


NEAR_TIE = 0.2        # nat: the golden gates' argmax regret bound (tests/gpu/test_golden.py LIMITS)


def first_divergences(runner, prompts, plain: dict, got: dict) -> list:
    """For each request whose tokens leave plain decoding's: (request, first differing position,
    (regret of plain's token, regret of the speculative token), a random token's median regret),
    regrets from the target's own batch-1 logits over the prompt and the tokens both share (the
    engine's pages are all free by then: this borrows the first ones)."""
    import numpy as np
    from infc.runtime.engine.step import Chunk, build_step
    out = []
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        a, b = plain[rid], got[rid]
        if a == b:
            continue
        at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert at < min(len(a), len(b)), (rid, len(a), len(b))        # one is not a prefix of the other
        ctx = prompt + a[:at]
        pages = list(range(-(-len(ctx) // runner.page_size)))
        logits = runner.logits(build_step([Chunk(0, ctx, 0)], lambda _: pages, runner.page_size))[0].astype(np.float64)
        top = logits.max()
        out.append((rid, at, (float(top - logits[a[at]]), float(top - logits[b[at]])), float(np.median(top - logits))))
    return out


@pytest.mark.mtp
def test_mtp_outputs_are_plain_decodings():
    """Greedy outputs with the MTP layer are plain decoding's on the same target (up to near-ties
    that a verify step's row count tips: first_divergences); the layer's runner its own (its pages
    the target's count), its shared tensors the target's pointers, nothing held after; then the
    batch-1 time per token, plain and with the layer at k = 1..3."""
    from infc import LLM
    d = config_dir(MTP_CUT)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d}: no config-only directory: run tests/gpu/prepare.py mtp and carry "
                                f".cache/gpu/configs/{MTP_CUT} and its artifacts (.cache/artifacts/{MTP_CUT}*)")
    kw = dict(device="cuda", load_format="dummy", max_num_seqs=8, gpu_memory_utilization=0.5)
    spec = {"method": "mtp", "num_speculative_tokens": MTP_K}
    with LLM(d, **kw) as llm:
        prompts = draft_prompts(llm.runner.vocab_size)
        plain = decode_all(llm.engine, prompts, GREEDY)
    lines = []
    with LLM(d, speculative_config=spec, log=lines.append, **kw) as llm:
        e, mr = llm.engine, llm.engine.spec.draft.runner
        print("\n".join(x for x in lines if "split" in x or "speculative" in x or "MTP" in x))
        assert "aux_hidden" in llm.runner.plan["outputs"] and mr is not llm.runner
        assert mr.artifact.name == MTP_CUT + "-mtp"
        for name in SHARED:
            assert mr.weights.ptr(name, None) == llm.runner.weights.ptr(name, None), name
        got = decode_all(e, prompts, GREEDY)
        m = e.metrics
        print(f"MTP layer: acceptance {acceptance(e):.3f} ({m.spec_decode_num_accepted_tokens_total} of "
              f"{m.spec_decode_num_draft_tokens_total}), forwards {e.spec.draft.forwards}")
        assert m.spec_decode_num_draft_tokens_total > 0
        assert mr.num_pages == llm.runner.num_pages
        assert e.bm.num_free_pages == llm.runner.num_pages and e.spec.draft.held_pages() == 0
        # the same tokens, but where a verify step's rows (another T: other kernels, another sum
        # order in bf16) tip a near-tie of this MoE model's random logits the other way
        for rid, at, regrets, chance in first_divergences(llm.runner, prompts, plain, got):
            print(f"{rid} leaves plain decoding at token {at}: regret plain / speculative "
                  f"{regrets[0]:.3f} / {regrets[1]:.3f} nat (a random token's median {chance:.2f})")
            assert chance > 5 * NEAR_TIE, "the logits are too flat for this check to catch a wrong token"
            assert max(regrets) <= NEAR_TIE, (rid, at, regrets)
        head_timings(llm.runner, mr, llm.max_len, spec, f"{MTP_CUT} (dummy weights), MTP layer (random)")
