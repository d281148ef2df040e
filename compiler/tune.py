"""`infc tune prepare`: the build-machine half of filling codegen_templates/tuning/<gpu>.json.

Cubins are compiled here (no GPU) and timed on a GPU machine that has no trusted compiler, so
tuning is two commands joined by a folder:

    infc tune prepare --model qwen3-4b --gpu h200     # here: -> .cache/tune/qwen3-4b-h200/
    infc tune run --dir .cache/tune/qwen3-4b-h200 --write codegen_templates/tuning/h200.json

prepare compiles the model's plan, walks the launches of the chosen phases and, for every
distinct (template, shape key) of a template with a candidate grid below, renders one kernel per
candidate tuning dict, compiles them all into <out>/bin/ and writes <out>/manifest.json: per
entry the launch's tensors (symbolic shapes), the step sizes to time it at, and per candidate
its tune dict, kernel id and META. `runtime/cuda/tune_run.py` needs nothing else.

A shape key is symbolic in T and B (one key covers every batch size), so each is timed at
representative sizes: decode at T = B = 1 (`--decode-batches 1,8` adds more; the score is the
geometric mean), wide (decode steps of many sequences) at T = B = 128 and 256
(`--wide-batches`), prefill at T = 1024 tokens of one sequence, mixed at T = 512 over 8 sequences,
short (a prefill of at most plan["short_tokens"] tokens on the decode GEMVs) at T = 32 tokens of
one sequence; a short shape has no table entry until one is tuned, so it renders the defaults;
attention at `--context-len` cached keys per sequence.

Candidates are overlays on what the build renders for a shape today with no per-shape entry
(the table's template-level "default", normally {}, and the entries of the keys a narrow or LoRA
entry lies over: render.tuning_keys): the first candidate is always {} (that baseline), a shape's current table entry is always a candidate too, and a tune dict whose kernel
source equals an earlier candidate's is dropped (it would time the same kernel twice).
"""
import json
import shutil
import subprocess
from pathlib import Path

from infc.compiler.contract.program import launches
from infc.config import DEFAULT_TUNE_VERIFY_ROWS, NARROW_TOKENS_MAX, artifact_tag

from .build import REPO, compile_model, default_page_size, load_tuning
from .codegen.render import EXT, TemplateError, _env, launch_context, render_template, tuning_keys
from .contract.errors import SpecError
from .contract.schema import TUNE_MANIFEST_VERSION as MANIFEST_VERSION

DEFAULT_TEMPLATES = ("gemv", "gemv_act_mul", "gemv_gated", "lm_head_last", "attention_decode",
                     "gemm", "gemm_act_mul", "gemm_gated", "attention_prefill", "attention_mixed",
                     "moe_gate_up", "moe_down", "moe_gate_up_grouped", "moe_down_grouped")
PHASES = ("prefill", "decode", "mixed", "short", "wide", "narrow", "verify")

# --- candidate grids: only keys the template reads (tests check each against its source) -------

# gemv.py.j2 (and gemv_act_mul / gemv_gated / lm_head_last, which include it). Rows <= FMA_T (1 by default)
# take the CUDA-core path, more rows the tensor-core path: a grid varies the path it will time.
# Lists are in priority order: when both paths are timed each contributes its first 5.
# more programs in flight for batch 1 without a split-K merge (BLOCK_N 8 / 4, one split): a kernel
# that only reads W needs ~1000 programs to stream o_proj's 21 MB at its best on an H100
# (experiments/gemv_yardstick.py); more K splits were slower (their merge). These won at batch 1
# (o_proj 10.0 -> 9.7 us, the MoE router 3.4 -> 2.9) but lost at 8 and 64 rows, whose K tiles
# they share (bench/NOTES.md, 2026-11-27 evening)
_GEMV_FMA = [{"BLOCK_N": 16}, {"TARGET_CTAS": 528}, {"BLOCK_N": 8, "SPLIT_K": 1, "FMA_BLOCK_K": 512},
             {"BLOCK_N": 4, "SPLIT_K": 1, "FMA_BLOCK_K": 1024}, {"FMA_BLOCK_K": 128},
             {"BLOCK_N": 16, "FMA_BLOCK_K": 512}, {"num_warps": 8}, {"BLOCK_N": 64, "FMA_BLOCK_K": 128},
             {"TARGET_CTAS": 264}, {"TARGET_CTAS": 792}, {"SPLIT_K": 1}, {"num_warps": 2},
             {"num_stages": 2}]
# first the two that won at 64 rows on qwen3-4b (H100, 2026-11-27: down 25.9 -> 22.1 us with
# BLOCK_K 128, gate|up 42.6 -> 39.0 with 64-row blocks, which read W once there)
_GEMV_DOT = [{"BLOCK_K": 128}, {"BLOCK_T": 64}, {"BLOCK_N_DOT": 128}, {"BLOCK_T": 16},
             {"TARGET_CTAS_DOT": 528}, {"BLOCK_T": 32}, {"BLOCK_N_DOT": 32}, {"TARGET_CTAS_DOT": 132},
             {"SPLIT_K_DOT": 1}, {"num_stages": 3}, {"num_warps": 8},
             # a saturated server's decode (~250 rows): every BLOCK_T-row block streams W again,
             # from HBM once W passes L2 (gate|up's 100 MB at 255 rows took 113 us on an H100)
             {"BLOCK_T": 128, "num_warps": 8}]
# the wide program's decode steps (128-256 rows; its default BLOCK_T is 64): each row block reads
# W once, each column block A once. On qwen3-4b (H100) 128-row blocks won for gate|up, 64 for the
# rest; 256-row blocks lost everywhere (A re-read per 64-column block, 40-100 % slower)
_GEMV_WIDE = [{"BLOCK_T": 128, "num_warps": 8}, {"BLOCK_T": 128, "num_warps": 8, "num_stages": 3},
              {"BLOCK_N_DOT": 128}, {"num_warps": 8}, {"BLOCK_K": 128}, {"TARGET_CTAS_DOT": 132},
              {"TARGET_CTAS_DOT": 528}, {"BLOCK_T": 32}, {"BLOCK_T": 128, "BLOCK_N_DOT": 32},
              {"num_stages": 3}, {"SPLIT_K_DOT": 1},
              # 128 W rows a tile: A's re-reads from L2 halve (qwen3-4b's gate|up at 247 rows on
              # an H200: 67 -> 58 us)
              {"BLOCK_T": 128, "BLOCK_N_DOT": 128, "num_warps": 8, "num_stages": 3}]
# the narrow codes path (triton/_gemv_narrow_codes.j2: a narrow step's fp8 GEMV): FP8_FORM "fma"
# (the default, on CUDA cores: triton/_gemv_fp8_fma.j2) at the tiles the sm_90 SASS ranked next to
# its default, then "dot" (tensor cores) at its W rows a program (fewer programs make A's codes fewer
# times), pipeline depths, W tiles read before the A pass and programs in flight, and the CUDA-core
# path the codes path replaced. Timed before the grid's for a narrow step's quantized launch (one
# that does not take the path renders the same kernel for these and is not timed twice).
# (bench/NOTES.md, issue 42, "the narrow FP8 codes on CUDA cores", "the FP8 narrow GEMVs' fma form
# measured").
_DOT = {"FP8_FORM": "dot"}
# 32 x 256 and 64 x 128 W tiles: 72 and 86-96 registers on sm_90 against the default's (and 32 x
# 512's) 164, so 7 and 5 programs an SM where 3 fit (qwen3-4b-fp8's gate|up: 304 programs on 132
# SMs at 3 an SM; compiled, not yet timed: bench/NOTES.md, issue 42, #14)
_GEMV_NARROW_CODES = [{"BLOCK_N": 32, "FMA_BLOCK_K": 512}, {"BLOCK_N": 16, "FMA_BLOCK_K": 1024}, {"num_warps": 8},
                      {"BLOCK_N": 32, "FMA_BLOCK_K": 256}, {"BLOCK_N": 64, "FMA_BLOCK_K": 128},
                      _DOT, {**_DOT, "BLOCK_N": 128}, {**_DOT, "BLOCK_N": 32}, {**_DOT, "NDOT_STAGES": 3},
                      {**_DOT, "NDOT_STAGES": 6}, {**_DOT, "PRELOAD": 2}, {**_DOT, "PRELOAD": 5},
                      {**_DOT, "TARGET_CTAS": 528}, {**_DOT, "TARGET_CTAS": 792},
                      {**_DOT, "BLOCK_N": 128, "TARGET_CTAS": 528}, {**_DOT, "num_warps": 8}, {"NARROW_DOT": 0}]
# a u4 weight's CUDA-core loop (triton/_gemv_w4.j2, W4_FORM; groupsum by default): the other two
# forms, then groupsum's tile shapes (rows a thread against A's rebuild, preloaded tiles against
# registers: bench/NOTES.md, issue 42). fp8 launches render these as their default and are not
# timed twice.
_GEMV_NARROW_W4 = [{"W4_FORM": "elementwise"}, {"W4_FORM": "dot"}, {"W4_FORM": "dot", "BLOCK_N": 64},
                   {"W4_FORM": "dot", "BLOCK_N": 256}, {"W4_FORM": "dot", "TARGET_CTAS": 528},
                   {"FMA_BLOCK_K": 512, "BLOCK_N": 64}, {"FMA_BLOCK_K": 512}, {"PRELOAD": 2},
                   {"PRELOAD": 0}, {"BLOCK_N": 64}, {"BLOCK_N": 16}]
NARROW_QUANT = {("triton", t): _GEMV_NARROW_CODES + _GEMV_NARROW_W4 for t in ("gemv", "gemv_gated")}
# a narrow step's LoRA site in the GEMV's launch (merge_lora; gemv.py.j2 `lora`, its own table key
# render.lora_key): the shrink's range width (LORA_KS columns: A bytes a claim) and its programs of
# their own (LORA_PROGRAMS), which decide whether the shrink ends inside the W stream (bench/NOTES.md,
# issue 46: qwen3-4b's o and down waited on it at 128 x 16), then the GEMV tiles that most often
# won at batch 1, timed with the site in the launch. Timed before the GEMV grid, in place of most of it.
# LORA_EARLY: the delta's tables loaded before the stream (a round trip less at the tail, registers
# through the stream: sm_90, qwen3-4b's o 80 -> 96, q|k|v and gate|up unchanged). LORA_PARTS 0: a
# summing program and a ready flag (the default 1: the waiters sum the parked ranges); LORA_FIRST 0:
# the shrink's programs after the GEMV's blocks (the default 1: first in the grid). Both act on the
# launch's place in a PDL chain more than alone, so an entry of theirs wants the in-model A/B
# (bench/NOTES.md, issue 46) before it is stored. LORA_SETS is no candidate: the build decides it
# (compiler/codegen/lora_sets.py), and the departures it replaces lost in the model.
_GEMV_LORA = [{"LORA_KS": ks} for ks in (64, 128, 256, 512)] \
    + [{"LORA_KS": ks, "LORA_PROGRAMS": n} for ks in (128, 256, 512) for n in (8, 16, 32)] \
    + [{"LORA_EARLY": 1}, {"LORA_EARLY": 1, "LORA_PROGRAMS": 32}] \
    + [{"LORA_PARTS": 0}, {"LORA_FIRST": 0}, {"LORA_PARTS": 0, "LORA_FIRST": 0}]
NARROW_LORA = {("triton", t): _GEMV_LORA for t in ("gemv", "gemv_gated")}
# a decode step's site (triton/_lora_rows.j2): the items' K range (LORA_KS, default ~K / 16) and the
# columns a dot of it takes (LORA_STEP), the slot chunks in flight (LORA_STAGES), the shrink's own
# programs, and those after the GEMV's blocks (LORA_FIRST 0); LORA_EARLY and LORA_PARTS have no decode form
_GEMV_LORA_ROWS = [{"LORA_KS": ks} for ks in (128, 256, 512)] + [{"LORA_STEP": 32}, {"LORA_STEP": 128}] \
    + [{"LORA_STAGES": n} for n in (1, 2, 4)] + [{"LORA_PROGRAMS": n} for n in (8, 48)] + [{"LORA_FIRST": 0}]
DECODE_LORA = {("triton", t): _GEMV_LORA_ROWS for t in ("gemv", "gemv_gated")}
LORA_GEMV_TILES = 4         # of the GEMV's own grid, the first few beside the LoRA grid
# a verify step's GEMVs (a speculative build's k + 1 rows; their own key, render.verify_key, over
# the one-row narrow entry). The default is the tensor-core path in the form an H100 measured best
# (gemv.py.j2 VERIFY_DOT); "FMA_T": "rows" puts the rows on the CUDA-core path together ("lanes"),
# around which: W tiles against the R rows' sums (ROW_SUMS "lanes" sums each tile's products within
# a thread and across threads once at the end; "chain" as lanes, a run's products one FFMA chain;
# "tile" reduces them across threads every tile; "end" keeps R fp32 tiles in registers, so only
# small tiles; VERIFY_TILE 8192: the one-row 16 x 512 tiles whole), the preloaded tiles, programs in
# flight (bench/NOTES.md, issue 43)
_VL = {"FMA_T": "rows"}
_VT = {"FMA_T": 1, "BLOCK_T": 16, "DOT_PRE": 2}
_GEMV_VERIFY = [_VL] + [{**_VL, **c} for c in (
                {"BLOCK_N": 16, "FMA_BLOCK_K": 256}, {"BLOCK_N": 8, "FMA_BLOCK_K": 512},
                {"BLOCK_N": 32, "FMA_BLOCK_K": 128}, {"BLOCK_N": 4, "FMA_BLOCK_K": 1024, "SPLIT_K": 1},
                {"ROW_SUMS": "end", "BLOCK_N": 8, "FMA_BLOCK_K": 128},
                {"ROW_SUMS": "end", "BLOCK_N": 4, "FMA_BLOCK_K": 256}, {"ROW_SUMS": "tile"}, {"ROW_SUMS": "chain"},
                {"PRELOAD": 2}, {"PRELOAD": 1}, {"num_warps": 8}, {"TARGET_CTAS": 528}, {"TARGET_CTAS": 264},
                {"VERIFY_TILE": 8192})] + [
    # the tensor-core path's own tiles at k + 1 rows: on an H100 FMA_T 1 won o, down and gate|up
    # (BLOCK_K 128: 18.4 -> 11.7 us, 41.1 -> 22.0, 66.9 -> 48.0) and lost q|k|v (23.3 -> 30.1), whose
    # 96 row blocks of 64 leave SMs idle: 16-row A blocks for the few rows, narrower W blocks or more
    # K splits for more programs. These won alone by 4-8 % and lost in the model (verify(4) 4.6-4.8
    # -> 5.0-5.6 ms on an H100, bench/NOTES.md session #10): a verify entry is confirmed by `bench
    # spec-verify` A/B before it is stored
    {"FMA_T": 1, "BLOCK_K": 128, "BLOCK_T": 32, "DOT_PRE": 0}, {"FMA_T": 1, "BLOCK_K": 128, "BLOCK_N_DOT": 32},
    {"FMA_T": 1, "BLOCK_K": 128, "BLOCK_N_DOT": 32, "BLOCK_T": 16}, {"FMA_T": 1, "BLOCK_K": 128, "SPLIT_K_DOT": 4},
    {"FMA_T": 1, "BLOCK_K": 128, "num_stages": 3}, {"FMA_T": 1, "BLOCK_K": 256, "BLOCK_T": 16}] + [
    # the H100 table's entries of 2026-12-07, measured in the model (verify(4) 4.61 -> 4.05 ms): the
    # skinny-GEMM probe's tiles with two W tiles before the PDL wait (DOT_PRE), gate|up unsplit, and
    # the split ones with their partials parked by plain stores (PARK) beside them; the grid of the
    # path the rows take (GRID "paths")
    {**_VT, "BLOCK_K": 128, "SPLIT_K_DOT": 1, "num_stages": 3}, {**_VT, "BLOCK_K": 128, "SPLIT_K_DOT": 4, "num_stages": 3},
    {**_VT, "BLOCK_K": 64, "SPLIT_K_DOT": 8, "num_stages": 4},
    {**_VT, "BLOCK_K": 64, "SPLIT_K_DOT": 8, "num_stages": 4, "PARK": "store"}, {"GRID": "paths"}]
# lm_head_last cannot split K
_LM_VERIFY = [_VL] + [{**_VL, **c} for c in (
              {"BLOCK_N": 8}, {"BLOCK_N": 32, "FMA_BLOCK_K": 256}, {"FMA_BLOCK_K": 256}, {"num_warps": 8},
              {"ROW_SUMS": "end", "BLOCK_N": 8, "FMA_BLOCK_K": 128}, {"ROW_SUMS": "tile"}, {"ROW_SUMS": "chain"},
              {"VERIFY_TILE": 8192})] + [
              {"FMA_T": 1, "BLOCK_T": 16}, {"FMA_T": 1, "BLOCK_K": 128},
              {"FMA_T": 1, "BLOCK_K": 128, "BLOCK_T": 16}, {"FMA_T": 1, "BLOCK_N_DOT": 64}, {"GRID": "paths"}]
VERIFY_GRIDS = {("triton", "gemv"): _GEMV_VERIFY, ("triton", "gemv_act_mul"): _GEMV_VERIFY,
                ("triton", "gemv_gated"): _GEMV_VERIFY, ("triton", "lm_head_last"): _LM_VERIFY}
_GEMV_FMA_T = [{"FMA_T": 2, "FMA_BLOCK_K": 128}, {"FMA_T": 4, "BLOCK_N": 16, "FMA_BLOCK_K": 128}]
# lm_head_last cannot split K (its norm scale closes the K loop) and has a huge N
_LM_FMA = [{"BLOCK_N": 8}, {"BLOCK_N": 32, "FMA_BLOCK_K": 256}, {"FMA_BLOCK_K": 256},
           {"FMA_BLOCK_K": 1024}, {"num_warps": 8}, {"num_warps": 2}, {"num_stages": 2},
           {"num_stages": 4}]
_LM_DOT = [{"BLOCK_N_DOT": 64}, {"BLOCK_N_DOT": 256}, {"BLOCK_T": 16}, {"BLOCK_K": 128},
           {"num_warps": 8}, {"num_stages": 2},
           # 255 rows re-read the 778 MB vocabulary matrix per 32-row block: 1.2 ms on an H100
           {"BLOCK_T": 64}, {"BLOCK_T": 128},
           {"BLOCK_T": 64, "num_warps": 8}, {"BLOCK_T": 128, "num_warps": 8},
           # 128 tokens x 256 vocabulary rows: half the passes over W without the small MMA tile
           # (qwen3-4b at 247 rows on an H200: 750 -> 610 us; 128 x 128 was 859)
           {"BLOCK_T": 128, "BLOCK_N_DOT": 256, "num_warps": 8}]
_GEMM = [{"BLOCK_N": 128}, {"BLOCK_N": 256}, {"BLOCK_M": 64}, {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4},
         {"BLOCK_K": 32}, {"BLOCK_K": 128, "BLOCK_N": 128, "num_stages": 2}, {"GROUP_M": 4},
         {"GROUP_M": 16}, {"num_stages": 3}, {"num_stages": 4}, {"num_warps": 4},
         # the tile loop (TMA persistent by default): bench/experiments/gemm_tma.py found one
         # program per tile faster for the narrow down projection at T = 1024
         {"PERSISTENT": 0}, {"TMA": 0}, {"BLOCK_N": 256, "PERSISTENT": 0}]
# the GEMM's decode tiles (the wide program's plain linears, 128-256 rows; defaults 64 x 128 x 64,
# 8 stages, 4 warps, one program a tile): deeper or shallower pipelines, 128-row tiles (W read
# once for 256 rows), 64-column tiles (more programs), persistent programs, a K split
_GEMM_DECODE = [{"num_stages": 6}, {"num_stages": 4}, {"num_stages": 9},
                {"BLOCK_N": 64, "num_stages": 12}, {"BLOCK_M": 128, "num_warps": 8, "num_stages": 6},
                {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8}, {"BLOCK_K": 128, "num_stages": 4},
                {"PERSISTENT": 1}, {"GROUP_M": 1}, {"SPLIT_K": 2, "TMA": 0, "num_stages": 4}]
_ATTN_DECODE = [{"BLOCK_N": 32}, {"BLOCK_N": 128}, {"NUM_SPLITS": 16}, {"NUM_SPLITS": 64},
                {"TARGET_CTAS": 132}, {"TARGET_CTAS": 528}, {"MERGE_CHUNK": 4}, {"num_warps": 2},
                {"num_warps": 8}, {"num_stages": 1}, {"num_stages": 3},
                # a saturated server's decode (B ~ 64-256, no splits; each program streams ~1k
                # keys). Timed on an H100 (2026-11-27): none beat the default, which streams the
                # KV at ~97 % of the copy bandwidth there
                {"BLOCK_N": 128, "num_stages": 3}, {"BLOCK_N": 128, "num_warps": 8},
                {"num_stages": 4}, {"TARGET_CTAS": 1056}]
_ATTN_PREFILL = [{"BLOCK_M": 64}, {"BLOCK_N": 64}, {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4},
                 {"BLOCK_M": 256, "BLOCK_N": 64}, {"num_warps": 4}, {"num_stages": 2},
                 {"num_stages": 4}, {"BLOCK_B": 64}]
# attention_mixed: the flash role's tiles and the split role's (SPLIT_*, NUM_SPLITS, TARGET_CTAS)
_ATTN_MIXED = [{"SPLIT_BLOCK_N": 32}, {"SPLIT_BLOCK_N": 128}, {"SPLIT_MIN_KEYS": 64},
               {"SPLIT_MIN_KEYS": 1024}, {"num_warps": 4}, {"num_warps": 4, "SPLIT_BLOCK_N": 128},
               {"num_stages": 2}, {"num_stages": 1}, {"TARGET_CTAS": 528}, {"NUM_SPLITS": 64},
               {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4},
               {"SPLIT_BLOCK_N": 128, "num_stages": 3}, {"num_stages": 4}, {"SPLIT_FIRST": 1},
               # two programs an SM (qwen3-4b on an H200: the decode rows at their KV floor beside
               # 16 prompts' flash tiles, 1,100 -> 823 us a layer; bench/NOTES.md ninth session)
               {"BLOCK_N": 64, "num_warps": 4}]
# latent_attention_decode (DeepSeek's absorbed MLA over the latent cache): 33.6 us a layer at
# 1k cached tokens on an H100 (bench/NOTES.md issue 13), its 32 splits merged by one program.
# BLOCK_H 32: DeepSeek-V3's 128 heads in 4 blocks, not the default's 2 (for a model of at most 32
# heads it renders the default kernel)
_LATENT_DECODE = [{"NUM_SPLITS": 8}, {"NUM_SPLITS": 16}, {"NUM_SPLITS": 64}, {"BLOCK_N": 64},
                  {"TARGET_CTAS": 132}, {"TARGET_CTAS": 528}, {"MERGE_CHUNK": 4}, {"MERGE_CHUNK": 16},
                  {"num_warps": 4}, {"num_stages": 3}, {"BLOCK_H": 32}]
# head_linear (MLA's absorbed W_uk / W_uv, a GEMM per head): at batch 1 W_uv's launch is 16 heads x
# 2 blocks of 64 outputs = 32 programs, each streaming 64 KB of its head's 128 x 512 (bench/NOTES.md,
# 2026-11-27): smaller N blocks give it more programs
_HEAD_LINEAR = [{"BLOCK_N": 16}, {"BLOCK_N": 32}, {"BLOCK_N": 16, "BLOCK_K": 128}, {"BLOCK_K": 128},
                {"BLOCK_N": 128}, {"num_warps": 2}, {"num_warps": 8}, {"num_stages": 3}]
_NORM = [{"num_warps": 2}, {"num_warps": 4}, {"num_warps": 8}, {"num_warps": 16}]
_QK_ROPE = [{"BLOCK_H": 1}, {"BLOCK_H": 4}, {"BLOCK_H": 8}, {"BLOCK_T": 2}, {"BLOCK_T": 8},
            {"num_warps": 1}, {"num_warps": 2}, {"num_warps": 4}]
_CUDA_GEMV = [{"KS": 1}, {"KS": 2}, {"KS": 4}, {"MR": 2}, {"UNROLL": 2}, {"UNROLL": 4},
              {"PIPE": 0}, {"PIPE": 1}, {"TT": 64}]

# MoE (compiler/ops/moe.py). Decode: per distinct chosen expert, CUDA-core rows (<= FMA_T tokens of
# an expert: batch 1) or tensor-core tiles (several tokens of an expert: larger batches).
# (MXFP4 experts: maxnreg 0 times the kernel without its register cap, two programs an SM against
# three; on bf16 experts it renders the default and is dropped)
_MOE_GU_FMA = [{"BLOCK_F": 32}, {"FMA_BLOCK_K": 128}, {"FMA_BLOCK_K": 512}, {"num_warps": 8},
               {"BLOCK_F": 32, "FMA_BLOCK_K": 128}, {"num_stages": 1}, {"num_stages": 2},
               {"num_warps": 2}, {"PC": 64}, {"maxnreg": 0}]
_MOE_GU_DOT = [{"FMA_T": 2}, {"BLOCK_T": 32}, {"BLOCK_K": 128}, {"BLOCK_F": 32, "BLOCK_K": 128},
               {"FMA_T": 4, "FMA_BLOCK_K": 128}, {"TC": 64}]
_MOE_DOWN_FMA = [{"BLOCK_H": 32, "num_warps": 4}, {"BLOCK_H": 32}, {"FMA_BLOCK_K": 256},
                 {"BLOCK_H": 128}, {"BLOCK_H": 16, "num_warps": 4}, {"num_warps": 4},
                 {"FMA_BLOCK_K": 64}, {"num_stages": 1}, {"num_stages": 2}, {"maxnreg": 0}]
_MOE_DOWN_DOT = [{"FMA_T": 2}, {"BLOCK_T": 32}, {"BLOCK_K": 128}, {"BLOCK_H": 32, "BLOCK_K": 128},
                 {"FMA_T": 4, "FMA_BLOCK_K": 64}, {"TC": 64}]
# Prefill/mixed grouped GEMMs; short and small mixed steps (a few tokens per expert) try small
# BLOCK_M first.
# (the grouped kernels' defaults are 128 x 256 tiles, BLOCK_K 64, 8 warps, 3 stages: 128-wide K
# steps fit only 2 stages of shared memory; bench/experiments/moe_grouped.py timed these variants
# within 2 % of the defaults or slower on an H100, so the grid keeps the informative ones)
_MOE_GU_GROUPED = [{"BLOCK_M": 64}, {"BLOCK_F": 64}, {"BLOCK_M": 64, "BLOCK_F": 64, "num_warps": 4},
                   {"BLOCK_K": 32}, {"num_stages": 4}, {"num_stages": 2}, {"GROUP_M": 1},
                   {"GROUP_M": 16}, {"num_warps": 4}, {"PAIR": 0}, {"HALF_TAIL": 0},
                   {"BLOCK_M": 64, "BLOCK_F": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}]
_MOE_DOWN_GROUPED = [{"BLOCK_M": 64}, {"BLOCK_H": 128}, {"BLOCK_H": 64},
                     {"BLOCK_M": 64, "BLOCK_H": 128, "num_warps": 4}, {"BLOCK_K": 32},
                     {"BLOCK_K": 128, "num_stages": 2}, {"num_stages": 4}, {"GROUP_M": 1},
                     {"GROUP_M": 16}, {"num_warps": 4}, {"HALF_TAIL": 0}, {"COMBINE_ROWS": 32}]
_MOE_SMALL_M = [{"BLOCK_M": 16, "num_warps": 4}, {"BLOCK_M": 32, "num_warps": 4},
                {"BLOCK_M": 16, "num_warps": 4, "num_stages": 2}]
_MOE_ALIGN = [{"TB": 16}, {"TB": 32}, {"TB": 128}, {"num_warps": 8}, {"num_warps": 2}]
_MOE_ROUTE = [{"num_warps": 1}, {"num_warps": 2}, {"num_warps": 8}]
# expert_upcast.py.j2 (a stream: codes in, bf16 out; GPT-OSS-20B's gate|up at the 32 x 256 default
# moved 1.33 GB in 785 us on an H200, ~1.7 TB/s: bench/NOTES.md). Larger tiles a program, wider
# stores, more warps to cover the dequantization's arithmetic. Not in DEFAULT_TEMPLATES: the
# launch runs at rows past its threshold only (infc/config.py UPCAST_TOKENS_PER_EXPERT):
# prepare(model, phases=("prefill",), templates=["expert_upcast"], prefill_tokens=4096)
_UPCAST = [{"BLOCK_N": 64}, {"BLOCK_N": 16}, {"BLOCK_K": 512}, {"BLOCK_K": 128}, {"num_warps": 8},
           {"BLOCK_N": 64, "num_warps": 8}, {"BLOCK_N": 16, "BLOCK_K": 512}, {"BLOCK_N": 8, "BLOCK_K": 1024},
           {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 8}, {"num_warps": 2}]


def _moe_decode_grid(fma, dot, rows):
    """Batch 1 runs the CUDA-core path only; larger batches both (one token per expert is common)."""
    return fma if max(rows) <= 1 else fma[:6] + dot


def _moe_grouped_grid(grid, rows):
    return _MOE_SMALL_M + grid[:9] if max(rows) <= 64 else grid + _MOE_SMALL_M[:1]


def _gemv_grid(fma, dot, rows, wide=_GEMV_WIDE):
    if min(rows) >= 128:
        return wide
    both = min(rows) <= 1 < max(rows)
    out = []
    if min(rows) <= 1:
        out += fma[:5] if both else fma
    if max(rows) > 1:
        out += dot[:5] if both else dot
        if any(1 < r <= 4 for r in rows):
            out += _GEMV_FMA_T
    return out


GRIDS = {
    ("triton", "gemv"): lambda rows: _gemv_grid(_GEMV_FMA, _GEMV_DOT, rows),
    ("triton", "gemv_act_mul"): lambda rows: _gemv_grid(_GEMV_FMA, _GEMV_DOT, rows),
    ("triton", "gemv_gated"): lambda rows: _gemv_grid(_GEMV_FMA, _GEMV_DOT, rows),
    ("triton", "lm_head_last"): lambda rows: _gemv_grid(_LM_FMA, _LM_DOT, rows, _LM_DOT),
    ("triton", "gemm"): lambda rows: _GEMM_DECODE if max(rows) <= 256 else _GEMM,
    ("triton", "gemm_act_mul"): lambda rows: _GEMM,
    ("triton", "gemm_gated"): lambda rows: _GEMM,
    ("triton", "attention_decode"): lambda rows: _ATTN_DECODE,
    ("triton", "latent_attention_decode"): lambda rows: _LATENT_DECODE,
    ("triton", "head_linear"): lambda rows: _HEAD_LINEAR,
    ("triton", "attention_prefill"): lambda rows: _ATTN_PREFILL,
    ("triton", "attention_mixed"): lambda rows: _ATTN_MIXED,
    ("triton", "add_rms_norm"): lambda rows: _NORM,
    ("triton", "rms_norm"): lambda rows: _NORM,
    ("triton", "qk_norm_rope_cache"): lambda rows: _QK_ROPE,
    ("cuda", "gemv"): lambda rows: _CUDA_GEMV,
    ("triton", "moe_gate_up"): lambda rows: _moe_decode_grid(_MOE_GU_FMA, _MOE_GU_DOT, rows),
    ("triton", "moe_down"): lambda rows: _moe_decode_grid(_MOE_DOWN_FMA, _MOE_DOWN_DOT, rows),
    ("triton", "moe_gate_up_grouped"): lambda rows: _moe_grouped_grid(_MOE_GU_GROUPED, rows),
    ("triton", "moe_down_grouped"): lambda rows: _moe_grouped_grid(_MOE_DOWN_GROUPED, rows),
    ("triton", "moe_align"): lambda rows: _MOE_ALIGN,
    ("triton", "moe_route"): lambda rows: _MOE_ROUTE,
    ("triton", "expert_upcast"): lambda rows: _UPCAST,
}
# i32 inputs whose contents must agree with another input's rather than be random: the grouped
# MoE kernels' per-expert token lists (moe_align's outputs) follow the launch's routing ids.
# op -> (index of the ids input, {input index: which moe_align output})
DERIVED = {"moe_gate_up": (1, {3: "rows", 4: "counts"}), "moe_down": (2, {4: "rows", 5: "counts"})}
# which step dimension is a template's row count (the gemv family picks its path by it):
# lm_head_last's rows are B; the others' are their input's leading dim (T, or B after last())
ROWS_DIM = {"lm_head_last": "B"}


def rows_dim(template: str, inputs: list[dict]) -> str:
    if template in ROWS_DIM:
        return ROWS_DIM[template]
    lead = inputs[0]["shape"][0] if inputs and inputs[0]["shape"] else "T"
    return "B" if lead == "B" else "T"


def candidates(backend: str, template: str, rows=(1,)) -> list[dict]:
    """The candidate tune dicts for a template timed at these row counts; {} (the baseline) first."""
    grid = GRIDS.get((backend, template))
    if grid is None:
        return [{}]
    out = [{}]
    for c in grid(list(rows)):
        if c not in out:
            out.append(dict(c))
    return out


# short steps: the 32-token prompt bench/profile.py's prefill_32 times, and a 16-token suffix over
# the cached context (its prefix_hit: attention_mixed's split role)
SHORT_DIMS = ({"T": 32, "B": 1}, {"T": 16, "B": 1})


def phase_dims(phase: str, decode_batches=(1,), prefill_tokens=1024, mixed=(512, 8),
               wide_batches=(128, 256), verify_rows=DEFAULT_TUNE_VERIFY_ROWS) -> list[dict]:
    """The step sizes a phase's shape keys are timed at."""
    if phase == "verify":           # one verify step of k + 1 rows (each a decode row: T = B)
        return [{"T": int(verify_rows), "B": int(verify_rows)}]
    if phase == "wide":             # decode steps of many sequences (the plan's wide program)
        return [{"T": int(b), "B": int(b)} for b in wide_batches]
    if phase == "short":
        return [dict(d) for d in SHORT_DIMS]
    if phase == "decode":
        return [{"T": int(b), "B": int(b)} for b in decode_batches]
    if phase == "narrow":           # its one-token step (the CUDA-core path that narrow| entries tile)
        return [{"T": 1, "B": 1}]
    if phase == "prefill":
        return [{"T": int(prefill_tokens), "B": 1}]
    if phase == "mixed":
        # one (T, B) or several: B - 1 decode rows and one chunk of the rest
        steps = [mixed] if isinstance(mixed[0], (int, str)) else list(mixed)
        out = []
        for T, B in ((int(t), int(b)) for t, b in steps):
            if T <= B - 1:
                raise SpecError(f"mixed step T={T} needs more tokens than its {B - 1} decode rows", None)
            out.append({"T": T, "B": B})
        return out
    raise SpecError(f"unknown phase '{phase}' (known: {', '.join(PHASES)})", None)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=REPO).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _int_high(name: str, launch_inputs: list[dict], config: dict) -> int:
    """Exclusive upper bound for the random contents of an i32 input: token ids < V, expert ids
    < the stacked experts' count; anything else gets zeros (a valid index everywhere)."""
    if name == "tokens":
        return int(config["V"])
    experts = [t["shape"][0] for t in launch_inputs if t["kind"] == "weight" and len(t["shape"]) == 3]
    return int(experts[0]) if experts else 1


def collect(plan: dict, table: dict, phases, templates, page_size: int) -> list[dict]:
    """One entry per distinct (template, shape key) of a tunable template in these phases."""
    entries: dict[tuple, dict] = {}

    def visit(program, phase):
        for launch, mult in launches(program):
            tpl, backend = launch["kernel"], launch["backend"]
            if tpl not in templates or (backend, tpl) not in GRIDS:
                continue
            ctx = launch_context(plan, launch, phase, table, page_size)
            # the key the launch's own entry has (a narrow step's narrow key, a LoRA site's lora
            # key); the entries of the keys before it are what its candidates overlay
            keys = tuning_keys(plan, launch, phase)
            key = keys[-1]
            e = entries.get((tpl, key))
            if e is None:
                for t in ctx["inputs"]:
                    if t["dtype"] == "i32" and t["kind"] == "buffer":
                        t["high"] = _int_high(t["name"], ctx["inputs"], plan["config"])
                ids_at, derived = DERIVED.get(launch["op"], (None, {}))
                ins = ctx["inputs"]
                for i, part in derived.items():
                    if i < len(ins):
                        ins[i]["derive"] = {"moe_align": part, "ids": ins[ids_at]["name"],
                                            "experts": int(ins[i]["shape"][0])}
                e = entries[(tpl, key)] = {
                    "template": tpl, "backend": backend, "op": launch["op"], "phase": phase,
                    "shape_key": key, "inherits": list(keys[:-1]), "launches_per_step": 0, "ctx": ctx,
                    "inputs": ctx["inputs"], "outputs": ctx["outputs"],
                    "caches": list(launch.get("caches", []))}
            e["launches_per_step"] += mult

    for phase in phases:
        visit(plan["programs"].get(phase, []), phase)
    return list(entries.values())


def prepare(model=None, gpu="h200", out=None, phases=("decode", "prefill"), templates=None,
            spec_path=None, model_dir=None, features=None, page_size=None, target="sm_90",
            decode_batches=(1,), prefill_tokens=1024, mixed=(512, 8), context_len=1024,
            compile=True, jobs=None, log=print, wide_batches=(128, 256), lora=None,
            verify_rows=DEFAULT_TUNE_VERIFY_ROWS) -> Path:
    """Render (and compile) every candidate kernel; write <out>/manifest.json. Returns out.
    lora: --enable-lora's build setting (infc/config.py lora_build): the plan with adapter slots,
    whose narrow GEMVs carry the LoRA sites (NARROW_LORA's grid). verify_rows: with the verify
    phase, the plan is a speculative build's of that many verify rows (k + 1: compile_model's
    narrow_tokens), its verify launches keyed by that row count (render.verify_key)."""
    log = log or (lambda *a: None)
    for p in phases:
        if p not in PHASES:
            raise SpecError(f"unknown phase '{p}' (known: {', '.join(PHASES)})", None)
    templates = tuple(templates or DEFAULT_TEMPLATES)
    tunable = sorted({t for _, t in GRIDS})
    for t in templates:
        if t not in tunable:
            raise SpecError(f"template '{t}' has no candidate grid (tunable: {', '.join(tunable)})", None)
    if context_len < 1:
        raise SpecError("--context-len must be at least 1", None)
    table = load_tuning(gpu)
    page_size = page_size or default_page_size(gpu)
    verify = "verify" in phases
    if verify:
        if isinstance(verify_rows, bool) or not isinstance(verify_rows, int) or not 2 <= verify_rows <= NARROW_TOKENS_MAX:
            raise SpecError(f"--verify-rows must be a verify step's k + 1 rows, 2..{NARROW_TOKENS_MAX}, "
                            f"got {verify_rows!r}", None)
    state, plan = compile_model(model, spec_path, model_dir, features, lora=lora,
                                narrow_tokens=verify_rows if verify else None)
    if verify and "verify" not in plan["programs"]:
        raise SpecError(f"{state.model} has no verify program (no narrow program: nothing merged for "
                        f"one-token steps)", None)
    out = Path(out) if out else REPO / ".cache" / "tune" / f"{state.model}{artifact_tag(lora)}-{gpu}"
    dims = {p: phase_dims(p, decode_batches, prefill_tokens, mixed, wide_batches, verify_rows) for p in phases}
    found = collect(plan, table, phases, templates, page_size)
    if not found:
        raise SpecError(f"no launch of {', '.join(templates)} in phases {', '.join(phases)} of "
                        f"{state.model}", None)

    env = _env()
    kernels = {}
    entries = []
    for e in found:
        tpl, backend = e["template"], e["backend"]
        entry_table = table.get("templates", {}).get(tpl, {})
        base = dict(entry_table.get("default", {}))
        # what the build renders for the launch without its own entry: the default, then the keys it
        # inherits (a narrow launch its decode key's tiles, a LoRA site its GEMV's narrow entry)
        inherited = dict(base)
        for k in e["inherits"]:
            inherited.update(entry_table.get(k, {}))
        current = entry_table.get(e["shape_key"])
        rows = [d[rows_dim(tpl, e["inputs"])] for d in dims[e["phase"]]]
        if e["ctx"].get("lora") and e["ctx"].get("row_cap") and max(rows) > e["ctx"]["row_cap"]:
            raise SpecError(f"--decode-batches {max(rows)}: a decode step's LoRA sites take at most "
                            f"{e['ctx']['row_cap']} rows (wider steps run the wide program: --phases wide)", None)
        cands = [(c, "default" if not c else "grid") for c in candidates(backend, tpl, rows)]
        if e["phase"] == "verify" and (backend, tpl) in VERIFY_GRIDS:
            cands = cands[:1] + [(c, "grid") for c in VERIFY_GRIDS[(backend, tpl)]]
        if e["phase"] == "narrow" and e["ctx"]["attrs"].get("quant"):
            grid = [c for c, _ in cands]
            cands[1:1] = [(c, "grid") for c in NARROW_QUANT.get((backend, tpl), []) if c not in grid]
        lora_grid = DECODE_LORA if e["phase"] == "decode" else NARROW_LORA
        if e["ctx"].get("lora") and (backend, tpl) in lora_grid:
            cands = cands[:1] + [(c, "grid") for c in lora_grid[(backend, tpl)]] + cands[1:1 + LORA_GEMV_TILES]
        if current and current not in [c for c, _ in cands]:
            cands.insert(1, (dict(current), "current"))
        rendered, skipped, seen = [], [], {}
        for tune, label in cands:
            ctx = dict(e["ctx"], tune={**inherited, **tune})
            try:
                k = render_template(backend, tpl, ctx, env)
            except TemplateError as err:
                if not tune:
                    raise
                skipped.append({"tune": tune, "why": f"render: {err}"})
                continue
            if k.id in seen:
                skipped.append({"tune": tune, "why": f"same kernel as {seen[k.id]}"})
                continue
            seen[k.id] = json.dumps(tune, sort_keys=True)
            kernels[k.id] = k
            rendered.append({"tune": tune, "label": label, "kernel": k.id,
                             "source": f"kernels/{k.id}{EXT[backend]}", "meta": k.meta})
        entries.append({key: e[key] for key in ("template", "backend", "op", "phase", "shape_key", "inherits",
                                                  "launches_per_step", "inputs", "outputs", "caches")}
                       | {"base_tune": base, "current_tune": current or {}, "dims": dims[e["phase"]],
                          "candidates": rendered, "skipped": skipped})

    for sub in ("kernels", "bin"):
        shutil.rmtree(out / sub, ignore_errors=True)
    (out / "kernels").mkdir(parents=True, exist_ok=True)
    for kid, k in kernels.items():
        (out / "kernels" / f"{kid}{EXT[k.backend]}").write_text(k.source)
    n_cands = sum(len(e["candidates"]) for e in entries)
    log(f"infc tune prepare {state.model} ({gpu}): {len(entries)} shape keys, {n_cands} candidates, "
        f"{len(kernels)} kernels")
    if compile:
        failed = _compile(kernels, out / "bin", target, jobs, log)
        for e in entries:
            keep = []
            for c in e["candidates"]:
                if c["kernel"] in failed:
                    if not c["tune"]:
                        raise RuntimeError(f"the baseline kernel {c['kernel']} of {e['template']} "
                                           f"failed to compile: {failed[c['kernel']]}")
                    e["skipped"].append({"tune": c["tune"], "why": f"compile: {failed[c['kernel']]}"})
                else:
                    keep.append(c)
            e["candidates"] = keep

    manifest = {
        "version": MANIFEST_VERSION, "model": state.model, "gpu": gpu, "target": target,
        "page_size": page_size, "compiled": bool(compile), "commit": _commit(),
        "caches": plan["caches"], "config": plan["config"],
        "context_len": int(context_len), "dims": dims,
        "note": ("shape keys are symbolic in T and B, so one key covers every batch size; each is "
                 "timed at the representative step sizes in 'dims' (decode T = B = batch, prefill "
                 "T tokens of one sequence, mixed B-1 decode rows + one chunk), attention over "
                 "context_len cached keys per sequence. Candidate tune dicts overlay base_tune "
                 "(the table's template default); the first candidate, {}, is the baseline."),
        "entries": entries,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"wrote {out / 'manifest.json'}")
    return out


def _compile(kernels: dict, bin_dir: Path, target: str, jobs, log) -> dict:
    """Compile all kernels; a candidate that fails to compile is dropped, not fatal. -> failures."""
    from .codegen.aot import compile_kernels
    try:
        res = compile_kernels(kernels, bin_dir, target, jobs=jobs, progress=log is not None)
        log(f"  compiled {len(res['compiled'])} kernels, {len(kernels) - len(res['compiled'])} "
            f"cached, {res['seconds']:.1f} s")
        return {}
    except RuntimeError:
        pass
    failed = {}
    for kid in sorted(kernels):          # one at a time (each cached) to find the bad ones
        try:
            compile_kernels({kid: kernels[kid]}, bin_dir, target, jobs=1, progress=False)
        except RuntimeError as e:
            failed[kid] = str(e).split(": ", 1)[-1][:300]
            log(f"  dropped {kid}: {failed[kid]}")
    return failed
