"""The settings an engine is built from, typed and grouped as vLLM's (load, cache, scheduler,
parallel, device), with each default defined here once.

`infc serve` (server/args.py engine_config), `infc generate` and `LLM(...)` (infc/llm.py) build one
EngineConfig; infc/backend.py load_backend takes it, fills what depends on the machine
(`resolved`: the device, the KV page size from the GPU's tuning table, the step token budget) and
builds the engine from it. Flat keyword settings use vLLM's names (`from_settings`), where
`block_size` is vLLM's name for the KV page size: inside infc it is `page_size` everywhere.

Imports nothing from infc but the environment registry: the runtime, the compiler and the server
may all read it (tests/test_layering.py).
"""
from dataclasses import dataclass, field, fields, replace
from typing import Callable

# The KV cache's tokens a page when neither the user nor the GPU's tuning table names one
# (vLLM's block size). A table's `page_size` wins on its GPU (compiler/build.py default_page_size).
DEFAULT_PAGE_SIZE = 16
# The host KV tier saves a released block once it is among the pages this many steps' allocations
# could take next (each step at most max_num_batched_tokens / page_size + max_num_seqs pages): its
# copy is done before its page is handed out, and a block that is never evicted is never copied.
KV_SAVE_AHEAD_STEPS = 4
# The block hashes of this many recent prompts are kept, so a prompt that begins as one of them
# did takes their hashes instead of hashing those blocks again (runtime/engine/recent_hashes.py:
# a 16k-token warm hit's admission ~1.0 -> ~0.3 ms of host time on the build machine); 0: none.
RECENT_PROMPT_HASHES = 16
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# LLM(...) on the CPU (the numpy reference): a small cache and batch unless asked (infc/llm.py)
OFFLINE_CPU_KV_TOKENS = 4096
OFFLINE_CPU_MAX_NUM_SEQS = 64

# Step token budgets (max_num_batched_tokens) when none is given, as vLLM sets them per use on cards
# of 70 GiB or more (its arg_utils: LLM class 16384, OpenAI server 8192; the H100s and H200s this
# project runs on; smaller cards keep the same values here, which vLLM halves and quarters): the
# server's steps keep decodes' inter-token gaps short (a mixed step of 8k prompt tokens is ~0.1 s
# on an H200), while offline work (LLM, `bench throughput`) takes 16k-token steps: fewer, larger
# prefill bursts that run while fewer sequences decode. qwen3-4b at 1024 in / 128 out on an H200:
# mean TPOT at 64 concurrent 10.72 -> 9.95 ms, 256 concurrent +1 % output tok/s, median TTFT
# 222 -> 430 ms (bench/NOTES.md, eighth session). Keyed by (device, served by `infc serve`).
BATCHED_TOKENS = {("cuda", True): 8192, ("cuda", False): 16384, ("cpu", True): 2048, ("cpu", False): 2048}
DEVICES = ("cpu", "cuda")

# --kv-cache-dtype (vLLM's flag and values): the paged K/V caches' element type, chosen at build
# time (part of the plan). auto: the model's dtype; fp8 = fp8_e4m3: e4m3 codes with a per-tensor
# scale per layer (the checkpoint's k_scale / v_scale, else 1.0), half the bytes of bf16.
DEFAULT_KV_CACHE_DTYPE = "auto"
KV_CACHE_DTYPES = {"auto": None, "fp8": "f8e4m3", "fp8_e4m3": "f8e4m3"}   # -> the plan's cache dtype
_KV_CACHE_REFUSED = {"fp8_e5m2": "e5m2 keeps 2 mantissa bits (e4m3 keeps 3) and no checkpoint ships "
                                 "e5m2 KV scales; use fp8 (e4m3)"}


def kv_cache_dtype(name: str | None) -> str | None:
    """The plan's K/V cache dtype for a --kv-cache-dtype value (None: the model's own, as auto);
    anything else is a ValueError naming the flag and the values it takes."""
    if name is None or name in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[name or DEFAULT_KV_CACHE_DTYPE]
    why = f" ({_KV_CACHE_REFUSED[name]})" if name in _KV_CACHE_REFUSED else ""
    raise ValueError(f"--kv-cache-dtype {name!r} is not supported{why}: use one of "
                     f"{', '.join(KV_CACHE_DTYPES)}")


# Multi-LoRA (vLLM's flags and defaults: --max-loras 1, --max-lora-rank 16, --max-cpu-loras =
# --max-loras): the adapter slots a plan's tables hold beside slot 0 (no adapter), the rank every
# slot is padded to (an adapter of a lower rank is exact, zero-padded), and the modules that take
# adapters (the last component of a checkpoint module's name: q/k/v/o and gate/up/down).
DEFAULT_MAX_LORAS = 1
DEFAULT_MAX_LORA_RANK = 16
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_LORA_RANK_LIMIT = 256        # the kernels' largest rank (codegen_templates/triton/lora_*.py.j2)


def lora_build(max_loras: int | None = None, max_lora_rank: int | None = None,
               target_modules=None) -> dict:
    """--enable-lora's build settings as the compiler takes them (compiler/passes/add_lora.py);
    a bad value is a ValueError naming the flag."""
    loras = DEFAULT_MAX_LORAS if max_loras is None else max_loras
    rank = DEFAULT_MAX_LORA_RANK if max_lora_rank is None else max_lora_rank
    targets = tuple(target_modules or LORA_TARGET_MODULES)
    if loras < 1:
        raise ValueError(f"--max-loras must be >= 1, got {loras}")
    if not 1 <= rank <= MAX_LORA_RANK_LIMIT:
        raise ValueError(f"--max-lora-rank must be in [1, {MAX_LORA_RANK_LIMIT}], got {rank}")
    if not all(isinstance(t, str) and t and "." not in t for t in targets):
        raise ValueError(f"--lora-target-modules takes module names (q_proj, ...), got {list(targets)}")
    return {"max_loras": loras, "max_rank": rank, "targets": sorted(set(targets))}


def default_batched_tokens(device: str, server: bool) -> int:
    return BATCHED_TOKENS[(device, server)]


@dataclass(frozen=True)
class LoadConfig:
    model: str | None = None            # the variant name; None: detected from config.json
    spec: str | None = None             # a spec file, instead of the one whose architectures match
    spec_dirs: tuple = ()               # searched before specs/ (with $INFC_SPEC_PATH)
    load_format: str = "auto"           # auto: the safetensors; dummy: random weights (vLLM's)
    artifact: str | None = None         # a built artifact to run as it is (one GPU): an A/B of plans
    max_model_len: int | None = None    # None: the model's, within the KV cache


@dataclass(frozen=True)
class CacheConfig:
    page_size: int | None = None        # KV tokens a page (vLLM's --block-size); None: the device's
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None    # KV pages, either device
    kv_cache_tokens: int | None = None  # LLM(...): KV capacity in tokens (pages = ceil(/page_size))
    kv_cache_memory_bytes: int | None = None      # cpu; None: $INFC_CPU_KV_CACHE_BYTES
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    kv_cache_dtype: str | None = None   # --kv-cache-dtype; None: auto, or an --artifact's own
    # KV tiers (runtime/engine/kv_tier/): GiB of host memory for prefix blocks that leave the KV
    # cache (vLLM's --kv-offloading-size; 0: off), and a folder with GiB of disk behind it
    kv_offloading_size: float = 0.0
    kv_offloading_disk: str | None = None
    kv_offloading_disk_size: float = 0.0
    # hybrid models (slot caches): state snapshots kept for prefix caching (--num-state-snapshots;
    # runtime/engine/state_snapshots.py), each one slot of every slot cache, taken from the KV
    # cache's memory. None: one per sequence slot (max_num_seqs); 0: none, and no prefix caching.
    num_state_snapshots: int | None = None


def state_snapshots(cache: CacheConfig, max_num_seqs: int) -> int:
    """The snapshot pool a plan with slot caches gets: none without prefix caching."""
    if not cache.enable_prefix_caching:
        return 0
    return max_num_seqs if cache.num_state_snapshots is None else cache.num_state_snapshots


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int | None = None     # None: DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int | None = None     # None: BATCHED_TOKENS
    overlap: bool | None = None         # overlapped steps; None: where the runner can ($INFC_OVERLAP)
    asynchronous: bool = True           # an AsyncEngine (the server's); False: a plain Engine (LLM)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1

    @property
    def ranks(self) -> bool:
        return self.tensor_parallel_size != 1 or self.enable_expert_parallel or self.data_parallel_size != 1


@dataclass(frozen=True)
class DeviceConfig:
    device: str | None = None           # cpu | cuda; None: cuda when an NVIDIA driver is present
    cuda_graphs: bool = True


# Speculative decoding (issue 43; runtime/engine/speculative/): vLLM's --speculative-config keys.
SPEC_METHODS = ("ngram", "draft_model", "eagle3", "mtp")   # built; vLLM also spells n-gram "[ngram]"
# vLLM's older per-model spellings of mtp (it maps them to "mtp" too)
SPEC_METHOD_ALIASES = {"[ngram]": "ngram", "deepseek_mtp": "mtp", "qwen3_next_mtp": "mtp"}
SPEC_METHODS_NOT_BUILT = ("eagle", "medusa", "mlp_speculator")
# EAGLE-3's target layers when its config names none: vLLM's and SpecForge's (2, L // 2, L - 3),
# layer l meaning the residual stream entering layer l (compiler/passes/capture_hidden.py)
def eagle3_default_layers(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]
# vLLM's ngram defaults when neither is given (one given alone sets the other to it)
DEFAULT_PROMPT_LOOKUP_MIN = 5
DEFAULT_PROMPT_LOOKUP_MAX = 5
# No drafts while more than this many sequences run (vLLM's disable_by_batch_size): verifying k
# drafts for B sequences costs B (k + 1) rows, which stops paying once the decode GEMVs are no
# longer weight-bound. Measured on an H200 (bench/NOTES.md, "Issues 43 and 46 measured on an
# H200"; qwen3-4b and qwen3-8b, `bench spec-verify`): at batch 8, verify(k <= 3) costs 1.07-1.14x a
# decode step (and verify(4) 1.5x), so k = 3 pays from an acceptance rate of ~0.12; at batch 32
# verify(1) already costs 1.23-1.26x and verify(4) 1.87-2.14x, which pays only past ~0.5-0.55.
# Batch 8 is the last measured batch where speculation pays at any useful acceptance.
DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE = 8
# The narrow program (compiler/passes/merge_prologues.py) takes decode steps of at most this many
# tokens. One by default: its GEMVs are then the CUDA-core path alone; the tensor-core path that
# 2+ rows need, compiled into the same kernels, cost the one-token step 16 % on an H200 (its
# shared-memory pipeline limits the CUDA-core path's occupancy: qwen3-4b 2.34 -> 2.71 ms, bench/NOTES.md).
# A speculative build keeps it and adds a verify program of a verify step's k + 1 rows, at most
# NARROW_TOKENS_MAX: the same launches rendered that wide (compiler/passes/select_kernels.py).
NARROW_TOKENS = 1
NARROW_TOKENS_MAX = 8
# merge_prologues (compiler/passes/merge_prologues.py): a merge that would put its residual over
# an input through a later unmerged norm's in-place residual gives that residual a buffer of its
# own (the MoE layers' attention norm then merges too); False keeps the older plans (an A/B switch
# for tests/gpu/build_variants.py's "_config")
NARROW_MERGE_FREES_RESIDUALS = True
# merge_prologues: an fp8 linear's norm with its activation codes (add_rms_norm_quant, the act_codes
# pass's) merged into the narrow GEMV, whose programs then make their K range's codes themselves;
# False (the default) keeps the norm a launch of its own: merged, qwen3-4b-fp8's step took 2.44-2.48
# ms against 2.36-2.40 on an H100 (72 launches fewer, but q|k|v +2.8 and gate|up +5.1 us a launch for
# the codes made in every program: bench/NOTES.md, "Issue 42: the FP8 narrow norms measured"); the
# A/B side of tests/gpu/prepare.py's fp8-ab part
NARROW_MERGE_QUANT_NORMS = False
# merge_lora (compiler/passes/merge_lora.py): a decode step's LoRA sites inside their GEMVs, the
# rows as a block (codegen_templates/triton/_lora_rows.j2); False (the default) keeps that step's
# separate shrink / expand launches: at 32 decodes with 8 adapters on an H100 the step took 9.67 ms
# with the sites in the GEMVs against 7.69 separate (base 6.25; gate|up 72.5 us against 38.4 and
# its two LoRA launches: bench/NOTES.md, "Issue 46: the probes measured"). True builds the other
# side of that A/B (tests/gpu/prepare.py's lora-rows part).
LORA_DECODE_SITES = False
# merge_lora: a decode step's LoRA expands inside their GEMVs (the delta in the epilogue, rows as a
# block: codegen_templates/triton/_lora_rows.j2, gemv.py.j2 LAPART), their shrinks launches of their
# own just before: 4 launches a layer fewer than the separate form, none of the in-launch shrink's
# claims and waits. Taken where LORA_DECODE_SITES is off. Off (the default) keeps the separate
# launches: at 32 decodes with 8 adapters on an H100 the step took 8.32-8.38 ms with the expands in
# the GEMVs against 7.56-7.57 separate (base 6.14-6.21; gate|up 58.2 us against 38.2 and its expand's
# 8.8): the delta's B rows of every slot at the GEMV's tail cost more than the launch it saves
# (bench/NOTES.md, "Issue 46: a decode step's expands in the GEMVs"). True builds the other side of
# that A/B (tests/gpu/prepare.py's lora-expand part).
LORA_DECODE_EXPAND = False
# Gated DeltaNet's delta rule makes its own gates and q / k norms in its launch (compiler/passes/
# fuse_delta_rule.py: 8 launches fewer a linear-attention layer, 192 a Qwen3.5-4B decode step);
# False builds the older plans (an A/B switch for tests/gpu/build_variants.py's "_config")
FUSE_DELTA_RULE = True
# Gated DeltaNet's chunked (prefill / mixed / short) delta rule in two launches
# (compiler/passes/split_delta_rule.py): every chunk's WY form solved at once (delta_rule_wy), then
# the pass over the chunks in order with only matrix products left in it; DELTA_CHUNK rows a chunk
# (16, 32 or 64). Qwen3.5-4B's TTFT on an H100 at 1k / 8k: one launch 42.6 / 329.6 ms, two with
# chunks of 64 24.5 / 176.9, of 32 21.6 / 158.4 (bench/NOTES.md). False: one launch that solves
# each chunk on its sequential path (an A/B switch for tests/gpu/build_variants.py's "_config").
DELTA_WY = True
DELTA_CHUNK = 32
# 4-bit quantized experts dequantized once a step (compiler/passes/upcast_experts.py). GPT-OSS-20B's
# 1024/1024 x 256 went 6,644 -> 7,505 tok/s with it on an H100 (one commit, both builds: the mixed
# steps 16.5 -> 7.7 s, the decode steps unchanged), and 8,426 -> 9,841 on an H200 (bench/NOTES.md,
# "Measured at 8d0cc031"); False builds the older plans (the A/B's other side: prepare.py gptoss).
UPCAST_EXPERTS = True
# With it on: a step whose routed experts get at least
# this many tokens each on average dequantizes each layer's stacks to bf16 once and runs the bf16
# grouped GEMMs; fewer, and the GEMMs dequantize tiles in registers. Break-even predicted at ~72
# for GPT-OSS-20B on an H200 (0.5 ms a layer to upcast; the MXFP4 grouped GEMMs at ~166 TFLOP/s
# against ~600 in bf16: bench/NOTES.md). A stack over UPCAST_MAX_BYTES in bf16 keeps its codes
# (the buffer is taken from the KV cache; GPT-OSS-120B's gate|up is 3.96 GiB).
UPCAST_TOKENS_PER_EXPERT = 64
UPCAST_MAX_BYTES = 4 << 30
# The experts' bf16 stacks kept resident (compiler/passes/upcast_experts.py, resident mode): when
# every upcast stack of the model in bf16, all layers together, fits under this many bytes, each
# is made once by the plan's load program (a derived weight a layer) instead of once a step, and
# the grouped GEMMs of the prefill, mixed, short and wide programs read it in steps whose routed
# experts get at least RESIDENT_TOKENS_PER_EXPERT tokens each on average (the decode GEMVs keep
# the codes). 0 = off: not yet measured on a GPU end to end (the design's prediction for
# GPT-OSS-20B, 38 GB of stacks: wide steps -27 % on an H100, bench/NOTES.md "kept resident").
RESIDENT_EXPERT_STACKS_MAX_BYTES = 0
RESIDENT_TOKENS_PER_EXPERT = 4
# `infc tune prepare --phases verify`'s rows when --verify-rows is not given: verify(4)'s 5, the
# issue-43 target (its entries are keyed per row count: compiler/codegen/render.py verify_key)
DEFAULT_TUNE_VERIFY_ROWS = 5


def artifact_tag(lora=None, narrow: int = 1, capture=None) -> str:
    """The suffix of a served build's directory name that the build's own plan gets: LoRA tables,
    a speculative build's verify program (k + 1 rows), a head's hidden-state outputs (infc/backend.py
    serves them, `infc tune prepare` and tests/gpu/prepare.py build under the same names)."""
    return ((f"-lora{lora['max_loras']}r{lora['max_rank']}" if lora else "")
            + (f"-narrow{narrow}" if narrow > 1 else "")
            + ("-eagle3-" + "-".join(map(str, capture)) if capture else ""))


def narrow_tokens_for(spec) -> int:
    """The narrow launches' widest step for a build that serves `spec` (a SpeculativeConfig or
    None; compile_model's narrow_tokens): a verify step's k + 1 rows where they fit and
    INFC_VERIFY_PROGRAM asks for it (the plan's verify program), else the one-token default (no
    verify program: the decode program runs verify steps, the faster of the two on an H200 at
    da4e6e7f, bench/NOTES.md)."""
    from infc import envs
    if spec is None or spec.num_speculative_tokens + 1 > NARROW_TOKENS_MAX \
            or not envs.value("INFC_VERIFY_PROGRAM"):
        return NARROW_TOKENS
    return spec.num_speculative_tokens + 1


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int                # k: required, as vLLM requires it for ngram
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX
    disable_by_batch_size: int = DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE
    model: str | None = None                   # draft_model: a model directory or a variant name;
                                               # eagle3: the head's directory


_SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
              "disable_by_batch_size", "model")


def _json_object(value, where: str, keys, example: str) -> dict:
    """A flag's JSON object (vLLM's --*-config flags), or a dict, checked for unknown keys."""
    import json
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where} is not valid JSON ({e.msg} at character {e.pos}): "
                             f"give an object such as '{example}'") from None
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(keys)})")
    return value


def speculative_config(value) -> SpeculativeConfig | None:
    """--speculative-config (a JSON object, as vLLM spells it), a dict, a SpeculativeConfig or
    None -> a checked SpeculativeConfig (None: no speculation). A key this engine does not know,
    a value of the wrong type or range, or a method not built yet is a ValueError naming it."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    where = "--speculative-config"
    value = _json_object(value, where, _SPEC_KEYS, '{"method": "ngram", "num_speculative_tokens": 4}')
    method = value.get("method")
    if method is None:
        raise ValueError(f"{where}: 'method' is required (one of {', '.join(SPEC_METHODS)})")
    if not isinstance(method, str):
        raise ValueError(f"{where}: 'method' must be a string (one of {', '.join(SPEC_METHODS)}), got {method!r}")
    method = SPEC_METHOD_ALIASES.get(method, method)
    if method in SPEC_METHODS_NOT_BUILT:
        raise ValueError(f"{where}: method {method!r} is not supported yet (built: "
                         f"{', '.join(SPEC_METHODS)})")
    if method not in SPEC_METHODS:
        raise ValueError(f"{where}: unknown method {method!r} (built: {', '.join(SPEC_METHODS)})")
    model = value.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"{where}: 'model' must be a string (a directory or variant name), got {model!r}")
    if method == "eagle3":
        if not isinstance(model, str) or not model:
            raise ValueError(f"{where}: method 'eagle3' needs 'model': the EAGLE-3 head's directory "
                             f"(its config.json and weights)")
    if method == "draft_model":
        if not isinstance(model, str) or not model:
            raise ValueError(f"{where}: method 'draft_model' needs 'model': the draft's model "
                             f"directory or variant name (a model of the target's vocabulary)")
    if method == "mtp" and model is not None:
        raise ValueError(f"{where}: method 'mtp' takes no 'model': the MTP layers are the target's "
                         f"own (its checkpoint's, declared by its config.json)")
    if method in ("draft_model", "eagle3", "mtp"):
        lookup = sorted(k for k in ("prompt_lookup_min", "prompt_lookup_max") if value.get(k) is not None)
        if lookup:
            raise ValueError(f"{where}: {lookup[0]!r} is for method 'ngram'; {method!r} takes none")
    elif model is not None and method != "eagle3":
        raise ValueError(f"{where}: 'model' is for a draft model or head; method {method!r} takes none")
    ints = {}
    for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
        v = value.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}: {key!r} must be an integer >= 1, got {v!r}")
        ints[key] = v
    if "num_speculative_tokens" not in ints:
        raise ValueError(f"{where}: 'num_speculative_tokens' is required (the drafts a step verifies)")
    lo, hi = ints.get("prompt_lookup_min"), ints.get("prompt_lookup_max")
    if lo is not None or hi is not None:      # one alone sets the other to it, as vLLM does
        ints.update(prompt_lookup_min=lo or hi, prompt_lookup_max=hi or lo)
    c = SpeculativeConfig(method=method, model=model, **ints)
    if c.prompt_lookup_max < c.prompt_lookup_min:
        raise ValueError(f"{where}: 'prompt_lookup_max' ({c.prompt_lookup_max}) must be >= "
                         f"'prompt_lookup_min' ({c.prompt_lookup_min})")
    return c


@dataclass(frozen=True)
class SpeculativeSettings:
    speculative_config: object = None   # as given (JSON text, dict); resolved: SpeculativeConfig | None


# KV events (issue 44; runtime/engine/kv_events.py): vLLM's --kv-events-config, its keys and
# defaults. A KV-aware router (llm-d's KV-cache indexer, Dynamo's KV router) subscribes to the
# stream of blocks stored into and removed from each replica's prefix cache.
KV_EVENTS_PUBLISHERS = ("null", "zmq")
DEFAULT_KV_EVENTS_ENDPOINT = "tcp://*:5557"
DEFAULT_KV_EVENTS_BUFFER_STEPS = 10_000     # batches kept for replay requests
DEFAULT_KV_EVENTS_HWM = 100_000             # the PUB socket's send high-water mark (messages)
DEFAULT_KV_EVENTS_MAX_QUEUE_SIZE = 100_000  # batches waiting for the publisher thread; more drop
_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"                 # resolved as vLLM does: zmq when enabled and not named
    endpoint: str = DEFAULT_KV_EVENTS_ENDPOINT
    replay_endpoint: str | None = None
    buffer_steps: int = DEFAULT_KV_EVENTS_BUFFER_STEPS
    hwm: int = DEFAULT_KV_EVENTS_HWM
    max_queue_size: int = DEFAULT_KV_EVENTS_MAX_QUEUE_SIZE
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


_KV_EVENTS_KEYS = {f.name: f for f in fields(KVEventsConfig)}


def kv_events_config(value) -> KVEventsConfig | None:
    """--kv-events-config (a JSON object, as vLLM spells it), a dict, a KVEventsConfig or None ->
    a checked KVEventsConfig (None: no events). An unknown key, a value of the wrong type or
    range, or an endpoint that is not a ZeroMQ address is a ValueError naming it."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    where = "--kv-events-config"
    value = _json_object(value, where, _KV_EVENTS_KEYS,
                         f'{{"enable_kv_cache_events": true, "endpoint": "{DEFAULT_KV_EVENTS_ENDPOINT}"}}')
    kw = {}
    for key, v in value.items():
        if key == "enable_kv_cache_events":
            if not isinstance(v, bool):
                raise ValueError(f"{where}: {key!r} must be true or false, got {v!r}")
        elif key == "publisher":
            if v is not None and v not in KV_EVENTS_PUBLISHERS:
                raise ValueError(f"{where}: 'publisher' must be one of {', '.join(KV_EVENTS_PUBLISHERS)}, "
                                 f"got {v!r}")
        elif key in ("endpoint", "replay_endpoint"):
            if v is None and key == "replay_endpoint":
                pass
            elif not isinstance(v, str) or not v.startswith(_ZMQ_SCHEMES) or v.endswith("//"):
                raise ValueError(f"{where}: {key!r} must be a ZeroMQ address ({', '.join(s + '...' for s in _ZMQ_SCHEMES)}"
                                 f", e.g. {DEFAULT_KV_EVENTS_ENDPOINT!r}), got {v!r}")
        elif key == "topic":
            if not isinstance(v, str):
                raise ValueError(f"{where}: 'topic' must be a string, got {v!r}")
        else:                                   # buffer_steps, hwm, max_queue_size
            low = 0 if key == "hwm" else 1      # hwm 0: ZeroMQ's "no limit"
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{where}: {key!r} must be an integer >= {low}, got {v!r}")
        if v is not None:
            kw[key] = v
    if "publisher" not in kw:
        kw["publisher"] = "zmq" if kw.get("enable_kv_cache_events") else "null"
    return KVEventsConfig(**kw)


@dataclass(frozen=True)
class KVEventsSettings:
    kv_events_config: object = None     # as given (JSON text, dict); resolved: KVEventsConfig | None


@dataclass(frozen=True)
class LoraConfig:
    enable_lora: bool = False           # --enable-lora: the plan takes adapter slots (a build setting)
    max_loras: int | None = None        # None: DEFAULT_MAX_LORAS
    max_lora_rank: int | None = None    # None: DEFAULT_MAX_LORA_RANK
    max_cpu_loras: int | None = None    # None: max_loras (vLLM's default)
    lora_target_modules: tuple | None = None      # None: LORA_TARGET_MODULES
    lora_modules: tuple = ()            # --lora-modules: (name, path) pairs loaded at start
    allow_runtime_lora_updating: bool = False     # POST /v1/load_lora_adapter and unload

    def build(self) -> dict | None:
        """The compiler's setting (compiler/passes/add_lora.py), None without --enable-lora."""
        if not self.enable_lora:
            if self.lora_modules or self.allow_runtime_lora_updating:
                raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
            return None
        build = lora_build(self.max_loras, self.max_lora_rank, self.lora_target_modules)
        check_lora_modules(self.lora_modules)
        # here, before the model loads: LoraSlots would take 0 for the default and fail on -1 late
        if self.max_cpu_loras is not None and self.max_cpu_loras < build["max_loras"]:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                             f"({build['max_loras']})")
        return build


def check_lora_modules(pairs):
    """--lora-modules' (name, path) pairs: each name once and non-empty, before the model loads
    (the second 'a' would otherwise fail the start after it, as 'already loaded; unload it')."""
    seen = set()
    for name, path in pairs:
        if not name or not path:
            raise ValueError(f"--lora-modules: an adapter needs a name and a path, got {name!r}={path!r}")
        if name in seen:
            raise ValueError(f"--lora-modules: adapter name '{name}' is given twice")
        seen.add(name)


GROUPS = {"load": LoadConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
          "parallel": ParallelConfig, "device": DeviceConfig, "speculative": SpeculativeSettings,
          "lora": LoraConfig, "kv_events": KVEventsSettings}
ALIASES = {"block_size": "page_size"}     # vLLM's spelling -> infc's


def _frozen(key: str, v):
    """A setting as the frozen config keeps it: lists as tuples, --lora-modules as (name, path)
    pairs (from a dict or pairs)."""
    if key == "lora_modules":
        return tuple((str(n), str(p)) for n, p in (v.items() if isinstance(v, dict) else v))
    return tuple(v) if key in ("spec_dirs", "lora_target_modules") else v


@dataclass(frozen=True)
class EngineConfig:
    load: LoadConfig = field(default_factory=LoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    speculative: SpeculativeSettings = field(default_factory=SpeculativeSettings)
    lora: LoraConfig = field(default_factory=LoraConfig)
    kv_events: KVEventsSettings = field(default_factory=KVEventsSettings)

    @classmethod
    def from_settings(cls, **settings) -> "EngineConfig":
        """From flat keyword settings (vLLM's names: max_num_seqs, block_size, ...); None leaves
        a setting at its default. An unknown name is a TypeError that names it."""
        owner = {f.name: g for g, c in GROUPS.items() for f in fields(c)}
        parts = {g: {} for g in GROUPS}
        for name, v in settings.items():
            key = ALIASES.get(name, name)
            if key not in owner:
                raise TypeError(f"unknown engine setting '{name}' (known: "
                                f"{', '.join(sorted([*owner, *ALIASES]))})")
            if v is not None:
                parts[owner[key]][key] = _frozen(key, v)
        return cls(**{g: GROUPS[g](**kw) for g, kw in parts.items()})

    def resolved(self, detect_device: Callable[[], str], gpu_page_size: Callable[[], int]) -> "EngineConfig":
        """Every machine-dependent default filled in and every value checked: the device
        (detect_device()), the page size (gpu_page_size(): the GPU's tuning table, on cuda), the
        step token budget and batch size, the KV pages for kv_cache_tokens. Idempotent."""
        device = self.device.device or detect_device()
        if device not in DEVICES:
            raise ValueError(f"--device must be cpu or cuda, got {device!r}")
        cache, sched = self.cache, self.scheduler
        page_size = cache.page_size or (gpu_page_size() if device == "cuda" else DEFAULT_PAGE_SIZE)
        tokens = cache.kv_cache_tokens
        max_num_seqs = sched.max_num_seqs or DEFAULT_MAX_NUM_SEQS
        batched = sched.max_num_batched_tokens or default_batched_tokens(device, sched.asynchronous)
        for name, v in (("--max-num-seqs", max_num_seqs), ("--max-num-batched-tokens", batched),
                        ("--block-size", page_size)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.load.max_model_len is not None and self.load.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2, got {self.load.max_model_len}")
        kv_cache_dtype(cache.kv_cache_dtype)          # a bad value fails here, before any build
        self.lora.build()                             # so does a bad LoRA setting
        if not 0 < cache.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {cache.gpu_memory_utilization}")
        for name, v in (("--kv-offloading-size", cache.kv_offloading_size),
                        ("--kv-offloading-disk-size", cache.kv_offloading_disk_size)):
            if not v >= 0:
                raise ValueError(f"{name} must be >= 0 (GiB), got {v}")
        if cache.num_state_snapshots is not None and cache.num_state_snapshots < 0:
            raise ValueError(f"--num-state-snapshots must be >= 0, got {cache.num_state_snapshots}")
        if bool(cache.kv_offloading_disk) != (cache.kv_offloading_disk_size > 0):
            raise ValueError("--kv-offloading-disk (a folder) and --kv-offloading-disk-size (GiB) go together")
        if cache.kv_offloading_disk and not cache.kv_offloading_size:
            raise ValueError("--kv-offloading-disk needs --kv-offloading-size > 0: blocks reach the "
                             "disk through the host tier")
        pages = cache.num_gpu_blocks_override or (-(-tokens // page_size) if tokens else None)
        spec = SpeculativeSettings(speculative_config(self.speculative.speculative_config))
        events = KVEventsSettings(kv_events_config(self.kv_events.kv_events_config))
        return replace(self, device=replace(self.device, device=device), speculative=spec, kv_events=events,
                       cache=replace(cache, page_size=page_size, num_gpu_blocks_override=pages,
                                     kv_cache_tokens=tokens),
                       scheduler=replace(sched, max_num_seqs=max_num_seqs, max_num_batched_tokens=batched))

# Structured outputs (runtime/engine/structured/): a schema, regex or grammar must compile within
# this many seconds (a slower one is a 400, and the compile runs off the event loop and the engine
# thread, so it never stalls other requests); compiled grammars kept, by request, for reuse.
STRUCTURED_COMPILE_TIMEOUT_S = 10.0
STRUCTURED_CACHE_SIZE = 256
STRUCTURED_COMPILE_WORKERS = 2
# JSON outputs in llguidance's compact form ({"a":1,"b":[2,3]}) unless a schema's "x-guidance"
# asks otherwise: with free whitespace, small models were seen to emit whitespace until
# max_tokens (vLLM added disable_any_whitespace for the same reason).
STRUCTURED_JSON_WHITESPACE_FLEXIBLE = False
