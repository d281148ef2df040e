# log_softmax (for logprobs), called by the runtime on the step's logits.
# Parameters, in order:
#   logits_ptr  f32 [B, V]   in:0    (V = 154880)
#   out_ptr     f32 [B, V]   out:0
#   out[b, v] = x[b, v] - m - log(sum_u exp(x[b, u] - m)),  m = max_u x[b, u]    (fp32)
# One program per row: an online pass keeps each lane's running max and rescaled sum of exp,
# then a second pass writes x - logsumexp. Lanes that only saw -inf keep sum 0 (no NaN).
import triton
import triton.language as tl


@triton.jit
def log_softmax(logits_ptr, out_ptr, V: tl.constexpr, BLOCK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * V
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    s = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        x = tl.load(logits_ptr + base + cols, mask=cols < V, other=float("-inf"))
        m_new = tl.maximum(m, x)
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - safe) + tl.exp(x - safe)
        m = m_new
    mx = tl.max(m, axis=0)
    lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), axis=0))
    for start in range(0, V, BLOCK):
        cols = start + offs
        mask = cols < V
        x = tl.load(logits_ptr + base + cols, mask=mask, other=0.0)
        tl.store(out_ptr + base + cols, x - lse, mask=mask)


META = {
    "entry": "log_softmax",
    "params": [["logits_ptr", "*fp32", "in:0"], ["out_ptr", "*fp32", "out:0"]],
    "constexprs": {"V": 154880, "BLOCK": 8192},
    "grid": ["B", 1, 1],
    "num_warps": 16,
    "num_stages": 1,
}
