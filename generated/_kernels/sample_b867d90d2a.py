# sample: one token per row from the filtered distribution, called by the runtime on the
# step's logits. Parameters, in order:
#   logits_ptr       f32 [B, V]  in:0    (V = 120832)
#   temperature_ptr  f32 [B]     in:1    0 -> greedy (argmax, lowest index on ties)
#   top_k_ptr        i32 [B]     in:2    0 (or >= V) -> off
#   top_p_ptr        f32 [B]     in:3    1 -> off
#   min_p_ptr        f32 [B]     in:4    0 -> off
#   seed_ptr         i64 [B]     in:5    the random stream is a function of (seed, step) only
#   step_ptr         i32 [B]     in:6
#   token_ptr        i32 [B]     out:0   device memory: the next step's tokens are copied from it
#   token_host       i32 [B]     out:1   the same ids into mapped host memory (the runtime reads
#                                        them there: no copy behind a KV save on a copy engine)
#   B                i32         dim:B
#
# Math (runtime/sampling.py filtered_probs, vLLM's order), per row with temperature t > 0,
# e[v] = exp((logit[v] - max) / t):
#   top-k: keep logit >= the k-th largest logit (ties at the k-th value all kept)
#   top-p: on the top-k distribution sorted descending, keep a token while the mass strictly
#          before it is < top_p: v is kept iff sum(e[u] : u in top-k, logit[u] > logit[v])
#          < top_p * sum(e over top-k)  (so a tied group straddling the boundary is kept whole;
#          the sorted reference keeps its lower indices)
#   min-p: keep e[v] >= min_p  (p >= min_p * max p)
# No sort. Tokens are compared through key(logit), an int32 of the same order.
#   top-k threshold: the k-th largest key. One row per program: radix select, 4 passes, each a
#     histogram of the next 8 key bits among the tokens matching the bits chosen so far. Several
#     rows per program (the interpreter tests): a search evaluating SPLIT = 4 thresholds per pass.
#   draw: inverse CDF over the candidates C = top-k set, min-p set, key >= lo, in lane-major
#     order (token v is in lane v % BLOCK; a lane's tokens by index): u = 53 bits of words 0 and
#     1 of Philox4x32-10(key = seed, counter = (round, step, 0, 0)); the lane whose prefix sum
#     of e (fp64, over lane masses from the previous pass) passes u * total, then the token in
#     that lane where its running sum passes the rest (a gather of V / BLOCK tokens).
#   top-p by rejection: a draw j from C (a superset of the kept set) is accepted when j is in the
#     top-p set; otherwise no token at or below key(j) is kept either, so lo = key(j) + 1 and the
#     next round draws again. Accepted draws follow e restricted to the kept set exactly; the
#     first round accepts with probability >= top_p.
# Passes over V: 1 with no filter (max and lane sums of e online), + 1 for min-p or top-k (+ 4
# radix passes of RBLOCK = 8192 for top-k), + 1 check per top-p round. The drawn token
# is a function of (seed, step, logits, parameters) for a given BLOCK (the draw order).
# One program per ROWS = 1 rows, [ROWS, BLOCK] tiles (the interpreter tests use many rows per
# program; the GPU one).
import triton
import triton.language as tl


@triton.jit
def _key(x):
    # float -> int32 of the same order (non-NaN): negative floats get their magnitude bits flipped
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _kth_key(row_ptr, k, V: tl.constexpr, BLOCK: tl.constexpr):
    # one row: the k-th largest key (radix select, 8 bits per pass, from the top)
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 256)
    prefix = tl.full([], 0, dtype=tl.uint32)      # chosen high bits of the order-preserving u32 key
    need = k                                    # rank still to find among the tokens matching prefix
    for shift in tl.static_range(24, -1, -8):
        hist = tl.zeros([256], dtype=tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + offs
            l = tl.load(row_ptr + cols, mask=cols < V, other=0.0)
            u = _key(l).to(tl.uint32, bitcast=True) ^ 0x80000000
            match = (cols < V) & ((u >> shift) >> 8 == (prefix >> shift) >> 8)
            hist += tl.histogram(((u >> shift) & 255).to(tl.int32), 256, mask=match)
        # above[v] = tokens whose digit is > v; the k-th largest has the largest digit v with
        # above[v] + hist[v] >= need
        above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)
        v = tl.sum((above + hist >= need).to(tl.int32), axis=0) - 1
        need -= tl.sum(tl.where(bins == v, above, 0), axis=0)
        prefix |= v.to(tl.uint32) << shift
    return (prefix ^ 0x80000000).to(tl.int32, bitcast=True)


@triton.jit
def _kth_key_rows(logits_ptr, base, rmask, k, hi, ROWS: tl.constexpr, V: tl.constexpr, BLOCK: tl.constexpr,
                  NT: tl.constexpr):
    # several rows: the largest key t with count(key >= t) >= k, searching [INT32_MIN, hi];
    # rows with hi == INT32_MIN are done. Each pass evaluates NT thresholds per row.
    offs = tl.arange(0, BLOCK)
    jj = tl.arange(0, NT)
    lo = tl.full([ROWS], -2147483648, dtype=tl.int64)
    hi = hi.to(tl.int64)
    while tl.max(hi - lo, axis=0) > 0:
        live = lo < hi
        step = tl.maximum((hi - lo + NT) // (NT + 1), 1)
        ts = tl.minimum(lo[:, None] + (jj[None, :] + 1).to(tl.int64) * step[:, None], hi[:, None])
        acc = tl.zeros([ROWS, BLOCK, NT], dtype=tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + offs
            valid = rmask[:, None] & (cols < V)[None, :]
            kk = _key(tl.load(logits_ptr + base[:, None] + cols[None, :], mask=valid, other=0.0))
            acc += (valid[:, :, None] & (kk[:, :, None] >= ts.to(tl.int32)[:, None, :])).to(tl.int32)
        n_ok = tl.sum((tl.sum(acc, axis=1) >= k[:, None]).to(tl.int32), axis=1)     # a prefix of the NT
        new_lo = tl.sum(tl.where(jj[None, :] == n_ok[:, None] - 1, ts, 0), axis=1)
        new_hi = tl.sum(tl.where(jj[None, :] == n_ok[:, None], ts - 1, 0), axis=1)
        lo, hi = tl.where(live & (n_ok > 0), new_lo, lo), tl.where(live & (n_ok < NT), new_hi, hi)
    return lo.to(tl.int32)


@triton.jit
def sample(logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seed_ptr, step_ptr, token_ptr, token_host, B,
           V: tl.constexpr, BLOCK: tl.constexpr, TILES: tl.constexpr, RBLOCK: tl.constexpr, NT: tl.constexpr,
           ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < B
    base = rows.to(tl.int64) * V
    offs = tl.arange(0, BLOCK)
    temperature = tl.load(temperature_ptr + rows, mask=rmask, other=0.0)
    sampling = temperature > 0.0
    inv_t = 1.0 / tl.where(sampling, temperature, 1.0)
    top_k = tl.load(top_k_ptr + rows, mask=rmask, other=0)
    top_p = tl.load(top_p_ptr + rows, mask=rmask, other=1.0)
    min_p = tl.load(min_p_ptr + rows, mask=rmask, other=0.0)
    seed = tl.load(seed_ptr + rows, mask=rmask, other=0).to(tl.int64)
    step = tl.load(step_ptr + rows, mask=rmask, other=0).to(tl.int64)
    use_k = sampling & (top_k > 0) & (top_k < V)
    use_p = sampling & (top_p < 1.0)
    use_m = sampling & (min_p > 0.0)
    log_min_p = tl.where(use_m, tl.log(tl.where(use_m, min_p, 1.0)), float("-inf"))

    # pass 1: each lane's max (first index holding it: the greedy token) and sum of
    # exp((l - lane max) / t), rescaled when the max moves: one exp per element
    best = tl.full([ROWS, BLOCK], float("-inf"), dtype=tl.float32)
    best_i = tl.zeros([ROWS, BLOCK], dtype=tl.int32)
    s = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + offs
        valid = rmask[:, None] & (cols < V)[None, :]
        l = tl.load(logits_ptr + base[:, None] + cols[None, :], mask=valid, other=float("-inf"))
        take = l > best
        gap = tl.where((l == float("-inf")) | (best == float("-inf")), float("inf"), tl.abs(l - best))
        d = tl.exp(-gap * inv_t[:, None])
        s = tl.where(take, s * d + 1.0, s + d)
        best = tl.where(take, l, best)
        best_i = tl.where(take, cols[None, :], best_i)
    lmax = tl.max(best, axis=1)
    token = tl.min(tl.where(best == lmax[:, None], best_i, V), axis=1)
    lmax = tl.where(rmask, lmax, 0.0)
    mass = s * tl.exp((best - lmax[:, None]) * inv_t[:, None])          # per lane: sum of e

    if tl.max(sampling.to(tl.int32), axis=0) > 0:
        # top-k threshold tk (keys >= tk are in the top-k set)
        tk = tl.full([ROWS], -2147483648, dtype=tl.int32)
        if tl.max(use_k.to(tl.int32), axis=0) > 0:
            if ROWS == 1:
                kth = _kth_key(logits_ptr + tl.max(base, axis=0), tl.max(top_k, axis=0), V, RBLOCK)
            else:
                kth = _kth_key_rows(logits_ptr, base, rmask, top_k, tl.where(use_k, _key(lmax), tk), ROWS, V, BLOCK, NT)
            tk = tl.where(use_k, kth, tk)
        # z_k: the top-k set's mass (top-p's denominator); mass: the candidates' per lane
        z_k = tl.sum(mass, axis=1)
        if tl.max((use_k | use_m).to(tl.int32), axis=0) > 0:
            acc_k = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
            mass = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
            for start in range(0, V, BLOCK):
                cols = start + offs
                valid = rmask[:, None] & (cols < V)[None, :]
                l = tl.load(logits_ptr + base[:, None] + cols[None, :], mask=valid, other=float("-inf"))
                x = (l - lmax[:, None]) * inv_t[:, None]
                e = tl.where(valid & (_key(l) >= tk[:, None]), tl.exp(x), 0.0)
                acc_k += e
                mass += tl.where(x >= log_min_p[:, None], e, 0.0)
            z_k = tl.sum(acc_k, axis=1)

        # draw rounds. Inverse CDF over the candidates in lane-major order (lane, then tile): the
        # 53-bit target picks a lane from the prefix sums of the lanes' masses (fp64), then the
        # token among that lane's TILES tokens (a gather, no pass over V). Top-p rows check the
        # draw and, when it is not kept, draw again above it.
        lo = tk
        done = ~sampling
        rnd = tl.zeros([ROWS], dtype=tl.int32)         # round, per row (the same for all)
        while tl.max((~done).to(tl.int32), axis=0) > 0:
            r0, r1, _, _ = tl.randint4x(seed, (step << 32) | rnd)
            u = ((r0.to(tl.uint64) << 21) | (r1 >> 11).to(tl.uint64)).to(tl.float64) * (1.0 / 9007199254740992.0)
            prefix = tl.cumsum(mass.to(tl.float64), axis=1)
            target = u * tl.max(prefix, axis=1)
            lane = tl.minimum(tl.sum((prefix <= target[:, None]).to(tl.int32), axis=1), BLOCK - 1)
            rest = target - tl.sum(tl.where(offs[None, :] == lane[:, None], prefix - mass.to(tl.float64), 0.0), axis=1)
            g_cols = lane[:, None] + tl.arange(0, TILES)[None, :] * BLOCK     # the lane's tokens
            g_valid = rmask[:, None] & (g_cols < V)
            g_l = tl.load(logits_ptr + base[:, None] + g_cols, mask=g_valid, other=float("-inf"))
            g_x = (g_l - lmax[:, None]) * inv_t[:, None]
            g_cand = g_valid & (_key(g_l) >= lo[:, None]) & (g_x >= log_min_p[:, None])
            run = tl.cumsum(tl.where(g_cand, tl.exp(g_x), 0.0).to(tl.float64), axis=1)
            j = tl.min(tl.where(g_cand & (run > rest[:, None]), g_cols, V), axis=1)
            last = tl.max(tl.where(g_cand, g_cols, -1), axis=1)
            j = tl.where(j < V, j, last)                   # rounding can leave rest above the lane's sum
            # never loop forever (NaN logits break the invariants; valid rows end in ~log2(V) rounds
            # at worst): round 64 or no candidate takes the draw, or the greedy token
            accept = ~use_p | (j < 0) | (rnd >= 63)
            if tl.max((use_p & ~done).to(tl.int32), axis=0) > 0:
                kj = _key(tl.load(logits_ptr + base + tl.maximum(j, 0), mask=rmask & ~done, other=0.0))
                acc_m = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
                acc_c = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
                for start in range(0, V, BLOCK):
                    cols = start + offs
                    valid = rmask[:, None] & (cols < V)[None, :]
                    l = tl.load(logits_ptr + base[:, None] + cols[None, :], mask=valid, other=float("-inf"))
                    x = (l - lmax[:, None]) * inv_t[:, None]
                    kk = _key(l)
                    e = tl.where(valid & (kk > kj[:, None]) & (kk >= tk[:, None]), tl.exp(x), 0.0)
                    acc_m += e
                    acc_c += tl.where((kk >= lo[:, None]) & (x >= log_min_p[:, None]), e, 0.0)
                accept = accept | (tl.sum(acc_m, axis=1) < top_p * z_k)
                lo = tl.where(done | accept, lo, kj + 1)
                mass = tl.where((done | accept)[:, None], mass, acc_c)
            token = tl.where(~done & accept & (j >= 0), j, token)
            done = done | accept
            rnd += 1
    tl.store(token_ptr + rows, token, mask=rmask)
    tl.store(token_host + rows, token, mask=rmask)


META = {
    "entry": "sample",
    "params": [["logits_ptr", "*fp32", "in:0"], ["temperature_ptr", "*fp32", "in:1"], ["top_k_ptr", "*i32", "in:2"],
               ["top_p_ptr", "*fp32", "in:3"], ["min_p_ptr", "*fp32", "in:4"], ["seed_ptr", "*i64", "in:5"],
               ["step_ptr", "*i32", "in:6"], ["token_ptr", "*i32", "out:0"], ["token_host", "*i32", "out:1"],
               ["B", "i32", "dim:B"]],
    "constexprs": {"V": 120832, "BLOCK": 8192, "TILES": 16, "RBLOCK": 8192, "NT": 4, "ROWS": 1},
    "grid": ["cdiv(B, 1)", 1, 1],
    "num_warps": 32,
    "num_stages": 1,
}
