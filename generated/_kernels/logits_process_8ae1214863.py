# logits_process: vLLM's logits processing, in place on the step's logits, called by the runtime
# after the log_softmax copy (logprobs stay the model's) and before argmax / sample.
# Parameters, in order (R = the rows that have any processing; the grid is R x NCHUNK programs,
# NCHUNK = 4 slices of CHUNK = 16384 tokens: a row's mask pass is spread over many SMs):
#   logits_ptr    f32 [B, V]    in:0    (V = 51200), written in place
#   row_ptr       i32 [R]       in:1    the logits row of program r
#   rep_ptr       f32 [R]       in:2    repetition penalty (1: off)
#   freq_ptr      f32 [R]       in:3    frequency penalty (0: off)
#   pres_ptr      f32 [R]       in:4    presence penalty (0: off)
#   start_ptr     i32 [R + 1]   in:5    row r's entries are start[r] .. start[r + 1] - 1
#   tok_ptr       i32 [E]       in:6    an entry's token id (distinct within a row)
#   count_ptr     i32 [E]       in:7    its occurrences in the output
#   flag_ptr      i32 [E]       in:8    bit 0: in the prompt; bit 1: banned
#   bias_ptr      f32 [E]       in:9    its logit_bias (0: none)
#   mask_row_ptr  i32 [R]       in:10   row r's bitmask row, -1: none
#   mask_ptr      i32 [M, W]    in:11   bitmasks (W = 1600): bit v % 32 of word v // 32 set = v allowed
#
# Math (runtime/engine/logits_process.py, vLLM's order), per entry t of row r, x = logits[b, t]:
#   x = -inf if banned or not allowed by the mask, else
#   x += bias;  if in prompt or count > 0: x *= (1 / rep if x > 0 else rep)
#   x -= freq * count;  x -= pres * (count > 0)
# then, for a row with a mask, x = -inf at every v the mask does not allow (one pass over V,
# program (r, c) taking slice c; the entries are program (r, 0)'s).
# Tokens outside the entries and the mask are untouched: a row pays for its entries, not for V,
# unless it has a mask. The entry pass writes -inf at the masked tokens it touches, as the mask
# pass does, so the two passes' writes agree whatever order their warps run in.
import triton
import triton.language as tl


@triton.jit
def logits_process(logits_ptr, row_ptr, rep_ptr, freq_ptr, pres_ptr, start_ptr, tok_ptr, count_ptr,
                   flag_ptr, bias_ptr, mask_row_ptr, mask_ptr, V: tl.constexpr, W: tl.constexpr,
                   BLOCK: tl.constexpr, EBLOCK: tl.constexpr, CHUNK: tl.constexpr):
    r = tl.program_id(0)
    chunk = tl.program_id(1)
    row = logits_ptr + tl.load(row_ptr + r).to(tl.int64) * V
    mrow = tl.load(mask_row_ptr + r)
    masks = mask_ptr + tl.maximum(mrow, 0).to(tl.int64) * W
    rep = tl.load(rep_ptr + r)
    inv = 1.0 / rep
    freq = tl.load(freq_ptr + r)
    pres = tl.load(pres_ptr + r)
    lo = tl.load(start_ptr + r)
    hi = tl.load(start_ptr + r + 1)
    hi = tl.where(chunk == 0, hi, lo)           # the entries: slice 0's program only
    eoffs = tl.arange(0, EBLOCK)
    has_mask = (eoffs * 0 + mrow) >= 0
    for e0 in range(lo, hi, EBLOCK):
        e = e0 + eoffs
        m = e < hi
        t = tl.load(tok_ptr + e, mask=m, other=0)
        c = tl.load(count_ptr + e, mask=m, other=0)
        fl = tl.load(flag_ptr + e, mask=m, other=0)
        x = tl.load(row + t, mask=m, other=0.0) + tl.load(bias_ptr + e, mask=m, other=0.0)
        seen = ((fl & 1) != 0) | (c > 0)
        x = tl.where(seen, x * tl.where(x > 0, inv, rep), x)
        x = x - freq * c.to(tl.float32)
        x = x - pres * (c > 0).to(tl.float32)
        word = tl.load(masks + t // 32, mask=m & has_mask, other=-1)
        off = ((fl & 2) != 0) | (((word >> (t % 32)) & 1) == 0)
        tl.store(row + t, tl.where(off, float("-inf"), x), mask=m)
    if mrow >= 0:
        offs = tl.arange(0, BLOCK)
        neg = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        for start in range(0, CHUNK, BLOCK):
            cols = chunk * CHUNK + start + offs
            word = tl.load(masks + cols // 32, mask=cols < V, other=-1)
            tl.store(row + cols, neg, mask=(cols < V) & (((word >> (cols % 32)) & 1) == 0))


META = {
    "entry": "logits_process",
    "params": [["logits_ptr", "*fp32", "in:0"], ["row_ptr", "*i32", "in:1"], ["rep_ptr", "*fp32", "in:2"],
               ["freq_ptr", "*fp32", "in:3"], ["pres_ptr", "*fp32", "in:4"], ["start_ptr", "*i32", "in:5"],
               ["tok_ptr", "*i32", "in:6"], ["count_ptr", "*i32", "in:7"], ["flag_ptr", "*i32", "in:8"],
               ["bias_ptr", "*fp32", "in:9"], ["mask_row_ptr", "*i32", "in:10"], ["mask_ptr", "*i32", "in:11"]],
    "constexprs": {"V": 51200, "W": 1600, "BLOCK": 4096, "EBLOCK": 256, "CHUNK": 16384},
    "grid": ["B", 4, 1],
    "num_warps": 8,
    "num_stages": 1,
}
