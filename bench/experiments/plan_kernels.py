"""The committed qwen3-4b plan's kernels for the experiments that time them beside variants:
a layer launch's generated Triton source as a module, and a plain launch of it on torch tensors
(JIT-compiled by the GPU machine's Triton); and what those experiments time them with."""
import ast
import importlib.util
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

REPO = Path(__file__).resolve().parents[2]


def plan_kernel(pred, model: str = "qwen3-4b", program: str = "decode"):
    """The first launch of a program's layer bodies (any kind) matching pred: (module, META)."""
    kdir = REPO / "generated" / model
    plan = json.loads((kdir / "plan.json").read_text())
    kinds = next(l for l in plan["programs"][program] if "kinds" in l)["kinds"]
    # a layer body by its kind ("layer" in dense plans, "sparse" in qwen3_moe's, ...)
    kid = next(l["kernel_id"] for body in kinds.values() for l in body if pred(l))
    f = kdir / "kernels" / f"{kid}.py"
    meta = next(ast.literal_eval(n.value) for n in ast.parse(f.read_text()).body
                if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "META")
    spec = importlib.util.spec_from_file_location(f"plan_{f.stem}", f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, meta


def plain_launch(mod, meta, src: dict, T: int = 1, B: int = 1):
    """A launch of a plan kernel at (T, B) with its own zeroed scratch, no programmatic dependency:
    src maps the META params' sources ("in:0", "out:1", ...) to tensors. -> a no-argument call."""
    env = {"cdiv": triton.cdiv, "max": max, "min": min, "T": T, "B": B}
    # scratch sizes are bytes; each buffer gets its parameter's element type (counters are i32:
    # Triton's atomics refuse uint8)
    types = {s[len("scratch:"):]: t for _, t, s in meta["params"] if s.startswith("scratch:")}
    dt = {"*i32": torch.int32, "*fp32": torch.float32}
    scratch = {n: torch.zeros(max(4, -(-int(eval(str(e), env)) // 4) * 4), dtype=torch.uint8,
                              device="cuda").view(dt.get(types.get(n), torch.uint8))
               for n, e in meta.get("scratch", {}).items()}
    args = [env[s[len("dim:"):]] if s.startswith("dim:") else
            scratch[s[len("scratch:"):]] if s.startswith("scratch:") else src[s]
            for _, _, s in meta["params"]]
    grid = tuple(int(eval(str(g), env)) for g in meta["grid"])
    kw = dict(meta["constexprs"], num_warps=meta["num_warps"], num_stages=meta["num_stages"])
    if "PDL" in kw:
        kw["PDL"] = False
    fn = getattr(mod, meta["entry"])
    return lambda: fn[grid](*args, **kw)


def graph_us(body, layers: int, reps: int, before=None) -> float:
    """body() (a pass over `layers` layers) captured in one CUDA Graph: the median of `reps`
    replays, us a layer; before() runs ahead of each replay, untimed."""
    body()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    ts = []
    for _ in range(reps):
        if before is not None:
            before()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        g.replay()
        t1.record()
        torch.cuda.synchronize()
        ts.append(t0.elapsed_time(t1) * 1e3 / layers)
    return sorted(ts)[len(ts) // 2]


@triton.jit
def busy(out_ptr, iters, BLOCK: tl.constexpr):
    """Registers only: iters dependent FMAs per lane, one store at the end (a stand-in for a
    kernel that keeps SMs busy without HBM traffic, such as batch-1 attention)."""
    x = tl.arange(0, BLOCK).to(tl.float32)
    for _ in range(iters):
        x = x * 0.999 + 0.5
    tl.store(out_ptr + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), x)


@triton.jit
def read_weights(w_ptr, sink_ptr, n, BLOCK: tl.constexpr, EVICT: tl.constexpr):
    """Stream n bf16 of W with the EVICT eviction policy, their sum per program as the only write:
    a kernel that only reads the weights ("evict_first": the GEMVs' yardstick, gemv_yardstick.py)
    or pulls them into L2 ahead of their GEMV ("evict_last": gemv_l2.py's prefetch)."""
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + offs, mask=offs < n, other=0.0, eviction_policy=EVICT).to(tl.float32)
    tl.store(sink_ptr + tl.program_id(0), tl.sum(acc, 0))
