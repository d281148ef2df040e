"""The compiler, as one visible list of named passes.

Each pass takes the CompileState and rewrites it in place; after every rewrite the types are
inferred again, so a pass that breaks a shape rule is caught at the pass that did it.
"""
import time

from .lower import lower
from .passes.act_codes import make_act_codes
from .passes.add_lora import add_lora
from .passes.capture_hidden import capture_hidden
from .passes.eliminate_dead import eliminate_dead
from .passes.fuse_ops import (fuse_add_rms_norm, fuse_linear_epilogue, fuse_linear_prologue,
                              fuse_lm_head, fuse_qk_norm_rope_cache, fuse_act_mul)
from .passes.fold_shared_experts import fold_shared_experts
from .passes.fuse_delta_rule import fuse_delta_gates, fuse_delta_norms
from .passes.fuse_latent import fuse_latent_prologue
from .passes.fuse_weights import fuse_weights
from .passes.fuse_moe import fuse_route_align
from .passes.infer_types import infer_types
from .passes.lower_experts import lower_experts
from .passes.materialize_views import materialize_views
from .passes.fuse_lora_act import fuse_lora_act
from .passes.merge_lora import merge_lora
from .passes.merge_epilogues import merge_epilogues
from .passes.merge_prologues import merge_prologues
from .passes.plan_memory import plan_memory
from .passes.quantize_kv_cache import quantize_kv_cache
from .passes.quantize_weights import quantize_weights
from .passes.rotate_residual import rotate_residual
from .passes.row_logits import row_logits
from .passes.select_kernels import select_kernels
from .passes.shard_ranks import shard_ranks
from .passes.split_attention import split_attention
from .passes.split_compression import split_compression
from .passes.split_delta_rule import split_delta_rule
from .passes.upcast_experts import upcast_experts
from .spec import Spec
from .state import CompileState

PIPELINE = [
    ("infer_types", infer_types),                  # shapes and dtypes of every value
    ("split_attention", split_attention),          # attention -> KV-cache write + cached attention
    ("split_compression", split_compression),      # DeepSeek-V4: compressor write + cached indexer /
                                                   # attention (a program a query token)
    ("capture_hidden", capture_hidden),            # a speculation head's target hidden states as
                                                   # the output aux_hidden (no-op without one)
    ("shard_ranks", shard_ranks),                  # --tensor-parallel-size / --enable-expert-parallel:
                                                   # rank r's weight slices + collectives (no-op alone)
    ("fold_shared_experts", fold_shared_experts),  # shared experts -> always-on routed experts
    ("lower_experts", lower_experts),              # moe_experts -> gate|up launch + down launch
    ("quantize_weights", quantize_weights),        # a quantized checkpoint's linears read codes + scales
    ("quantize_kv_cache", quantize_kv_cache),      # --kv-cache-dtype fp8: K/V caches as e4m3 + scales
    ("fuse_weights", fuse_weights),                # q|k|v and gate|up concatenated at load time
    ("add_lora", add_lora),                        # --enable-lora: shrink + expand over adapter slots
    ("rotate_residual", rotate_residual),          # carry the last residual add into the next layer
    ("fuse_add_rms_norm", fuse_add_rms_norm),      # residual add + RMSNorm
    ("fuse_qk_norm_rope_cache", fuse_qk_norm_rope_cache),  # q/k norm + RoPE + KV-cache write
    ("fuse_latent_prologue", fuse_latent_prologue),  # MLA: [q_lat | rope q_pe], [norm c_kv | rope k_pe]
    ("fuse_act_mul", fuse_act_mul),                # act(gate) x up (SwiGLU, GeGLU, ...)
    ("fuse_lora_act", fuse_lora_act),              # --enable-lora: gate|up's expand + the activation
    ("fuse_linear_epilogue", fuse_linear_epilogue),  # act x mul into the gate|up GEMM's epilogue
    ("fuse_linear_prologue", fuse_linear_prologue),  # else into the down GEMM's input load
    ("fuse_lm_head", fuse_lm_head),                # final add + norm + lm_head on last tokens only
    ("fuse_route_align", fuse_route_align),        # MoE router + token grouping by expert in one launch
    ("fuse_delta_gates", fuse_delta_gates),        # Gated DeltaNet: beta and g made in the delta rule
    ("fuse_delta_norms", fuse_delta_norms),        # ... and its q / k l2 norms
    ("split_delta_rule", split_delta_rule),        # ... and its chunks' WY form solved all at once,
                                                   # before the pass over them in order
    ("act_codes", make_act_codes),                 # fp8 linears' activation codes made once, by
                                                   # their producer (or a quantize_act launch)
    ("upcast_experts", upcast_experts),            # quantized experts: a bf16 stack made once a layer
                                                   # for the grouped GEMMs of many-token steps
    ("row_logits", row_logits),                    # logits of any rows (prompt logprobs): name the
                                                   # logits tail, keep its inputs live to the end
    ("eliminate_dead", eliminate_dead),
    ("materialize_views", materialize_views),      # copy strided views before kernels that need it
    ("merge_lora", merge_lora),                    # narrow / decode steps: LoRA in the GEMV's launch
    ("merge_prologues", merge_prologues),          # narrow decode steps: add + RMSNorm in the GEMV
    ("merge_epilogues", merge_epilogues),          # decode steps: o_proj's codes in attention's launch
    ("plan_memory", plan_memory),                  # liveness-based arena offsets
    ("select_kernels", select_kernels),            # backend + template per launch and phase
]
# Optimizations: `infc build --no-fuse` skips them all, and the plan still runs (every op has a
# generic kernel). The other passes are required lowerings.
FUSIONS = {"fold_shared_experts", "fuse_weights", "rotate_residual", "fuse_add_rms_norm",
           "fuse_qk_norm_rope_cache", "fuse_latent_prologue", "fuse_act_mul", "fuse_lora_act",
           "fuse_linear_epilogue", "fuse_linear_prologue", "fuse_lm_head", "fuse_route_align",
           "fuse_delta_gates", "fuse_delta_norms", "split_delta_rule", "act_codes", "upcast_experts", "merge_lora", "merge_prologues", "merge_epilogues"}
# (merge_prologues rewrites no node; its dropped in-place aliases would come back with the types)
REWRITES = FUSIONS - {"merge_prologues", "merge_lora", "merge_epilogues"} | {"split_attention", "split_compression", "shard_ranks", "lower_experts",
                                            "quantize_weights", "eliminate_dead", "materialize_views",
                                            "add_lora", "capture_hidden"}


def narrow_tokens_setting(n) -> int:
    """The narrow launches' widest step: infc/config.py's default, or 1..NARROW_TOKENS_MAX (above
    the default: a verify program that wide beside the narrow one)."""
    from infc.config import NARROW_TOKENS, NARROW_TOKENS_MAX
    if n is None:
        return NARROW_TOKENS
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= NARROW_TOKENS_MAX:
        raise ValueError(f"narrow_tokens must be an integer in 1..{NARROW_TOKENS_MAX}, got {n!r}")
    return n


def compile_spec(spec: Spec, env: dict, model: str, features: list | None = None,
                 observe=None, stop_after: str | None = None, skip=(),
                 parallel: dict | None = None, quant=None, kv_cache: dict | None = None,
                 lora: dict | None = None, capture: list | None = None,
                 narrow_tokens: int | None = None, checkpoint_names=None) -> CompileState:
    """Run the pipeline; `skip` leaves out optional rewrites (tests compare with and without;
    skip=FUSIONS is `--no-fuse`); `parallel` = {"world", "rank", "tp", "ep"} compiles rank
    r's plan (compiler/parallel.py); `quant`: the checkpoint's quantization format
    (compiler/quant/formats), None for bf16; `kv_cache`: --kv-cache-dtype fp8's
    {"flag", "scales"} (passes/quantize_kv_cache.py), None for the model's dtype; `lora`:
    --enable-lora's {"max_loras", "max_rank", "targets"} (passes/add_lora.py), None without;
    `capture`: a speculation head's target layers (passes/capture_hidden.py), None without;
    `narrow_tokens`: the narrow launches' widest step (None: infc/config.py NARROW_TOKENS; more:
    a verify program that wide, passes/select_kernels.py); `checkpoint_names`: the checkpoint's
    tensor names, which choose among a weight's `or:` layouts (None: the declared layouts)."""
    graph, weights = lower(spec, env, checkpoint_names)
    state = CompileState(spec, env, graph, weights, model, features=list(features or []),
                         parallel=dict(parallel) if parallel else None, quant=quant, kv_cache=kv_cache,
                         lora=dict(lora) if lora else None, capture=list(capture) if capture else None,
                         narrow_tokens=narrow_tokens_setting(narrow_tokens))
    _stamp(state, "lower")
    if observe:
        observe("lower", state)
    for name, run in PIPELINE:
        if name in skip:
            assert name in FUSIONS, f"pass {name} is required"
            continue
        t0 = time.perf_counter()
        run(state)
        if name in REWRITES:
            infer_types(state)
        _stamp(state, name)
        state.note(name, f"done in {1e3 * (time.perf_counter() - t0):.1f} ms")
        if observe:
            observe(name, state)
        if name == stop_after:
            break
    return state


def _stamp(state: CompileState, pass_name: str):
    """Record which pass made each node, for the routing table in `infc inspect`."""
    for g in state.graph.walk():
        for n in g.ordered():
            if n.made_by is None:
                n.made_by = pass_name
