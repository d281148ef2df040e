"""Gated DeltaNet (Qwen3.5's linear-attention layers): its ops, one home.

Semantics are transformers' modeling_qwen3_5.py (Qwen3_5GatedDeltaNet and the functions it
calls); tests/kernels/test_linear_attention.py checks each reference against them (delta_rule_wy,
a form of the rule's own, against the rule: tests/kernels/test_delta_rule_wy.py).

l2_norm(x[..., D], eps=1e-6, dtype=None) -> x * rsqrt(sum(x^2) + eps) over the last axis, fp32 math
    (HF's l2norm, which FLA matches; note it is not x / max(||x||, eps)). The output is x's dtype
    unless dtype names another: HF normalizes Qwen3.5's q and k in fp32 inside the delta rule and
    never rounds them to bf16, so its spec asks for dtype=f32.
gated_rms_norm(x[..., D], z[..., D], weight[D], eps=1e-6) -> HF's Qwen3_5RMSNormGated:
    w * (x * rsqrt(mean(x^2) + eps)) * silu(z), with plain w (initialized to ones, NOT the
    (1 + w) form of Qwen3.5's other norms). HF's order of roundings in a bf16 model:
    round(round(w * round(x * rsqrt(...))) * silu(z_f32)) (the kernel follows it; the reference
    is float32 throughout).
causal_conv1d(x[T, C], weight[C, K], bias[C] optional, activation="silu") -> [T, C]:
    per sequence, per channel c, over the concatenation u = [left context (K-1 rows), new rows]:
        y[t, c] = act(bias[c] + sum_k weight[c, k] * u[t + k, c])      (t = 0 .. n-1)
    (HF's depthwise nn.Conv1d with padding K-1, cut to the new rows). The left context is the
    sequence's slot of cache `conv` [K-1, C] (its last K-1 inputs) when it has tokens cached
    before this step, else zeros; afterwards the slot holds the last K-1 rows of u.
gated_delta_rule(q[T, Hk, Dk], k[T, Hk, Dk], v[T, Hv, Dv], g[T, Hv], beta[T, Hv], scale=None)
    -> o[T, Hv, Dv]: per sequence and v-head h (q/k head h // (Hv / Hk), HF's repeat_interleave),
    state S[Dk, Dv] in fp32, for each token t in order (HF's torch_recurrent_gated_delta_rule):
        S = S * exp(g_t)                                  decay
        S = S + k_t^T (beta_t * (v_t - k_t S))            delta-rule update (k_t S: the decayed read)
        o_t = (q_t * scale) S                             readout after the update
    scale defaults to 1/sqrt(Dk). q and k arrive l2-normalized (the spec applies l2_norm), in
    any float dtype (Qwen3.5's are f32, as HF's; the kernels compute in fp32 either way). The
    initial S is the sequence's slot of cache `recurrent` [Hv, Dk, Dv] (f32) when it has tokens
    cached before this step, else zeros; the final S is written back.
    attrs.gates (set by compiler/passes/fuse_delta_rule.py, never by a spec): the op makes its
    own gates from their projections, and inputs g, beta are those raw a, b with two more after
    them, dt_bias[Hv] and A[Hv] (f32):
        g = A * softplus(a + dt_bias)     f32, as the add / softplus / mul chain it replaces
        beta = sigmoid(b)                 rounded to attrs.gates (the sigmoid's output dtype)
    attrs.qk_norm (compiler/passes/fuse_delta_rule.py too): q and k arrive raw and the op applies
    l2_norm(x, eps=qk_norm) to each first (f32, as the launches it replaces wrote them).
    attrs.has_wy_w / has_wy_u and chunk (compiler/passes/split_delta_rule.py): two inputs more,
    last, W[T, Hv, Dk] and U[T, Hv, Dv] (f32), delta_rule_wy's outputs for the same chunks of
    `chunk` rows; the chunked kernels read them instead of solving each chunk themselves. The
    rule's value is the same: the reference ignores them.
delta_rule_wy(k, v, g, beta[, dt_bias, A], chunk, gates=None, qk_norm=None) -> W[T, Hv, Dk],
    U[T, Hv, Dv] (f32; internal, made by compiler/passes/split_delta_rule.py): the WY form of each
    chunk of the delta rule, per sequence in chunks of `chunk` rows from its first new row, per
    v-head, with G_i = g_1 + .. + g_i the chunk's cumulative log decay:
        A = strict_lower(beta_i k_i . k_j exp(G_i - G_j))     [L, L]
        W = (I + A)^-1 (beta k exp(G)),   U = (I + A)^-1 (beta v)
    (gates and qk_norm as the rule's). A chunk's W and U depend on no state, so every chunk of
    every sequence is solved at once, before the rule's pass over the chunks in order.

Slot caches: a sequence with `cached` tokens before the step (ctx.seqs) reads its slot only when
cached > 0, so a new sequence needs no reset launch. The slot of batch row b is
ctx.meta.state_slots[b] (step metadata `state_slots` [B] i32; kernels take meta:state_slots).
"""
import numpy as np

from .activation import sigmoid, softplus
from .base import expect, op, tt

ACTIVATIONS = (None, "silu")


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _slot(ctx, b) -> int:
    return int(ctx.meta.state_slots[b])


# -- l2_norm ---------------------------------------------------------------------------------

OUT_DTYPES = ("bf16", "f16", "f32")


def l2_norm_infer(types, attrs):
    (x,) = types
    expect(len(x.shape) >= 1, f"l2_norm needs at least one axis, got {x}")
    expect(attrs.get("eps", 1e-6) >= 0, f"l2_norm eps must be >= 0, got {attrs.get('eps')}")
    dtype = attrs.get("dtype")
    expect(dtype is None or dtype in OUT_DTYPES,
           f"l2_norm dtype must be one of {', '.join(OUT_DTYPES)}, got {dtype!r}")
    return [tt(x.shape, dtype or x.dtype)]


def l2_norm(ctx, x, eps=1e-6, dtype=None):
    x = np.asarray(x, np.float32)
    return x * (1.0 / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(eps)))


op(name="l2_norm", tensors=["x"], attrs={"eps": 1e-6, "dtype": None}, infer=l2_norm_infer,
   reference=l2_norm, templates={"triton": "l2_norm"}, strided=True,
   doc="x * rsqrt(sum(x^2) + eps) over the last axis (HF/FLA l2norm); output dtype: x's, or dtype")


# -- gated_rms_norm ----------------------------------------------------------------------------

def gated_rms_norm_infer(types, attrs):
    x, z, w = types
    expect(x.shape == z.shape, f"gated_rms_norm: gate {z} must have the shape of x {x}")
    expect(len(w.shape) == 1 and w.shape[0] == x.shape[-1],
           f"gated_rms_norm weight {w} does not match the last dim of {x}")
    return [x]


def gated_rms_norm(ctx, x, z, w, eps=1e-6):
    x = np.asarray(x, np.float32)
    z = np.asarray(z, np.float32)
    var = np.mean(x * x, axis=-1, keepdims=True)
    return (np.asarray(w, np.float32) * (x / np.sqrt(var + np.float32(eps)))) * _silu(z)


op(name="gated_rms_norm", tensors=["x", "z", "weight"], attrs={"eps": 1e-6},
   infer=gated_rms_norm_infer, reference=gated_rms_norm,
   templates={"triton": "gated_rms_norm"}, strided=True,
   doc="RMSNorm(x) * w * silu(z) (HF Qwen3_5RMSNormGated; plain w)")


# -- causal_conv1d -----------------------------------------------------------------------------

def _conv_caches(types, attrs):
    x, w = types[:2]
    return {"conv": {"kind": "slot", "shape": [w.shape[1] - 1, x.shape[1]], "dtype": "bf16"}}


def causal_conv1d_infer(types, attrs):
    x, w = types[:2]
    expect(len(x.shape) == 2, f"causal_conv1d expects x[T, C], got {x}")
    expect(len(w.shape) == 2 and w.shape[0] == x.shape[1],
           f"causal_conv1d weight must be [C, K] with C = {x.shape[1]}, got {w}")
    expect(isinstance(w.shape[1], int) and w.shape[1] >= 2,
           f"causal_conv1d kernel width K must be >= 2 (the state keeps K-1 rows), got {w.shape[1]}")
    if attrs.get("has_bias"):
        expect(len(types) == 3 and types[2].shape == (x.shape[1],),
               f"causal_conv1d bias must be [{x.shape[1]}], got {types[2:]}")
    expect(attrs.get("activation") in ACTIVATIONS,
           f"causal_conv1d activation must be one of {ACTIVATIONS}, got {attrs.get('activation')!r}")
    return [x]


def causal_conv1d(ctx, x, w, *bias, activation="silu", has_bias=False):
    x = np.asarray(x, np.float32)
    w = np.asarray(w, np.float32)
    K = w.shape[1]
    state = ctx.cache("conv")                            # [num_slots + 1, K-1, C]
    out = np.zeros(x.shape, np.float32)
    for b, start, n, cached in ctx.seqs:
        slot = _slot(ctx, b)
        left = state[slot] if cached > 0 else np.zeros((K - 1, x.shape[1]), np.float32)
        u = np.concatenate([left, x[start:start + n]], axis=0)            # [K-1 + n, C]
        y = sum(w[:, k] * u[k:k + n] for k in range(K))
        if has_bias:
            y = y + np.asarray(bias[0], np.float32)
        out[start:start + n] = _silu(y) if activation == "silu" else y
        state[slot] = u[-(K - 1):]
    return out


op(name="causal_conv1d", tensors=["x", "weight"], optional=["bias"],
   attrs={"activation": "silu"},        # has_bias is set by whoever makes the node, as for linear
   infer=causal_conv1d_infer, reference=causal_conv1d, caches=_conv_caches,
   templates={"triton": {"prefill": "causal_conv1d", "mixed": "causal_conv1d", "decode": "causal_conv1d"}},
   strided=True,
   doc="depthwise causal conv1d over each sequence with its last K-1 inputs in slot cache conv")


# -- gated_delta_rule --------------------------------------------------------------------------

CHUNKS = (16, 32, 64)          # the chunk sizes the chunked kernels take (powers of two, >= 16)


def _chunk_ok(c) -> bool:
    return isinstance(c, int) and not isinstance(c, bool) and c in CHUNKS


def _gates_check(name, types, attrs):
    """types: q|k.., v, g, beta[, dt_bias, A] as the op takes them (attrs.gates: the two weights)."""
    if attrs.get("gates") is not None:
        expect(len(types) == 7 and attrs["gates"] in ("bf16", "f16", "f32"),
               f"{name} with its gates takes a, b, dt_bias, A and a beta dtype; got {types[3:]}")
        for wname, t in (("dt_bias", types[5]), ("A", types[6])):
            expect(t.shape == types[2].shape[1:2] and t.dtype == "f32", f"{name} {wname} must be f32 [Hv], got {t}")
    else:
        expect(len(types) == 5, f"{name} takes q, k, v, g, beta; got {len(types)} inputs")


def _recurrent_caches(types, attrs):
    q, v = types[0], types[2]
    return {"recurrent": {"kind": "slot", "shape": [v.shape[1], q.shape[2], v.shape[2]], "dtype": "f32"}}


def gated_delta_rule_infer(types, attrs):
    q, k, v, g, beta = types[:5]
    wy = bool(attrs.get("has_wy_w"))
    expect(wy == bool(attrs.get("has_wy_u")), "gated_delta_rule takes W and U together (has_wy_w, has_wy_u)")
    _gates_check("gated_delta_rule", types[:len(types) - 2 * wy], attrs)
    if wy:
        W, U = types[-2:]
        expect(_chunk_ok(attrs.get("chunk")), f"gated_delta_rule with W, U needs attrs.chunk in {CHUNKS}, "
               f"got {attrs.get('chunk')!r}")
        expect(W == tt([q.shape[0], v.shape[1], q.shape[2]], "f32") and U == tt(v.shape, "f32"),
               f"gated_delta_rule W, U must be f32 [T, Hv, Dk], [T, Hv, Dv]; got {W}, {U}")
    expect(len(q.shape) == 3 and q.shape == k.shape, f"gated_delta_rule expects q, k [T, Hk, Dk]; got {q}, {k}")
    expect(len(v.shape) == 3 and v.shape[0] == q.shape[0], f"gated_delta_rule expects v [T, Hv, Dv], got {v}")
    expect(v.shape[1] % q.shape[1] == 0, f"v heads {v.shape[1]} not a multiple of q/k heads {q.shape[1]}")
    for name, t in (("g", g), ("beta", beta)):
        expect(t.shape == v.shape[:2], f"gated_delta_rule {name} must be [T, Hv] = {list(v.shape[:2])}, got {t}")
    scale = attrs.get("scale")
    expect(scale is None or scale > 0, f"gated_delta_rule scale must be positive, got {scale}")
    expect(attrs.get("qk_norm") is None or attrs["qk_norm"] >= 0,
           f"gated_delta_rule qk_norm (an eps) must be >= 0, got {attrs.get('qk_norm')}")
    return [tt(v.shape, v.dtype)]


def _gated_inputs(ctx, q, k, g, beta, gate_weights, gates, qk_norm):
    """q, k normalized (qk_norm) and the gates made (gates) as the fused forms define them; f32."""
    if qk_norm is not None:             # q, k raw (the l2 norms fuse_delta_norms took)
        q, k = (None if x is None else l2_norm(ctx, x, qk_norm) for x in (q, k))
    q, k = (None if x is None else np.asarray(x, np.float32) for x in (q, k))
    g, beta = np.asarray(g, np.float32), np.asarray(beta, np.float32)
    if gates is not None:               # g, beta are the raw a, b (the chain fuse_delta_gates took)
        dt_bias, A = (np.asarray(w, np.float32) for w in gate_weights[:2])
        g, beta = softplus(g + dt_bias) * A, sigmoid(beta)
    return q, k, g, beta


def gated_delta_rule(ctx, q, k, v, g, beta, *gate_weights, scale=None, gates=None, qk_norm=None, **_):
    # gate_weights: dt_bias, A (gates), then W, U (has_wy_*), which change nothing here
    q, k, g, beta = _gated_inputs(ctx, q, k, g, beta, gate_weights, gates, qk_norm)
    v = np.asarray(v, np.float32)
    T, hk, dk = q.shape
    hv, dv = v.shape[1:]
    rep = hv // hk
    scale = np.float32(scale if scale is not None else dk ** -0.5)
    qh = np.repeat(q, rep, axis=1) * scale                # [T, Hv, Dk]
    kh = np.repeat(k, rep, axis=1)
    store = ctx.cache("recurrent")                        # [num_slots + 1, Hv, Dk, Dv]
    out = np.zeros(v.shape, np.float32)
    for b, start, n, cached in ctx.seqs:
        slot = _slot(ctx, b)
        S = np.array(store[slot], np.float32) if cached > 0 else np.zeros((hv, dk, dv), np.float32)
        for t in range(start, start + n):
            S = S * np.exp(g[t])[:, None, None]
            kv_mem = np.einsum("hkv,hk->hv", S, kh[t])
            delta = (v[t] - kv_mem) * beta[t][:, None]
            S = S + kh[t][:, :, None] * delta[:, None, :]
            out[t] = np.einsum("hkv,hk->hv", S, qh[t])
        store[slot] = S
    return out


op(name="gated_delta_rule", tensors=["q", "k", "v", "g", "beta"], attrs={"scale": None},
   infer=gated_delta_rule_infer, reference=gated_delta_rule, caches=_recurrent_caches,
   templates={"triton": {"prefill": "gated_delta_rule_chunk", "mixed": "gated_delta_rule_chunk",
                         "decode": "gated_delta_rule_decode"}},
   strided=True, pass_inputs=["dt_bias", "A", "wy_w", "wy_u"],
   doc="gated delta rule (Gated DeltaNet) with per-sequence fp32 state in slot cache recurrent")


# -- delta_rule_wy ------------------------------------------------------------------------------

# the programs that launch it: those whose delta rule runs the chunked kernel
WY_PHASES = ("prefill", "mixed", "short")


def delta_rule_wy_infer(types, attrs):
    k, v = types[0], types[1]
    _gates_check("delta_rule_wy", [k, *types], attrs)
    expect(_chunk_ok(attrs.get("chunk")), f"delta_rule_wy chunk must be one of {CHUNKS}, got {attrs.get('chunk')!r}")
    expect(len(k.shape) == 3 and len(v.shape) == 3 and v.shape[0] == k.shape[0] and v.shape[1] % k.shape[1] == 0,
           f"delta_rule_wy expects k [T, Hk, Dk], v [T, Hv, Dv] with Hv a multiple of Hk; got {k}, {v}")
    return [tt([k.shape[0], v.shape[1], k.shape[2]], "f32"), tt(v.shape, "f32")]


def delta_rule_wy(ctx, k, v, g, beta, *gate_weights, chunk, gates=None, qk_norm=None, **_):
    _, k, g, beta = _gated_inputs(ctx, None, k, g, beta, gate_weights, gates, qk_norm)
    v = np.asarray(v, np.float32)
    hv = v.shape[1]
    kh = np.repeat(k, hv // k.shape[1], axis=1)          # [T, Hv, Dk]
    W = np.zeros(kh.shape, np.float32)
    U = np.zeros(v.shape, np.float32)
    for _b, start, n, _cached in ctx.seqs:
        for c0 in range(0, n, chunk):
            rows = slice(start + c0, start + min(n, c0 + chunk))
            kc, vc = kh[rows].transpose(1, 0, 2), v[rows].transpose(1, 0, 2)     # [Hv, L, D]
            gc, bc = g[rows].T, beta[rows].T                                      # [Hv, L]
            G = np.cumsum(gc, axis=1, dtype=np.float32)
            L = G.shape[1]
            lower = np.tril(np.ones((L, L), bool), -1)
            D = np.exp(np.where(lower, G[:, :, None] - G[:, None, :], -np.inf)).astype(np.float32)
            A = bc[:, :, None] * (kc @ kc.transpose(0, 2, 1)) * D
            X = np.linalg.inv(np.eye(L, dtype=np.float32) + A).astype(np.float32)
            W[rows] = (X @ (kc * (bc * np.exp(G))[:, :, None])).transpose(1, 0, 2)
            U[rows] = (X @ (vc * bc[:, :, None])).transpose(1, 0, 2)
    return W, U


# unread: the rule's reference recomputes W and U's content token by token, so a step's executor
# skips this launch (tests/kernels/test_delta_rule_wy.py checks this reference and its kernel)
op(name="delta_rule_wy", tensors=["k", "v", "g", "beta"], attrs={"chunk": None},
   infer=delta_rule_wy_infer, reference=delta_rule_wy, n_outputs=2, internal=True, unread=True,
   templates={"triton": {"prefill": "delta_rule_wy", "mixed": "delta_rule_wy"}},
   strided=True, pass_inputs=["dt_bias", "A"], phases=WY_PHASES,
   doc="the delta rule's chunks in WY form (W, U), every chunk at once, for the chunked rule")
