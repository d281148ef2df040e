"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual is N = hc_mult streams
[T, N, H] instead of one row [T, H]; each sublayer reads a weighted sum of the streams and writes
its output back into every stream, the streams themselves mixed by a doubly-stochastic matrix.

A sublayer's weights come from its streams through one learned projection (`fn` [(2 + N) N, N H],
kept f32 as the checkpoint's):

hc_mix(x[T, N, H], fn[M, N H], eps) -> mix f32[T, M]:
    rms_norm(x[t] flattened, eps) @ fn^T in float32 (transformers' `F.linear(input_norm(flat.float()),
    fn.float())`). It is `linear(rms_norm(view(x, [T, N * H]), eps=eps), fn)` in one pass, the
    norm's per-row factor taken out of the sum (x @ fn^T * rsqrt(mean(x^2) + eps)): no normalized
    copy of the streams, and no rounding of it to the model's dtype (HF keeps it float).

and the rest:

hc_weights(mix[T, (2 + N) N], base[(2 + N) N], scale[3], iters=I, eps=e)
        -> (pre f32[T, N], post f32[T, N], comb f32[T, N, N]):
    mix | base split as [pre N | post N | comb N x N (row-major: comb[j, k] at 2N + j N + k)];
    pre  = sigmoid(mix_pre * scale[0] + base_pre) + e
    post = 2 sigmoid(mix_post * scale[1] + base_post)
    comb = softmax_k(mix_comb * scale[2] + base_comb) + e, then the Sinkhorn projection onto the
           doubly-stochastic matrices: each column k divided by (sum_j comb[j, k] + e) once,
           then I - 1 times the rows (sum over k) then the columns, each + e in the divisor
           (transformers' DeepseekV4HyperConnection; I = hc_sinkhorn_iters, e = hc_eps).
    N is read from mix's width ((2 + N) N). Why one op and not smaller ones: the spec language has
    no softmax and no reduction over a chosen axis, and the whole thing is (2 + N) N floats a
    token: one launch, every token's matrix in registers.
hc_head_weights(mix[T, N], base[N], scale[1], eps=e) -> pre f32[T, N]:
    sigmoid(mix * scale[0] + base) + e: the hyper head's (DeepseekV4HyperHead) collapse weights,
    its mix being hc_mix(x, hc_fn, rms_eps) with hc_fn [N, N H].
hc_collapse(x[T, N, H], pre[T, N]) -> [T, H] (x's dtype):
    sum_n pre[t, n] x[t, n, :], fp32 math, one rounding: the sublayer's input (before its norm),
    and after the last layer the hyper head's output.
hc_expand(y[T, H], x[T, N, H], post[T, N], comb[T, N, N]) -> [T, N, H] (x's dtype):
    out[t, k] = post[t, k] y[t] + sum_j comb[t, j, k] x[t, j]: the sublayer's output y written
    into every stream plus the streams mixed (comb is consumed transposed: the sum runs over its
    FIRST axis). fp32 math, one rounding (transformers rounds post and comb to the model's dtype
    and mixes in it; equal in float32).
hc_streams(x[T, H], n=N) -> [T, N, H]: the embedding copied into the N streams (the model's
    first residual).
"""
import numpy as np

from .activation import sigmoid
from .base import REQUIRED, expect, op, tt


def _streams(width) -> int | None:
    """N with (2 + N) N == width, else None."""
    if not isinstance(width, int) or isinstance(width, bool) or width < 3:
        return None
    n = int(round(np.sqrt(1 + width) - 1))
    return n if (2 + n) * n == width else None


def _number(v, who, lo=0.0):
    expect(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= lo,
           f"{who} must be a number >= {lo}, got {v!r}")


def mix_infer(types, attrs):
    expect(len(types) == 2, f"hc_mix takes (x, fn), got {len(types)} tensors")
    x, fn = types
    expect(len(x.shape) == 3 and isinstance(x.shape[1], int) and isinstance(x.shape[2], int),
           f"hc_mix x must be the streams [T, N, H], got {x}")
    k = x.shape[1] * x.shape[2]
    expect(len(fn.shape) == 2 and fn.shape[1] == k,
           f"hc_mix fn must be [M, N * H] = [M, {k}] (one row an output), got {fn}")
    _number(attrs.get("eps"), "hc_mix eps")
    return [tt((x.shape[0], fn.shape[0]), "f32")]


def hc_mix(ctx, x, fn, eps):
    x = np.asarray(x, np.float32).reshape(np.shape(x)[0], -1)
    x = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    return (x @ np.asarray(fn, np.float32).T).astype(np.float32)


def weights_infer(types, attrs):
    expect(len(types) == 3, f"hc_weights takes (mix, base, scale), got {len(types)} tensors")
    mix, base, scale = types
    expect(len(mix.shape) == 2, f"hc_weights mix must be [T, (2 + N) N], got {mix}")
    n = _streams(mix.shape[1])
    expect(n is not None, f"hc_weights mix width {mix.shape[1]} is not (2 + N) N for any stream count N "
                          f"(hc_mult): mix must be [T, (2 + N) N] (pre | post | comb)")
    expect(tuple(base.shape) == (mix.shape[1],), f"hc_weights base must be [{mix.shape[1]}] (like mix's row), got {base}")
    expect(tuple(scale.shape) == (3,), f"hc_weights scale must be [3] (pre, post, comb), got {scale}")
    it = attrs.get("iters")
    expect(isinstance(it, int) and not isinstance(it, bool) and it >= 1,
           f"hc_weights iters (hc_sinkhorn_iters) must be an int >= 1, got {it!r}")
    _number(attrs.get("eps", 1e-6), "hc_weights eps (hc_eps)")
    T = mix.shape[0]
    return [tt((T, n), "f32"), tt((T, n), "f32"), tt((T, n, n), "f32")]


def sinkhorn(comb, iters, eps):
    """comb [..., N, N] (positive) projected toward the doubly-stochastic matrices as transformers
    does: the columns once, then iters - 1 rounds of rows then columns, eps in every divisor."""
    eps = np.float32(eps)
    comb = comb / (comb.sum(-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdims=True) + eps)
        comb = comb / (comb.sum(-2, keepdims=True) + eps)
    return comb


def hc_weights(ctx, mix, base, scale, iters, eps=1e-6):
    mix, base, scale = (np.asarray(a, np.float32) for a in (mix, base, scale))
    T, n = mix.shape[0], _streams(mix.shape[1])
    e = np.float32(eps)
    pre = sigmoid(mix[:, :n] * scale[0] + base[:n]) + e
    post = 2 * sigmoid(mix[:, n:2 * n] * scale[1] + base[n:2 * n])
    c = (mix[:, 2 * n:] * scale[2] + base[2 * n:]).reshape(T, n, n)
    c = np.exp(c - c.max(-1, keepdims=True))
    comb = sinkhorn(c / c.sum(-1, keepdims=True) + e, iters, e)
    return pre.astype(np.float32), post.astype(np.float32), comb.astype(np.float32)


def head_infer(types, attrs):
    expect(len(types) == 3, f"hc_head_weights takes (mix, base, scale), got {len(types)} tensors")
    mix, base, scale = types
    expect(len(mix.shape) == 2 and isinstance(mix.shape[1], int),
           f"hc_head_weights mix must be [T, N] (N = hc_mult), got {mix}")
    expect(tuple(base.shape) == (mix.shape[1],), f"hc_head_weights base must be [{mix.shape[1]}], got {base}")
    expect(tuple(scale.shape) == (1,), f"hc_head_weights scale must be [1], got {scale}")
    _number(attrs.get("eps", 1e-6), "hc_head_weights eps (hc_eps)")
    return [tt(mix.shape, "f32")]


def hc_head_weights(ctx, mix, base, scale, eps=1e-6):
    mix, base, scale = (np.asarray(a, np.float32) for a in (mix, base, scale))
    return (sigmoid(mix * scale[0] + base) + np.float32(eps)).astype(np.float32)


def collapse_infer(types, attrs):
    expect(len(types) == 2, f"hc_collapse takes (x, pre), got {len(types)} tensors")
    x, pre = types
    expect(len(x.shape) == 3 and isinstance(x.shape[1], int) and isinstance(x.shape[2], int),
           f"hc_collapse x must be the streams [T, N, H], got {x}")
    expect(tuple(pre.shape) == tuple(x.shape[:2]),
           f"hc_collapse pre must be [T, N] = [{x.shape[0]}, {x.shape[1]}] (one weight a stream), got {pre}")
    return [tt((x.shape[0], x.shape[2]), x.dtype)]


def hc_collapse(ctx, x, pre):
    x, pre = np.asarray(x, np.float32), np.asarray(pre, np.float32)
    return np.einsum("tn,tnh->th", pre, x).astype(np.float32)


def expand_infer(types, attrs):
    expect(len(types) == 4, f"hc_expand takes (y, x, post, comb), got {len(types)} tensors")
    y, x, post, comb = types
    expect(len(x.shape) == 3 and isinstance(x.shape[1], int) and isinstance(x.shape[2], int),
           f"hc_expand x must be the streams [T, N, H], got {x}")
    T, n, h = x.shape
    expect(tuple(y.shape) == (T, h), f"hc_expand y (the sublayer's output) must be [T, H] = [{T}, {h}], got {y}")
    expect(tuple(post.shape) == (T, n), f"hc_expand post must be [T, N] = [{T}, {n}], got {post}")
    expect(tuple(comb.shape) == (T, n, n), f"hc_expand comb must be [T, N, N] = [{T}, {n}, {n}], got {comb}")
    return [x]


def hc_expand(ctx, y, x, post, comb):
    y, x, post, comb = (np.asarray(a, np.float32) for a in (y, x, post, comb))
    return (post[:, :, None] * y[:, None, :] + np.einsum("tjk,tjh->tkh", comb, x)).astype(np.float32)


def streams_infer(types, attrs):
    expect(len(types) == 1, f"hc_streams takes one tensor, got {len(types)}")
    (x,) = types
    n = attrs.get("n")
    expect(isinstance(n, int) and not isinstance(n, bool) and n >= 1, f"hc_streams n (hc_mult) must be an int >= 1, got {n!r}")
    expect(len(x.shape) == 2, f"hc_streams x must be [T, H], got {x}")
    return [tt((x.shape[0], n, x.shape[1]), x.dtype)]


def hc_streams(ctx, x, n):
    x = np.asarray(x, np.float32)
    return np.ascontiguousarray(np.broadcast_to(x[:, None, :], (x.shape[0], n, x.shape[1])))


op(name="hc_mix", tensors=["x", "fn"], attrs={"eps": REQUIRED}, infer=mix_infer, reference=hc_mix,
   templates={"triton": "hc_mix"}, doc="mHC: the streams' RMS-normed projection, float32")
op(name="hc_weights", tensors=["mix", "base", "scale"], attrs={"iters": REQUIRED, "eps": 1e-6},
   infer=weights_infer, reference=hc_weights, n_outputs=3, templates={"triton": "hc_weights"},
   doc="mHC: pre / post weights and the Sinkhorn-projected stream mix from the projected streams")
op(name="hc_head_weights", tensors=["mix", "base", "scale"], attrs={"eps": 1e-6},
   infer=head_infer, reference=hc_head_weights, templates={"triton": "hc_weights"},
   doc="mHC hyper head: sigmoid(mix * scale + base) + eps, the last collapse's weights")
op(name="hc_collapse", tensors=["x", "pre"], infer=collapse_infer, reference=hc_collapse,
   templates={"triton": "hc_collapse"}, doc="mHC: the streams' pre-weighted sum, a sublayer's input")
op(name="hc_expand", tensors=["y", "x", "post", "comb"], infer=expand_infer, reference=hc_expand,
   templates={"triton": "hc_expand"}, doc="mHC: post-weighted sublayer output plus the comb-mixed streams")
op(name="hc_streams", tensors=["x"], attrs={"n": REQUIRED}, infer=streams_infer, reference=hc_streams,
   templates={"triton": "hc_streams"}, doc="mHC: the embedding copied into n streams")
