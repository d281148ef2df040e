# sample_argmax (greedy decoding), called by the runtime on the step's logits.
# Parameters, in order:
#   logits_ptr  f32 [B, V]   in:0    (V = 151552)
#   token_ptr   i32 [B]      out:0   device memory: the next step's tokens are copied from it
#   token_host  i32 [B]      out:1   the same ids into mapped host memory, where the runtime reads
#                                    them: no copy queued on a copy engine a KV save keeps busy
#   token[b] = argmax_v logits[b, v]; ties -> the lowest index (NaN never wins).
# One program per row, looping over V in BLOCK columns: each lane keeps its best value and the
# first index holding it (indices rise along a lane, so a strict > keeps the earliest), then the
# lanes reduce to the max and the lowest index among the lanes holding it.
import triton
import triton.language as tl


@triton.jit
def sample_argmax(logits_ptr, token_ptr, token_host, V: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = logits_ptr + b.to(tl.int64) * V
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_i = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        x = tl.load(row + cols, mask=cols < V, other=float("-inf"))
        take = x > best
        best = tl.where(take, x, best)
        best_i = tl.where(take, cols, best_i)
    m = tl.max(best, axis=0)
    token = tl.min(tl.where(best == m, best_i, V), axis=0)
    tl.store(token_ptr + b, token)
    tl.store(token_host + b, token)


META = {
    "entry": "sample_argmax",
    "params": [["logits_ptr", "*fp32", "in:0"], ["token_ptr", "*i32", "out:0"],
               ["token_host", "*i32", "out:1"]],
    "constexprs": {"V": 151552, "BLOCK": 4096},
    "grid": ["B", 1, 1],
    "num_warps": 16,
    "num_stages": 1,
}
