"""Render kernel templates for every launch of a plan and attach kernel ids to the launches.

A template sees the launch: its op, phase, input/output shapes and dtypes, attributes, the
model config, the KV cache layout, and the tuning parameters for this shape. Identical
rendered sources are one kernel.
"""
import ast
import functools
import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import jinja2

from infc.compiler.contract.bind import LORA_SET_COUNT, LORA_SET_WORDS, LORA_SETS
from infc.compiler.contract.errors import TemplateError
from infc.compiler.ops.expert_upcast import reading_phases
from infc.compiler.contract.weight_roles import FILL_KINDS, fill_key, fill_kinds

TEMPLATES = Path(__file__).resolve().parent.parent.parent / "codegen_templates"
EXT = {"triton": ".py", "cuda": ".cu", "tilelang": ".py"}
TL_DTYPE = {"bf16": "tl.bfloat16", "f16": "tl.float16", "f32": "tl.float32", "i32": "tl.int32",
            "f8e4m3": "tl.float8e4nv", "u8": "tl.uint8", "u4": "tl.uint8", "e2m1": "tl.uint8"}
# quantized codes: fp8 as e4m3 elements, packed codes (two a byte) as bytes
PTR = {"bf16": "*bf16", "f16": "*fp16", "f32": "*fp32", "i32": "*i32", "f8e4m3": "*fp8e4nv",
       "u8": "*u8", "u4": "*u8", "e2m1": "*u8"}
C_DTYPE = {"bf16": "__nv_bfloat16", "f16": "__half", "f32": "float", "i32": "int"}


@dataclass
class Kernel:
    id: str
    backend: str
    template: str
    source: str
    meta: dict


def next_pow2(x, floor: int = 1) -> int:
    """The smallest power of two >= x, and at least `floor` (a power of two): a tile's extent
    (tl.arange needs a power of two) covering x. A template writes `H | next_pow2(16)`."""
    for v in (x, floor):
        if isinstance(v, jinja2.Undefined):
            _ = v + 0                                # jinja2's own UndefinedError, as a comparison raised it
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise TemplateError(f"next_pow2 needs a number, got {x!r}")
    if isinstance(floor, bool) or not isinstance(floor, int) or floor < 1 or floor & (floor - 1):
        raise TemplateError(f"next_pow2's floor must be a power of two, got {floor!r}")
    n = math.ceil(x)
    return max(floor, 1 if n <= 1 else 1 << (n - 1).bit_length())


def _env() -> jinja2.Environment:
    """One environment per templates folder, kept for the process: jinja2 caches each template
    compiled (a template edited since is recompiled: auto_reload compares its mtime), where a new
    environment per build or render parsed and compiled every template again (a fifth of an
    interpreted kernel test's time)."""
    return _env_for(str(TEMPLATES))


@functools.lru_cache(maxsize=None)
def _env_for(folder: str) -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(folder), cache_size=-1,
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True)
    env.filters["tl"] = lambda d: TL_DTYPE[d]
    env.filters["ptr"] = lambda d: PTR[d]
    env.filters["ctype"] = lambda d: C_DTYPE[d]
    env.filters["json"] = lambda v: json.dumps(v)
    env.filters["next_pow2"] = next_pow2
    # a narrow LoRA site's sets of sync words (compiler/contract/bind.py: the runtime's side too)
    env.globals.update(LORA_SETS=LORA_SETS, LORA_SET_COUNT=LORA_SET_COUNT, LORA_SET_WORDS=LORA_SET_WORDS)
    # the programs whose grouped expert GEMMs read the bf16 stack (the references ask the same)
    env.filters["upcast_reads"] = reading_phases
    return env


def parse_meta(source: str, backend: str) -> dict:
    """META is a literal dict in the rendered source (a comment block `// META {...}` in C)."""
    if backend == "cuda":
        line = next((l for l in source.splitlines() if l.startswith("// META ")), None)
        if line is None:
            raise TemplateError("CUDA kernel source has no '// META {...}' line")
        return json.loads(line[len("// META "):])
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "META" for t in node.targets):
            return ast.literal_eval(node.value)
    raise TemplateError("kernel source defines no META dict")


def shape_key(phase: str, tensors: list[dict]) -> str:
    return phase + "|" + ";".join("x".join(str(d) for d in t["shape"]) for t in tensors)


def tune_for(table: dict, template: str, key: str, *more: str) -> dict:
    """The template's "default" entry, then the entry of each key in turn laid over it."""
    entry = table.get("templates", {}).get(template, {})
    out = dict(entry.get("default", {}))
    for k in (key, *more):
        out.update(entry.get(k, {}))
    return out


def _tensor(plan: dict, name: str, strided_ok: bool) -> dict:
    if name == "cache":
        return {"name": name, "shape": [], "dtype": "", "kind": "cache"}
    if name in plan["buffers"]:
        b = plan["buffers"][name]
        out = {"name": name, "shape": b["shape"], "dtype": b["dtype"], "kind": "buffer"}
        if "row_stride" in b:
            # materialize_views copies strided views before ops that cannot read them
            assert strided_ok, f"buffer '{name}' is a strided view feeding a contiguous-only kernel"
            out["row_stride"] = b["row_stride"]
        return out
    w = plan["weights"][name]
    shape = w["shape"]
    return {"name": name, "shape": shape, "dtype": w["dtype"], "kind": "weight"}


def _refusal(undefined: str) -> str:
    """A template refuses a launch by naming an undefined sentence ({{ needs_whole_groups }}):
    said as words, with the name kept for whoever greps the template. Any other undefined name
    is a template bug and is said as jinja2 says it."""
    m = re.fullmatch(r"'(\w+)' is undefined", undefined)
    if m is None or m.group(1).count("_") < 3:
        return undefined
    return f"the kernel refuses this launch: {m.group(1).replace('_', ' ')} ({m.group(1)})"


def render_template(backend: str, template: str, ctx: dict, env=None) -> Kernel:
    """Render one template with a launch context (see docs/kernels.md for the keys)."""
    env = env or _env()
    path = f"{backend}/{template}{EXT[backend]}.j2"
    try:
        source = env.get_template(path).render(**ctx)
    except jinja2.TemplateNotFound:
        raise TemplateError(f"no template {TEMPLATES.name}/{path} for op '{ctx.get('op')}'") from None
    except jinja2.UndefinedError as e:
        raise TemplateError(f"{path}: {_refusal(str(e))}") from None
    except TemplateError as e:                       # a filter's (next_pow2's) complaint
        raise TemplateError(f"{path}: {e}") from None
    digest = hashlib.sha256(source.encode()).hexdigest()[:10]
    return Kernel(f"{template}_{digest}", backend, template, source, parse_meta(source, backend))


def launch_tensors(plan: dict, launch: dict) -> tuple[list[dict], list[dict]]:
    """A launch's input and output tensors as its template sees them."""
    from infc.compiler.contract import caches
    from ..ops import REGISTRY
    strided = REGISTRY[launch["op"]].strided
    ins = [_tensor(plan, n, strided) for n in launch["inputs"]]
    outs = [_tensor(plan, n, False) for n in launch["outputs"]]
    for t in ins + outs:
        if t["kind"] == "cache" and launch.get("caches"):
            # the paged cache's per-token layout (KV heads x head_dim) in the tuning key: two models
            # with the same query heads but other KV heads are other kernels' timings (an H200
            # attention_decode entry tuned on qwen3-30b-a3b's 4 KV heads cost qwen3-4b's 8 0.15 ms)
            t["shape"] = caches.unit_shape(caches.of_plan(plan)[launch["caches"][0]])
    return ins, outs


# A narrow step (compiler/passes/merge_prologues.py) is a decode step of a few tokens: its launches
# render as the decode step's (templates see phase "decode", and narrow = True; the tuning tables'
# "decode|..." entries, with a "narrow|..." entry of the same shapes laid over them where the
# table has one: a tile for one row alone (the CUDA-core path), which the decode program's rows keep out of),
# so only a template that reads `narrow` (the GEMV and attention: a merged prologue)
# or a narrow entry makes a kernel of its own. A verify step (a speculative build's 2..k + 1 rows,
# compiler/passes/select_kernels.py) runs the narrow launches rendered the same way but
# `narrow_rows` = plan["verify_tokens"] wide (its GEMVs: every row on the CUDA-core path, on the
# narrow entry's tiles unless a "verify|...|r<rows>" entry lies over them: verify_key), so the
# narrow program's own kernels stay a one-token build's.
AS_PHASE = {"narrow": "decode", "verify": "decode"}
NARROW_ROWS = {"narrow": "narrow_tokens", "verify": "verify_tokens"}


def narrow_key(key: str) -> str:
    """The narrow step's own entry beside a decode key: "decode|S" -> "narrow|S"."""
    return "narrow|" + key.split("|", 1)[1]


def verify_key(key: str, rows: int) -> str:
    """A verify launch's own entry, per row count, laid over the narrow one: "decode|S" ->
    "verify|S|r<rows>". Its GEMVs run every row on the CUDA-core path (gemv.py.j2 VERIFY_ROWS), whose
    best tile depends on the rows it holds sums for, so a 5-row build's timings are not a 3-row
    one's and neither changes the one-row step's kernels."""
    return f"verify|{key.split('|', 1)[1]}|r{rows}"


def tuning_key(plan: dict, launch: dict, phase: str, tensors=None) -> str:
    """The key of a launch in the tuning tables: the phase and its tensors' shapes (tensors:
    launch_tensors' result, where the caller has it). A merged launch is keyed as its consumer
    alone (the producer's output it reads, then the consumer's other tensors): its tiles are the
    consumer's; a launch with a merged epilogue (merge_epilogues) as its producer alone."""
    ins, outs = tensors or launch_tensors(plan, launch)
    if launch.get("lora"):          # a LoRA site in the GEMV (merge_lora): the GEMV's tiles
        ins = ins[:-launch["lora"]["inputs"]]
    if launch["attrs"].get("has_w_upcast"):
        # the stack dequantized once (compiler/passes/upcast_experts.py, the last input): the
        # launch keeps the codes GEMM's entries (the wide program's tuned tiles among them)
        ins = ins[:-1]
    epi = launch.get("epilogue")
    if epi is not None:             # a consumer in the producer's launch (merge_epilogues): the producer's
        outs = outs[:-epi["writes"]]
        ins = ins[:len(ins) - epi.get("reads", 0)]
    pro = launch.get("prologue")
    if pro is not None:
        ins = ins[pro["inputs"]:]
        ins.insert(pro.get("feeds", 0), _tensor(plan, pro["value"], False))
        outs = outs[pro["writes"]:]
    return shape_key(AS_PHASE.get(phase, phase), ins + outs)


def lora_key(key: str, lora: dict) -> str:
    """A LoRA site's own entry beside its GEMV's key (compiler/passes/merge_lora.py), laid over it:
    "narrow|S" -> "narrow|S|lora<pieces>x<rank>". The shrink's tunables (LORA_KS, LORA_PROGRAMS)
    and any GEMV tile `infc tune` finds better with the site in the launch go there, so a LoRA
    build's timings never change the base model's kernels."""
    return f"{key}|lora{len(lora['pieces'])}x{lora['rank']}"


def tuning_keys(plan: dict, launch: dict, phase: str, tensors=None) -> tuple:
    """The table keys a launch renders with, in the order their entries are laid over the template's
    default: its tuning_key, then a narrow step's narrow key, then a verify step's verify_key, then a
    merged LoRA site's lora_key. The last is the launch's own, the one `infc tune` fills."""
    key = tuning_key(plan, launch, phase, tensors)
    keys = (key, narrow_key(key)) if phase in NARROW_ROWS else (key,)
    if phase == "verify":
        keys += (verify_key(key, plan["verify_tokens"]),)
    if launch.get("lora"):
        keys += (lora_key(keys[-1], launch["lora"]),)
    return keys


def row_cap(plan: dict, phase: str) -> int:
    """The most rows a decode launch takes (the wide program's start less one), 0 where the plan
    bounds none (a kernel that sizes scratch by it refuses)."""
    return plan["wide_tokens"] - 1 if phase == "decode" and plan.get("wide_tokens") else 0


def launch_context(plan: dict, launch: dict, phase: str, tuning: dict, page_size: int) -> dict:
    ins, outs = launch_tensors(plan, launch)
    caches = {n: {**c, "page_size": page_size} for n, c in plan.get("caches", {}).items()}
    keys = tuning_keys(plan, launch, phase, (ins, outs))
    narrow = phase in NARROW_ROWS
    return {"op": launch["op"], "phase": AS_PHASE.get(phase, phase), "narrow": narrow,
            "narrow_rows": plan.get(NARROW_ROWS[phase], 1) if narrow else 0,
            "row_cap": row_cap(plan, phase),
            "inputs": ins, "outputs": outs, "attrs": launch["attrs"], "prologue": launch.get("prologue"),
            "epilogue": launch.get("epilogue"),
            "lora": launch.get("lora"), "config": plan["config"], "caches": caches, "page_size": page_size,
            "tune": tune_for(tuning, launch["kernel"], *keys)}


# The runtime's sampler: launched after a step on the logits output (f32 [B, V]), outside the
# graph, so the host receives B token ids (and only the logprob rows a request asked for) instead
# of B x V logits. name in plan["sampler"] -> template.
SAMPLER = {"sample": "sample", "argmax": "sample_argmax", "log_softmax": "log_softmax",
           "logits_process": "logits_process"}     # penalties, logit_bias, bans, bitmasks


def render_sampler(plan: dict, tuning: dict, env=None) -> dict[str, Kernel]:
    """Render the sampler kernels for the plan's vocabulary; sets plan["sampler"] (name -> id)."""
    V = plan["buffers"][plan["outputs"]["logits"]]["shape"][-1]
    out, plan["sampler"] = {}, {}
    for name, template in SAMPLER.items():
        ctx = {"op": template, "phase": "sample", "inputs": [], "outputs": [], "attrs": {},
               "config": {**plan["config"], "V": V}, "kv": {},
               "tune": tune_for(tuning, template, f"sample|V={V}")}
        k = render_template("triton", template, ctx, env)
        out[k.id] = k
        plan["sampler"][name] = k.id
    return out


# --load-format dummy: random weights made on the device (runtime/weights/dummy.py), one launch
# per weight region before the first step. GPU weights are bf16 (plan["weight_init"] fills them);
# a plan with other weights (a spec's `dtype: f32`, a quantized checkpoint's codes, scales, zero
# points and group indices) gets one more kernel per fill kind it needs, plan["weight_init_<kind>"]
# (compiler/contract/weight_roles.py), so the other plans stay as they were.
WEIGHT_INIT = "fill_random"


def _render_fill(kind: str, env=None) -> Kernel:
    dtype, mode = FILL_KINDS[kind]
    ctx = {"op": WEIGHT_INIT, "phase": "weight_init", "inputs": [], "outputs": [], "attrs": {},
           "config": {"dtype": dtype, "mode": mode}, "tune": {}}
    return render_template("triton", WEIGHT_INIT, ctx, env)


def render_weight_init(plan: dict, env=None, kind: str = "bf16") -> Kernel:
    """Render the weight fill kernel of a fill kind; sets plan[fill_key(kind)] to its id."""
    k = _render_fill(kind, env)
    plan[fill_key(kind)] = k.id
    return k


# The KV tiers' copies (runtime/cuda/kv_copies.py): one launch a batch moves every (cache, layer,
# page) block between the device's pages and the pinned host slab. Only a build for serving with
# the host tier (--kv-offloading-size) renders it (plan["block_copy"]), so other plans stay as they
# were; a copier without it issues one 2D copy per (cache, layer) and run of pages instead. The
# kernel reads its addresses from tables, so one rendering serves the KV cache and the state
# snapshot pool alike: only the word it moves depends on the plan (the widest that divides every
# region's page, and so every offset in a block).
BLOCK_COPY = "block_copy"


def block_copy_words(plan: dict, page_size: int) -> tuple[int, int]:
    """(word bytes, words a vector) for the plan's tier copies: the greatest common divisor of 16
    and every page (paged caches, page_size tokens) and snapshot (slot caches) region's bytes."""
    import math

    from infc.compiler.contract import caches
    decl = caches.of_plan(plan)
    g = 16
    for c in decl.values():
        n = caches.unit_elems(c) * caches.DTYPE_BYTES[c["dtype"]]
        g = math.gcd(g, n * caches.rows_per_page(c, page_size) if c["kind"] == "paged" else n)
    word = 4 if g % 4 == 0 else 2 if g % 2 == 0 else 1
    return word, g // word


def render_block_copy(plan: dict, page_size: int, tuning: dict | None = None, env=None) -> Kernel:
    """Render the tiers' copy kernel for the plan's caches; sets plan["block_copy"] to its id."""
    word, vec = block_copy_words(plan, page_size)
    ctx = {"op": BLOCK_COPY, "phase": "tier", "inputs": [], "outputs": [], "attrs": {},
           "config": {"word": word, "vec": vec},
           "tune": tune_for(tuning or {}, BLOCK_COPY, f"tier|word={word}")}
    k = render_template("triton", BLOCK_COPY, ctx, env)
    plan["block_copy"] = k.id
    return k


def render_plan(plan: dict, tuning: dict, page_size: int, spec_path: str | None = None,
                kv_offloading: bool = False) -> dict[str, Kernel]:
    """Render every launch's kernel, the sampler's and the weight fill; sets launch["kernel_id"],
    plan["sampler"] and plan["weight_init"] (and weight_init_<kind>); returns id -> Kernel.
    kv_offloading: a build for serving with the host KV tier: the tiers' copy kernel too."""
    env = _env()
    kernels: dict[str, Kernel] = {}

    from infc.compiler.contract.program import launches
    from . import lora_sets

    def render_launches(only=None):
        for phase, program in plan["programs"].items():
            for launch, _ in launches(program):
                if launch["backend"] == "nccl":      # a collective: the runtime's communicator runs it
                    continue
                if only is not None:
                    if launch.get("kernel_id") not in only:
                        continue
                    launch["lora"] = {**launch["lora"], "sets": False}
                ctx = launch_context(plan, launch, phase, tuning, page_size)
                try:
                    k = render_template(launch["backend"], launch["kernel"], ctx, env)
                except TemplateError as e:     # name the spec statement, not the kernel alone
                    raise TemplateError(f"{spec_path or 'spec'}:{launch.get('line')}: {launch['op']} "
                                        f"({phase}): {e}") from None
                kernels.setdefault(k.id, k)
                launch["kernel_id"] = k.id

    render_launches()
    # LoRA sites whose launches could meet their own sync words again: the departure form
    # (lora_sets.py); taking launches out of a kernel can make what is left of it clash, so again
    bad = lora_sets.clashing(plan, kernels)
    while bad:
        render_launches(only=bad)
        for kid in bad:
            del kernels[kid]
        bad = lora_sets.clashing(plan, kernels)
    if plan["outputs"].get("logits") in plan["buffers"]:
        for kid, k in render_sampler(plan, tuning, env).items():
            kernels.setdefault(kid, k)
    for kind in fill_kinds(plan):
        k = render_weight_init(plan, env, kind)
        kernels.setdefault(k.id, k)
    if kv_offloading and any(c["kind"] == "paged" for c in plan.get("caches", {}).values()):
        k = render_block_copy(plan, page_size, tuning, env)
        kernels.setdefault(k.id, k)
    return kernels
