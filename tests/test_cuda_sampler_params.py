"""The GPU sampler packs each row's parameters for the sample kernel (int32 top_k): a top_k at or
above the vocabulary is off there (0), so no request's top_k, however large, overflows the
packing and fails the step (issue 39). Runs on the fake CUDA driver."""
import numpy as np

from infc.runtime.engine.runner import RowSampling
from infc.runtime.engine.sampling import SamplingParams


def test_top_k_is_packed_within_the_vocabulary(fake_driver):
    from infc.runtime.cuda.sampler import GpuSampler
    s = object.__new__(GpuSampler)
    s.V = 50
    ks = [1, 7, 49, 50, 51, 2**31, 2**63, 10**30, 0]
    rows = [RowSampling(SamplingParams(temperature=0.7, top_k=k), seed=2**64 - 1, step=3) for k in ks]
    packed = s.packed_params(rows + [None])
    assert packed["top_k"].dtype == np.int32
    assert packed["top_k"].tolist() == [1, 7, 49, 0, 0, 0, 0, 0, 0, 0]
    assert packed["seed"].dtype == np.int64 and packed["temperature"][0] == 0.0   # top_k 1: greedy
