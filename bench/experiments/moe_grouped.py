"""Issue 11, MoE prefill and decode: the expert kernels at qwen3-30b-a3b's shapes (H=2048, 128
experts, top-8, F=768, bf16), timed on the GPU from cubins built here, against the op references:
in prefill the grouped GEMMs (moe_gate_up_grouped, moe_down_grouped), in decode (--phase decode)
the per-expert GEMVs (moe_gate_up, moe_down).

Two halves, as `infc tune`: cubins are compiled here (no GPU), timed there (no compiler, no torch:
cuda-python + numpy, launched as runtime/cuda launches them: META params bound by bind.Resolver,
packed once, cuLaunchKernel, CUDA Graphs for timing as runtime/cuda/tune_run.py does).

    here:  python bench/experiments/moe_grouped.py prep [--phase decode]   # -> .cache/bench/moe_<phase>/
    GPU:   python3 bench/experiments/moe_grouped.py run --dir .cache/bench/moe_<phase> --out OUT_DIR
           (carry .cache/bench/moe_<phase>)

prep renders, from the qwen3-30b-a3b plan's first prefill launches of moe_route_align,
moe_gate_up and moe_down (with the h100 tuning table, so "default" is exactly the kernel
`infc build` makes), the default kernels, a few tile variants of the two grouped GEMMs, and the
kernels of commit BASELINE (the templates before this rewrite), and compiles them for sm_90.

run, at T = 1024, 4096, 8192 tokens with random router logits (N(0, 1): near-uniform expert
loads): the plan's moe_route_align kernel groups the tokens; every variant is launched once into
a NaN-poisoned output and checked (every row written; a random subset of tokens against the
numpy op references in compiler/ops/moe.py, rel. L2 <= 1e-2; moe_down's counters left zero and
two launches bit-identical), then timed as a CUDA Graph (median of replays). Prints us, TFLOP/s
and % of the 989 TFLOP/s bf16 dense peak on the active FLOPs (2 T k H 2F for gate_up, 2 T k F H
for down: the tokens' chosen experts only, no padding), the weight-streaming floor (weight bytes /
copy bandwidth measured in the same run), and the whole MoE block (route+align, gate_up, down in
one graph). Results: OUT_DIR/exp-moe-grouped-qwen3-30b-a3b-<gpu>.json.

Decode (--phase decode, default --tokens 1,4,16,64): the same from the decode program's launches
(moe_route without the grouping, the per-expert GEMVs), every pass on other token rows (PASSES
sets of random logits, so the chosen experts' weights are not L2-resident from the pass
before, as in a model where each layer has its own experts), and the floor is the bytes of the
experts the pass chose over the copy bandwidth: the % printed is of that floor, not of peak.
"""
import argparse
import importlib.util
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
MODEL = "qwen3-30b-a3b"
PAGE = 16
PEAK = 989e12                     # H100 SXM dense bf16 (no sparsity), FLOP/s
BASELINE = "dc4f1a2"              # the grouped templates before the rewrite (issue 11's first MoE kernels)
OPS = ("moe_route_align", "moe_gate_up", "moe_down")
PASSES = {"prefill": 1, "decode": 16}   # token-row sets cycled through when timing (see above)
# tile variants timed beside the default (tune keys the templates read)
DECODE_VARIANTS = {
    "moe_gate_up": [
        ("tensor_cores", {"FMA_T": 0}),
        ("tc_k128", {"FMA_T": 0, "BLOCK_K": 128}),
        ("tc_f32_k128", {"FMA_T": 0, "BLOCK_F": 32, "BLOCK_K": 128}),
        ("tc_stages2", {"FMA_T": 0, "num_stages": 2}),
        ("f32", {"BLOCK_F": 32}),
        ("warps8", {"num_warps": 8}),
        ("k512", {"FMA_BLOCK_K": 512}),
        ("stages1", {"num_stages": 1}),
    ],
    "moe_down": [
        ("tensor_cores", {"FMA_T": 0}),
        ("tc_h32", {"FMA_T": 0, "BLOCK_H": 32}),
        ("tc_k128", {"FMA_T": 0, "BLOCK_K": 128}),
        ("h32", {"BLOCK_H": 32}),
        ("h32_w4", {"BLOCK_H": 32, "num_warps": 4}),
        ("k256", {"FMA_BLOCK_K": 256}),
        ("stages1", {"num_stages": 1}),
    ],
}
VARIANTS = {
    "moe_gate_up": [
        ("dots2", {"PAIR": 0}),
        ("no_half_tail", {"HALF_TAIL": 0}),
        ("stages4", {"num_stages": 4}),
        ("dots2_stages4", {"PAIR": 0, "num_stages": 4}),
        ("group1", {"GROUP_M": 1}),
        ("group16", {"GROUP_M": 16}),
        ("bk128_s2", {"BLOCK_K": 128, "num_stages": 2}),
        ("m64_w4", {"BLOCK_M": 64, "num_warps": 4}),
        ("f64", {"BLOCK_F": 64}),
    ],
    "moe_down": [
        ("no_half_tail", {"HALF_TAIL": 0}),
        ("stages4", {"num_stages": 4}),
        ("h128", {"BLOCK_H": 128}),
        ("h128_stages4", {"BLOCK_H": 128, "num_stages": 4}),
        ("group1", {"GROUP_M": 1}),
        ("group16", {"GROUP_M": 16}),
        ("cr32", {"COMBINE_ROWS": 32}),
        ("bk128_s2", {"BLOCK_K": 128, "num_stages": 2}),
        ("m64_w4", {"BLOCK_M": 64, "num_warps": 4}),
        ("m64_h128_w4", {"BLOCK_M": 64, "BLOCK_H": 128, "num_warps": 4}),
    ],
}
# positional roles of each op's tensors (compiler/ops/moe.py)
ROLES = {"moe_route_align": (["logits"], ["topw", "topi", "rows", "counts"]),
         "moe_gate_up": (["x", "topi", "w_gu", "rows", "counts"], ["act"]),
         "moe_down": (["act", "topw", "topi", "w_down", "rows", "counts"], ["y"])}


def _import_infc():
    """`import infc` from this tree whether or not it is pip-installed: pyproject maps
    infc.{compiler,runtime,bench} to the top-level folders; the same mapping by package path."""
    try:
        import infc.compiler.contract.bind  # noqa: F401
        return
    except ImportError:
        pass
    for name in [m for m in sys.modules if m == "infc" or m.startswith("infc.")]:
        del sys.modules[name]
    spec = importlib.util.spec_from_file_location("infc", REPO / "infc" / "__init__.py",
                                                  submodule_search_locations=[str(REPO / "infc"), str(REPO)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["infc"] = mod
    spec.loader.exec_module(mod)


# --- here: render and compile -----------------------------------------------------------------

def _git_env(commit: str):
    """A template environment reading codegen_templates/ as of `commit` (the baseline kernels)."""
    import subprocess

    import jinja2

    from infc.compiler.codegen.render import _env

    def load(name):
        r = subprocess.run(["git", "show", f"{commit}:codegen_templates/{name}"], cwd=REPO,
                           capture_output=True, text=True)
        return r.stdout if r.returncode == 0 else None

    env = _env()
    env.loader = jinja2.FunctionLoader(load)
    return env


def prep(out: Path, gpu: str, baseline: str | None, jobs: int | None, phase: str = "prefill"):
    from infc.compiler.build import compile_model, load_tuning
    from infc.compiler.codegen.aot import compile_kernels
    from infc.compiler.codegen.render import EXT, launch_context, render_plan, render_template
    from infc.compiler.contract.program import launches

    t0 = time.perf_counter()
    _, plan = compile_model(MODEL)
    table = load_tuning(gpu)
    render_plan(plan, table, PAGE)               # launch["kernel_id"]: what `infc build` makes
    found = {}
    for launch, _ in launches(plan["programs"][phase]):
        if launch["op"] in OPS and launch["op"] not in found:
            found[launch["op"]] = launch
    missing = [op for op in OPS if op not in found]
    if missing:
        raise SystemExit(f"{MODEL}'s {phase} program has no launch of {missing}")
    benv = _git_env(baseline) if baseline else None
    variants_of = DECODE_VARIANTS if phase == "decode" else VARIANTS
    kernels, ops = {}, {}
    for op, launch in found.items():
        ctx = launch_context(plan, launch, phase, table, PAGE)
        variants = []
        for name, tune in [("default", {})] + variants_of.get(op, []):
            k = render_template("triton", launch["kernel"], dict(ctx, tune={**ctx["tune"], **tune}))
            if name == "default":
                assert k.id == launch["kernel_id"], (op, k.id, launch["kernel_id"])
            if any(v["kernel"] == k.id for v in variants):
                continue
            kernels[k.id] = k
            variants.append({"name": name, "tune": tune, "kernel": k.id, "meta": k.meta})
        if benv is not None and op != "moe_route_align":
            k = render_template("triton", launch["kernel"], dict(ctx, tune={}), benv)
            kernels[k.id] = k
            variants.append({"name": f"before@{baseline}", "tune": {}, "kernel": k.id, "meta": k.meta})
        ops[op] = {"template": launch["kernel"], "variants": variants,
                   "inputs": ctx["inputs"], "outputs": ctx["outputs"], "attrs": launch["attrs"]}
    import shutil
    for sub in ("kernels", "bin"):
        shutil.rmtree(out / sub, ignore_errors=True)
    (out / "kernels").mkdir(parents=True, exist_ok=True)
    for kid, k in kernels.items():
        (out / "kernels" / f"{kid}{EXT[k.backend]}").write_text(k.source)
    print(f"[moe_grouped] {phase}: {len(kernels)} kernels rendered; compiling for sm_90 ...", flush=True)
    compile_kernels(kernels, out / "bin", "sm_90", jobs)
    c = plan["config"]
    from infc.bench.common import commit
    manifest = {"model": MODEL, "table": gpu, "commit": commit(), "baseline": baseline, "phase": phase,
                "config": {"H": c["H"], "F": c["Fe"], "E": c["E"], "K": c["K"]}, "ops": ops}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for op, o in ops.items():
        print(f"  {op:<16} {o['template']:<22} " + ", ".join(f"{v['name']}={v['kernel']}" for v in o["variants"]))
    print(f"[moe_grouped] wrote {out} in {time.perf_counter() - t0:.0f} s")


# --- GPU: load, check, time -------------------------------------------------------------------

def to_bf16(x: np.ndarray) -> np.ndarray:
    b = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(u: np.ndarray) -> np.ndarray:
    return (np.asarray(u, np.uint16).astype(np.uint32) << 16).view(np.float32)


class Experts:
    """bf16 expert weights on the host (uint16 [E, R, C]) seen as float32 per expert, which is all
    the op references index (w.shape, w[e])."""

    def __init__(self, raw: np.ndarray):
        self.raw, self.shape, self._cache = raw, raw.shape, {}

    def __getitem__(self, e):
        e = int(e)
        if e not in self._cache:
            self._cache[e] = from_bf16(self.raw[e])
        return self._cache[e]


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(float(np.linalg.norm(want)), 1e-30))


class Kern:
    def __init__(self, drv, bin_dir: Path, v: dict):
        from infc.compiler.contract.bind import KernelInfo
        info = json.loads((bin_dir / f"{v['kernel']}.json").read_text())
        self.v, self.name, self.meta = v, v["name"], v["meta"]
        self.k = KernelInfo(v["kernel"], v["meta"], info)
        self.fn = drv.Module((bin_dir / f"{v['kernel']}.cubin").read_bytes()).function(info["name"], self.k.shared)
        self.regs, self.blocks_per_sm = _occupancy(self.fn, self.k.block[0], self.k.shared)


def _occupancy(fn, threads: int, shared: int):
    try:
        from cuda.bindings import driver as cu
        regs = cu.cuFuncGetAttribute(cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, fn)[1]
        blocks = cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, threads, shared)[1]
        return int(regs), int(blocks)
    except Exception:                       # diagnostics only
        return None, None


class Bench:
    def __init__(self, drv, ctx, d: Path, man: dict, tmax: int, seed: int):
        self.drv, self.ctx, self.man = drv, ctx, man
        c = man["config"]
        self.H, self.F, self.E, self.K = c["H"], c["F"], c["E"], c["K"]
        self.kern = {op: [Kern(drv, d / "bin", v) for v in o["variants"]] for op, o in man["ops"].items()}
        H, F, E, K = self.H, self.F, self.E, self.K
        rng = np.random.default_rng(seed)
        t0 = time.perf_counter()
        # weights: N(0, 1/fan_in) in bf16, made per expert (host copies kept for the references)
        self.w_gu = np.empty((E, 2 * F, H), np.uint16)
        self.w_down = np.empty((E, H, F), np.uint16)
        for e in range(E):
            self.w_gu[e] = to_bf16(rng.standard_normal((2 * F, H), np.float32) / np.float32(math.sqrt(H)))
            self.w_down[e] = to_bf16(rng.standard_normal((H, F), np.float32) / np.float32(math.sqrt(F)))
        self.x = to_bf16(rng.standard_normal((tmax, H), np.float32))
        self.logits = to_bf16(rng.standard_normal((tmax, E), np.float32))
        sizes = {"logits": tmax * E * 2, "topw": tmax * K * 4, "topi": tmax * K * 4, "rows": E * tmax * 4,
                 "counts": E * 4, "x": tmax * H * 2, "w_gu": self.w_gu.nbytes, "w_down": self.w_down.nbytes,
                 "act": tmax * K * F * 2, "y": tmax * H * 2}
        self.ptr = {n: ctx.alloc(b) for n, b in sizes.items()}
        self.nbytes = sizes
        # bytes a token row takes in each per-token tensor (a pass over other rows binds them shifted)
        self.row_bytes = {"logits": E * 2, "topw": K * 4, "topi": K * 4, "x": H * 2, "act": K * F * 2, "y": H * 2}
        self.decode = man.get("phase", "prefill") == "decode"
        for n, host in (("w_gu", self.w_gu), ("w_down", self.w_down), ("x", self.x), ("logits", self.logits)):
            ctx.htod(self.ptr[n], host)
            ctx.sync()
        print(f"[moe_grouped] data made and copied in {time.perf_counter() - t0:.1f} s", flush=True)

    # binding and launching, as the runtime does
    def bind(self, kern: Kern, T: int, row0: int = 0):
        """A launch of `kern` over token rows row0 .. row0 + T - 1 (decode steps have B = T)."""
        from infc.compiler.contract.bind import Resolver, grid, scratch_sizes
        op = next(o for o, ks in self.kern.items() if kern in ks)
        ins, outs = ROLES[op]
        dims = {"T": T, "B": T if self.decode else 1}
        scratch = {}
        for name, nbytes in scratch_sizes(kern.meta, dims).items():
            scratch[name] = (self.ctx.alloc(max(nbytes, 4)), max(nbytes, 4))
            self.ctx.memset(scratch[name][0], scratch[name][1], 0)
        res = Resolver(tensor=lambda n, layer: self.ptr[n] + row0 * self.row_bytes.get(n, 0),
                       scratch=lambda k, n: scratch[n][0], dim=dims.__getitem__)
        args = self.drv.PackedArgs(*kern.k.arg_lists(res.values(kern.meta, ins, outs, kernel=kern.k.id)))
        g = grid(kern.meta, dims)

        def launch():
            self.drv.launch(self.ctx, kern.fn, g, kern.k.block, kern.k.shared, args)
        launch.scratch, launch.args, launch.grid = scratch, args, g
        return launch

    def free_scratch(self, launch):
        for p, _ in launch.scratch.values():
            self.ctx.free(p)

    def counters_zero(self, launch) -> bool:
        for name, (p, n) in launch.scratch.items():
            if name.startswith("counter"):
                raw = np.empty(n, np.uint8)
                self.ctx.dtoh(raw, p)
                self.ctx.sync()
                if raw.any():
                    return False
        return True

    def read(self, name, shape, dtype):
        raw = np.empty(int(np.prod(shape)) * np.dtype(dtype).itemsize, np.uint8)
        self.ctx.dtoh(raw, self.ptr[name])
        self.ctx.sync()
        return raw.view(dtype).reshape(shape)

    def time(self, launches, reps: int, target_us: float = 3000.0) -> float:
        """Median us per pass of `launches` (a list of launch functions), from CUDA Graphs of
        `inner` passes (replays event-timed, as tune_run)."""
        ctx = self.ctx
        e0, e1 = ctx.event(), ctx.event()
        for _ in range(2):
            for f in launches:
                f()
        ctx.sync()
        e0.record()
        for f in launches:
            f()
        e1.record()
        est = max(e1.ms_since(e0) * 1e3, 1.0)
        inner = int(min(64, max(1, math.ceil(target_us / est))))
        g = self.drv.Graph(ctx, lambda: [f() for _ in range(inner) for f in launches])
        g.launch()
        ctx.sync()
        xs = []
        for _ in range(reps):
            e0.record()
            g.launch()
            e1.record()
            xs.append(e1.ms_since(e0) * 1e3 / inner)
        return float(np.median(xs))


def run(d: Path, tokens, out: Path | None, reps: int, subset: int, seed: int, driver=None,
        copy_bytes: int = 2 << 30):
    """driver: runtime/cuda/driver (None) or a stand-in with its names (tests/fake_cuda.py)."""
    _import_infc()
    from infc.bench.common import copy_bandwidth, header, save
    from infc.compiler.ops import moe as ref
    drv = driver
    if drv is None:
        from infc.runtime.cuda import driver as drv

    man = json.loads((d / "manifest.json").read_text())
    ctx = drv.Context()
    print(f"[moe_grouped] {ctx.name}, {ctx.sm_count} SMs; kernels of {man['commit']} (table {man['table']})", flush=True)
    try:
        bw = copy_bandwidth(ctx, copy_bytes)
    except ZeroDivisionError:            # a stand-in driver whose copies take no time
        bw = float("nan")
    print(f"[moe_grouped] copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    phase = man.get("phase", "prefill")
    decode, P = phase == "decode", PASSES[phase]
    b = Bench(drv, ctx, d, man, max(tokens) * P, seed)
    H, F, E, K = b.H, b.F, b.E, b.K
    for op, ks in b.kern.items():
        for k in ks:
            print(f"  {op:<16} {k.name:<20} regs {k.regs}, shared {k.k.shared}, {k.blocks_per_sm} CTA/SM, "
                  f"{k.k.block[0] // 32} warps", flush=True)
    res = header(ctx, MODEL)
    res.update({"copy_bw": bw, "peak_flops": PEAK, "config": man["config"], "prepared_at": man["commit"],
                "baseline": man["baseline"], "subset": subset, "reps": reps, "runs": [], "failures": []})
    gu_w, down_w = Experts(b.w_gu), Experts(b.w_down)
    fails = res["failures"]

    def fail(msg):
        print("  FAIL " + msg, flush=True)
        fails.append(msg)

    for T in tokens:
        print(f"\n[moe_grouped] T = {T} tokens", flush=True)
        rng = np.random.default_rng(seed + T)
        sub = np.unique(np.concatenate([[0, T - 1], rng.choice(T, size=min(subset, T), replace=False)]))
        fl_gu, fl_down = 2.0 * T * K * H * 2 * F, 2.0 * T * K * F * H
        # route + align: the plan's kernel, checked against the reference
        route = b.kern["moe_route_align"][0]
        rls = [b.bind(route, T, i * T) for i in range(P)]
        rl = rls[0]
        for f in rls:
            f()
        ctx.sync()
        if not b.counters_zero(rl):
            fail(f"T={T} moe_route_align left its counters non-zero")
        ids = b.read("topi", (T * K,), np.int32)[: T * K].reshape(T, K).copy()
        w = b.read("topw", (T * K,), np.float32)[: T * K].reshape(T, K).copy()
        counts = b.read("counts", (E,), np.int32).copy()
        rows = b.read("rows", (E * T,), np.int32)[: E * T].reshape(E, T).copy()
        attrs = man["ops"]["moe_route_align"]["attrs"]
        w_ref, ids_ref, rows_ref, counts_ref = ref.route_align(None, from_bf16(b.logits[:T]), **attrs)
        if not np.array_equal(ids, ids_ref):
            fail(f"T={T} route ids differ from the reference in {int((ids != ids_ref).any(1).sum())} rows")
        if not np.allclose(w, w_ref, rtol=1e-5, atol=1e-7):
            fail(f"T={T} route weights differ from the reference")
        if not decode and (not np.array_equal(counts, counts_ref) or any(
                sorted(rows[e, :counts[e]].tolist()) != rows_ref[e, :counts_ref[e]].tolist() for e in range(E))):
            fail(f"T={T} moe_align grouping differs from the reference")
        route_us = b.time(rls, reps) / P
        for f in rls[1:]:
            b.free_scratch(f)
        if decode:      # the experts each pass chose: what its expert kernels must read
            ids_all = b.read("topi", (P * T * K,), np.int32)[: P * T * K].reshape(P, T, K)
            distinct = float(np.mean([len(np.unique(i[i >= 0])) for i in ids_all]))
            counts = np.bincount(ids[ids >= 0], minlength=E)
        print(f"  moe_route_align  {route_us:9.1f} us   (experts: {int(counts.min())}..{int(counts.max())} "
              f"tokens, mean {counts.mean():.0f}" + (f"; {distinct:.1f} distinct a pass)" if decode else ")"),
              flush=True)
        res["runs"].append({"T": T, "op": "moe_route_align", "variant": "default", "us": route_us,
                            "counts_min": int(counts.min()), "counts_max": int(counts.max())})
        x32 = from_bf16(b.x[sub])
        act_ref = ref.gate_up(None, x32, ids[sub], gu_w)
        if decode:      # the chosen experts' bytes at the copy bandwidth, as bench latency's floor
            floors = {op: distinct * w.nbytes / E / bw for op, w in (("moe_gate_up", b.w_gu), ("moe_down", b.w_down))}
        else:
            floors = {"moe_gate_up": b.w_gu.nbytes / (bw / 2), "moe_down": b.w_down.nbytes / (bw / 2)}
        best = {}
        act_default, y_ref = None, None
        for op, flops in (("moe_gate_up", fl_gu), ("moe_down", fl_down)):
            for k in b.kern[op]:
                lf = b.bind(k, T)
                out_name = "act" if op == "moe_gate_up" else "y"
                n_out = T * K * F if op == "moe_gate_up" else T * H
                if op == "moe_down":
                    ctx.htod(b.ptr["act"], act_default)     # every down variant reads the same act
                ctx.memset(b.ptr[out_name], n_out * 2, 0xFF)  # NaN: unwritten rows show up
                lf()
                ctx.sync()
                got = from_bf16(b.read(out_name, (n_out,), np.uint16)[:n_out].copy())
                tag = f"T={T} {op} {k.name}"
                ok = True
                if not np.isfinite(got).all():
                    fail(f"{tag}: {int((~np.isfinite(got)).sum())} outputs unwritten or not finite")
                    ok = False
                if op == "moe_gate_up":
                    got = got.reshape(T, K, F)
                    err = rel_err(got[sub], act_ref)
                    if k.name == "default":
                        act_default = to_bf16(got)
                else:
                    got = got.reshape(T, H)
                    if y_ref is None:
                        y_ref = ref.down(None, from_bf16(act_default.reshape(T, K, F)[sub]), w[sub], ids[sub], down_w)
                    err = rel_err(got[sub], y_ref)
                    if not b.counters_zero(lf):
                        fail(f"{tag}: counters left non-zero")
                        ok = False
                    first = b.read("y", (T * H,), np.uint16)[: T * H].copy()
                    lf()
                    ctx.sync()
                    if not np.array_equal(first, b.read("y", (T * H,), np.uint16)[: T * H]):
                        fail(f"{tag}: a second launch gave other bits")
                        ok = False
                if err > 1e-2:
                    fail(f"{tag}: rel. L2 error {err:.2e} against the reference (> 1e-2)")
                    ok = False
                if op == "moe_down" and decode and k is b.kern[op][0]:
                    _gate_up_passes(b, T, P)     # the other passes' act rows, for their down launches
                timed = [lf] + [b.bind(k, T, i * T) for i in range(1, P)]
                us = b.time(timed, reps) / P
                if op == "moe_down" and not all(b.counters_zero(f) for f in timed):
                    fail(f"{tag}: counters non-zero after timing")
                    ok = False
                for f in timed:
                    b.free_scratch(f)
                pct = flops / (us * 1e-6) / PEAK * 100
                floor_pct = floors[op] * 1e6 / us * 100
                print(f"  {op:<16} {k.name:<20} {us:9.1f} us  {flops / us / 1e6:6.0f} TFLOP/s  {pct:5.1f} % of peak"
                      f"  weight stream {floor_pct:5.1f} % of copy bw  err {err:.1e}{'' if ok else '  FAILED'}",
                      flush=True)
                res["runs"].append({"T": T, "op": op, "variant": k.name, "kernel": k.v["kernel"], "tune": k.v["tune"],
                                    "us": us, "tflops": flops / us / 1e6, "pct_peak": pct, "rel_err": err,
                                    "pct_floor": floor_pct,
                                    "weight_floor_us": floors[op] * 1e6, "ok": ok, "regs": k.regs,
                                    "ctas_per_sm": k.blocks_per_sm})
                if ok and not k.name.startswith("before") and (op not in best or us < best[op][1]):
                    best[op] = (k, us)
        # the whole MoE block in one graph: default kernels, then the best variants
        for label, pick in (("default", lambda op: b.kern[op][0]), ("best", lambda op: best.get(op, (b.kern[op][0],))[0])):
            ls = [b.bind(kern, T, i * T) for i in range(P)
                  for kern in (b.kern["moe_route_align"][0], pick("moe_gate_up"), pick("moe_down"))]
            us = b.time(ls, reps) / P
            for lf in ls:
                b.free_scratch(lf)
            pct = (fl_gu + fl_down) / (us * 1e-6) / PEAK * 100
            floor_pct = (floors["moe_gate_up"] + floors["moe_down"]) * 1e6 / us * 100
            names = f"{pick('moe_gate_up').name} + {pick('moe_down').name}"
            print(f"  MoE block ({label}: route_align + {names}) {us:9.1f} us  {pct:5.1f} % of peak  "
                  f"{floor_pct:5.1f} % of the weight floor", flush=True)
            res["runs"].append({"T": T, "op": "moe_block", "variant": label, "kernels": names, "us": us,
                                "pct_peak": pct, "pct_floor": floor_pct})
    metric = "pct_floor" if decode else "pct_peak"
    print("\n[moe_grouped] summary: % of " + ("the chosen experts' weight floor" if decode else
                                           "bf16 peak on the active FLOPs") + " (us)")
    print(f"  {'T':>6}  {'gate_up':>16}  {'down':>16}  {'MoE block':>16}  {'best block':>16}  {'before: gate_up, down':>24}")
    for T in tokens:
        def cell(op, variant):
            r = next((r for r in res["runs"] if r["T"] == T and r["op"] == op and r["variant"] == variant), None)
            return f"{r[metric]:5.1f} ({r['us']:7.1f})" if r else "-"
        before = f"before@{man['baseline']}"
        print(f"  {T:>6}  {cell('moe_gate_up', 'default'):>16}  {cell('moe_down', 'default'):>16}  "
              f"{cell('moe_block', 'default'):>16}  {cell('moe_block', 'best'):>16}  "
              f"{cell('moe_gate_up', before) + ', ' + cell('moe_down', before):>24}")
    if out:
        res["phase"] = phase
        path = save("exp-moe-grouped" if not decode else "exp-moe-decode", res, out)
        print(f"\n[moe_grouped] wrote {path}")
    print(f"[moe_grouped] {'all checks passed' if not fails else str(len(fails)) + ' FAILURES'}")
    return 1 if fails else 0


def _gate_up_passes(b, T: int, P: int):
    """Run the default moe_gate_up over every pass's rows, so each pass's moe_down reads real act."""
    ls = [b.bind(b.kern["moe_gate_up"][0], T, i * T) for i in range(P)]
    for f in ls:
        f()
    b.ctx.sync()
    for f in ls:
        b.free_scratch(f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prep", help="render + compile the kernels (here, no GPU)")
    p.add_argument("--phase", default="prefill", choices=["prefill", "decode"])
    p.add_argument("--out", help="default .cache/bench/moe_grouped (prefill), .cache/bench/moe_decode (decode)")
    p.add_argument("--gpu", default="h100", help="tuning table the defaults are rendered with")
    p.add_argument("--baseline", default=BASELINE,
                   help="commit whose templates are timed beside ('' for none; prefill only)")
    p.add_argument("--jobs", type=int, default=None)
    r = sub.add_parser("run", help="check and time on the GPU")
    r.add_argument("--dir", default=str(REPO / ".cache" / "bench" / "moe_grouped"))
    r.add_argument("--tokens", help="default 1024,4096,8192 (prefill), 1,4,16,64 (decode)")
    r.add_argument("--out", default=None, help="folder for the results json")
    r.add_argument("--reps", type=int, default=20)
    r.add_argument("--subset", type=int, default=96, help="tokens checked against the numpy reference")
    r.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.cmd == "prep":
        _import_infc()
        out = a.out or str(REPO / ".cache" / "bench" / ("moe_decode" if a.phase == "decode" else "moe_grouped"))
        prep(Path(out), a.gpu, (a.baseline or None) if a.phase == "prefill" else None, a.jobs, a.phase)
        return 0
    phase = json.loads((Path(a.dir) / "manifest.json").read_text()).get("phase", "prefill")
    tokens = a.tokens or ("1,4,16,64" if phase == "decode" else "1024,4096,8192")
    return run(Path(a.dir), [int(t) for t in tokens.split(",")], Path(a.out) if a.out else None,
               a.reps, a.subset, a.seed)


if __name__ == "__main__":
    sys.exit(main())
