"""Mixed rows of logits processing for the sampler's tests (interpreter, fake device, GPU): a
row with each kind of processing, one with all of them, one with none, a prefill chunk (None)."""
import numpy as np

from infc.runtime.engine.logits_process import Penalties, pack_bitmask
from infc.runtime.engine.runner import RowSampling
from infc.runtime.engine.sampling import SamplingParams


def mixed_rows(gen, V, scale=1):
    """Six rows; scale multiplies the entries (the GPU test's vocabulary is 400x larger)."""
    def pen(rep, freq, pres, n):
        ids = gen.choice(V, n, replace=False).astype(np.int32)
        counts = gen.integers(0, 4, n).astype(np.int32)
        in_prompt = gen.random(n) < 0.5
        in_prompt[counts == 0] = True              # an entry is a prompt or an output token
        return Penalties(rep, freq, pres, ids, counts, in_prompt)
    mask = pack_bitmask(gen.choice(V, 40 * scale, replace=False), V)
    bias = {int(t): float(gen.uniform(-100, 100)) for t in gen.choice(V, 12 * scale, replace=False)}
    p = SamplingParams
    return [
        RowSampling(p(repetition_penalty=1.7), 0, 0, penalties=pen(1.7, 0.0, 0.0, 50 * scale)),
        None,                                                           # a prefill chunk
        RowSampling(p(), 0, 0),                                         # nothing: untouched
        RowSampling(p(frequency_penalty=0.9, presence_penalty=-1.3, logit_bias=bias), 0, 0,
                    banned=(3, V - 1), penalties=pen(1.0, 0.9, -1.3, 70 * scale)),
        RowSampling(p(), 0, 0, bitmask=mask),                           # a grammar's mask alone
        RowSampling(p(repetition_penalty=0.6, logit_bias=bias, allowed_token_ids=[1]), 0, 0, banned=(7,),
                    allowed=pack_bitmask(range(0, V, 3), V), bitmask=mask, penalties=pen(0.6, 2.0, 2.0, 120 * scale)),
    ]
