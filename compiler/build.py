"""`infc build`: spec (+ variant or model directory) -> generated/<model>/plan.json."""
import json
import time
from pathlib import Path

from infc.config import DEFAULT_KV_CACHE_DTYPE
from infc.config import kv_cache_dtype as plan_kv_dtype

from .contract import json_file
from .contract.errors import ModelDirError, SpecError
from .pipeline import compile_spec
from .quant.formats import parse_quantization
from .quant.kernel_limits import check_kernel_schemes
from .plan import dumps, emit_plan
from .checkpoint_check import check_model_dir, checkpoint_headers
from .contract.safetensors_io import Checkpoint
from .kv_scales import read_kv_scales
from .spec import Spec, find_architecture, find_variant, load_spec
from .parallel import check_used, rank_plan_path, settings
from .contract.json_file import json_key_line

REPO = Path(__file__).resolve().parent.parent
GENERATED = REPO / "generated"


def read_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    json_file.check_regular(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ModelDirError(f"{model_dir}: no config.json (is this an HF model directory?)") from None
    except OSError as e:
        raise ModelDirError(f"{path}: cannot read ({e})") from None
    config = json_file.loads(raw, path)     # any parse failure (too deep, 5000 digits) names the file
    if not isinstance(config, dict):
        raise ModelDirError(f"{path}: a JSON {type(config).__name__}, not an object of config keys")
    archs = config.get("architectures")
    if archs is not None and not isinstance(archs, str) and not (
            isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ModelDirError(f"{path}:{json_key_line(path, 'architectures')}: 'architectures' must be a "
                            f"list of class names, got {archs!r}")
    return config


def resolve(model: str | None = None, spec_path: str | None = None,
            model_dir: str | None = None, spec_dirs=None) -> tuple[Spec, dict, str, str]:
    """(spec, config values, model name, where the config came from). spec_dirs: extra spec
    directories searched before specs/ (compiler/spec_paths.py)."""
    if model_dir is not None:
        config = read_config(Path(model_dir))
        cfg_path = Path(model_dir) / "config.json"
        archs = config.get("architectures") or []
        archs = [archs] if isinstance(archs, str) else list(archs)
        spec = load_spec(spec_path) if spec_path else find_architecture(
            archs, spec_dirs, str(cfg_path), json_key_line(cfg_path, "architectures"))
        return spec, config, model or Path(model_dir).name, str(cfg_path)
    if model is None:
        raise SpecError("name a model (--model NAME) or a model directory", None)
    if spec_path is not None:
        spec = load_spec(spec_path)
        if model not in spec.variants:
            raise SpecError(f"unknown variant '{model}' (this spec defines: "
                            f"{', '.join(sorted(spec.variants)) or 'none'})", spec.path,
                            spec.raw.key_lines.get("variants"))
        return spec, dict(spec.variants[model]), model, f"{spec.path} variant {model}"
    spec, config = find_variant(model, spec_dirs)
    return spec, config, model, f"{spec.path} variant {model}"


def kv_cache_setting(flag: str | None, model_dir, read_checkpoint: bool) -> dict | None:
    """--kv-cache-dtype as the pipeline takes it (passes/quantize_kv_cache.py): None for auto;
    for fp8, the checkpoint's per-layer K/V scales (1.0 where it has none, and without a
    checkpoint: a variant, --load-format dummy)."""
    if plan_kv_dtype(flag) is None:
        return None
    scales = {}
    if model_dir is not None and read_checkpoint:
        ckpt = Checkpoint(Path(model_dir))
        try:
            scales = read_kv_scales(ckpt)
        finally:
            ckpt.close()
    return {"flag": flag, "scales": scales}


def compile_model(model=None, spec_path=None, model_dir=None, features=None, log=None,
                  observe=None, skip=(), fuse=True, spec_dirs=None, check_checkpoint=True,
                  parallel=None, kv_cache_dtype=DEFAULT_KV_CACHE_DTYPE, lora=None, capture=None,
                  narrow_tokens=None, section=None):
    """Returns (state, plan dict). fuse=False skips every fusion pass (`--no-fuse`). With a
    model_dir, the checkpoint's safetensors headers are checked against the plan's weights
    (compiler/checkpoint_check.py) unless check_checkpoint is False (--load-format dummy: no
    checkpoint is read); spec_dirs: extra spec directories (compiler/spec_paths.py);
    kv_cache_dtype: --kv-cache-dtype (infc/config.py KV_CACHE_DTYPES); lora: --enable-lora's
    {"max_loras", "max_rank", "targets"} (infc/config.py lora_build), None without; capture: a
    speculation head's target layers (compiler/passes/capture_hidden.py), None without;
    narrow_tokens: the narrow launches' widest step (a speculative build's k + 1: a verify
    program that wide beside the one-token narrow program; None: 1);
    section: "mtp" compiles the spec's MTP layer instead of its model (Spec.mtp_section)."""
    if not fuse:
        from .pipeline import FUSIONS
        skip = tuple(skip) + tuple(sorted(FUSIONS))
    stages = []

    def stage(name, t0):
        dt = time.perf_counter() - t0
        stages.append((name, dt))
        if log:
            log(f"  {name:<28} {dt * 1e3:8.1f} ms")

    t0 = time.perf_counter()
    spec, config, name, source = resolve(model, spec_path, model_dir, spec_dirs)
    if section == "mtp":
        spec, name = spec.mtp_section(), name + "-mtp"
    elif section is not None:
        raise ValueError(f"compile_model: unknown section {section!r} (known: mtp)")
    stage("parse + validate spec", t0)
    t0 = time.perf_counter()
    env = spec.bind(config, source)
    stage("bind config", t0)
    timings = {}

    def timed(pass_name, state, _t=[time.perf_counter()]):
        now = time.perf_counter()
        timings[pass_name] = now - _t[0]
        _t[0] = now
        if log:
            log(f"  pass {pass_name:<23} {timings[pass_name] * 1e3:8.1f} ms")
        if observe:
            observe(pass_name, state)

    # parallel: {"world", "rank", "tp", "ep"}, one rank's share (compiler/parallel.py)
    quant = parse_quantization(config, source, spec.nested)
    # the checkpoint's headers, read once: its quantized tensors' dtypes, which of a weight's `or:`
    # layouts it stores, and the honesty check after emit
    headers = checkpoint_headers(model_dir) if model_dir is not None and check_checkpoint else None
    if quant is not None and headers is not None:
        quant.see_checkpoint({name: h[0] for name, h in headers.items()})
    kv_cache = kv_cache_setting(kv_cache_dtype, model_dir, check_checkpoint)
    state = compile_spec(spec, env, name, features, observe=timed, skip=skip, parallel=parallel,
                         quant=quant, kv_cache=kv_cache, lora=lora, capture=capture,
                         narrow_tokens=narrow_tokens, checkpoint_names=headers)
    t0 = time.perf_counter()
    plan = emit_plan(state)
    if parallel:
        plan["parallel"] = {k: parallel[k] for k in ("world", "rank", "tp", "ep", "dp") if k in parallel}
    stage("emit plan", t0)
    if model_dir is not None and not check_checkpoint:
        if log:
            log(f"  load format dummy: checkpoint in {model_dir} not read, not checked")
    elif model_dir is not None:
        t0 = time.perf_counter()
        if check_model_dir(plan, spec, model_dir, log, quant.unread if quant else (), headers=headers, quant=quant):
            stage("check checkpoint tensors", t0)
    return state, plan


FEATURES = ("tilelang", "cuda")
from .tuning_table import GPUS, TUNING, default_page_size, load_tuning  # noqa: E402,F401 (their home)


def parse_features(text: str | None) -> list[str]:
    feats = [f.strip() for f in (text or "").split(",") if f.strip()]
    for f in feats:
        if f not in FEATURES:
            raise SpecError(f"unknown feature '{f}' (known: {', '.join(FEATURES)})", None)
    return feats


def generate(plan: dict, out: Path, gpu: str = "h100", page_size: int | None = None,
             target: str = "sm_90", spec_path: str | None = None, tuning_overlay: dict | None = None,
             kv_offloading: bool = False) -> dict:
    """Render every kernel into out/kernels/ and record them in the plan; returns id -> Kernel.
    kv_offloading: the KV tiers' copy kernel too (render_plan)."""
    from .codegen.render import EXT, render_plan
    page_size = page_size or default_page_size(gpu)
    kernels = render_plan(plan, load_tuning(gpu, tuning_overlay), page_size, spec_path, kv_offloading)
    kdir = out / "kernels"
    kdir.mkdir(parents=True, exist_ok=True)
    keep = set()
    for kid, k in sorted(kernels.items()):
        name = f"{kid}{EXT[k.backend]}"
        keep.add(name)
        path = kdir / name
        if not path.exists() or path.read_text() != k.source:
            path.write_text(k.source)
    for stale in kdir.iterdir():
        if stale.name not in keep:
            stale.unlink()
    plan["build"] = {"gpu": gpu, "target": target, "page_size": page_size,
                     **({"tuning_overlay": tuning_overlay} if tuning_overlay else {})}
    plan["kernels"] = {kid: {"backend": k.backend, "template": k.template,
                             "source": f"kernels/{kid}{EXT[k.backend]}", **k.meta}
                       for kid, k in sorted(kernels.items())}
    return kernels


def _built_for(bin_dir: Path, kid: str, target: str) -> bool:
    try:
        info = json.loads((bin_dir / f"{kid}.json").read_text())
    except (OSError, ValueError):
        return False
    built = str(info.get("target") or info.get("arch") or "")
    return built.rstrip("a") == target.rstrip("a") and (bin_dir / f"{kid}.cubin").exists()


def build(model=None, spec_path=None, model_dir=None, out=None, features=None, log=print,
          gpu="h100", target="sm_90", page_size=None, compile=True, jobs=None,
          reuse_bins=False, fuse=True, spec_dirs=None, check_checkpoint=True,
          tensor_parallel_size=1, enable_expert_parallel=False, data_parallel_size=1,
          tuning_overlay=None, kv_cache_dtype=DEFAULT_KV_CACHE_DTYPE, lora=None, kv_offloading=False,
          capture=None, narrow_tokens=None, section=None, skip=()) -> Path:
    """reuse_bins: when out/bin already holds a cubin for every kernel id (an id is the digest of
    its source), compile nothing. The serving path uses it so that a machine with another (or no)
    Triton runs the cubins built elsewhere rather than recompiling them.
    tensor_parallel_size > 1 (and enable_expert_parallel), or data_parallel_size > 1 with
    enable_expert_parallel: one plan per rank (compiler/parallel.py).
    tuning_overlay: laid over the GPU's tuning table (load_tuning), recorded in plan["build"]:
    a one-GPU experiment's kernel variants (tests/gpu/prepare.py's attnvar).
    page_size: the KV cache's tokens a page; None takes the GPU's default (default_page_size).
    kv_cache_dtype: --kv-cache-dtype, auto or fp8 (the plan's K/V caches, passes/quantize_kv_cache.py).
    lora: --enable-lora's adapter tables (compile_model); capture: a speculation head's target
    layers (compile_model; one GPU only).
    section: "mtp" builds the spec's MTP layer (compile_model; one GPU only): the artifact
    infc/backend.py runs beside the target's for MTP speculation on cuda.
    kv_offloading: a build for serving with the host KV tier (--kv-offloading-size): the plan
    gets the tiers' copy kernel (plan["block_copy"]); one-GPU builds only (tiers are).
    skip: optional passes left out (compiler/pipeline.py FUSIONS; one-GPU builds only): an A/B of
    one fusion in the model (tests/gpu/prepare.py's builds record it for the GPU's re-render)."""
    page_size = page_size or default_page_size(gpu)
    par = settings(tensor_parallel_size, enable_expert_parallel, data_parallel_size=data_parallel_size)
    if par is not None and tuning_overlay:
        raise SpecError("a tuning overlay applies to one-GPU builds only", None)
    if par is not None and skip:
        raise SpecError("skipping passes applies to one-GPU builds only", None)
    from .pipeline import FUSIONS
    if set(skip) - FUSIONS:
        raise SpecError(f"skip: {', '.join(sorted(set(skip) - FUSIONS))} is not an optional pass "
                        f"(compiler/pipeline.py FUSIONS)", None)
    if par is not None and (capture or section):
        raise SpecError("a speculation head's hidden-state outputs or MTP layer: one-GPU builds only", None)
    if par is not None:
        return build_ranks(par, model, spec_path, model_dir, out, features, log, gpu, target,
                           page_size, compile, jobs, fuse, spec_dirs, check_checkpoint=check_checkpoint,
                           kv_cache_dtype=kv_cache_dtype, lora=lora)
    from .codegen.aot import compile_kernels
    t_all = time.perf_counter()
    if log and (model or model_dir):
        log(f"infc build {model or model_dir}")
    state, plan = compile_model(model, spec_path, model_dir, features,
                                (lambda m: None) if log is None else log, fuse=fuse,
                                spec_dirs=spec_dirs, check_checkpoint=check_checkpoint,
                                kv_cache_dtype=kv_cache_dtype, lora=lora, capture=capture,
                                narrow_tokens=narrow_tokens, section=section, skip=tuple(skip))
    # a scheme the kernels refuse fails naming its config key, before any kernel is rendered
    check_kernel_schemes(state.quant, plan)
    out = Path(out) if out else GENERATED / state.model
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    kernels = generate(plan, out, gpu, page_size, target, spec_path=state.spec.path,
                       tuning_overlay=tuning_overlay, kv_offloading=kv_offloading)
    if skip:
        plan["build"]["skip"] = sorted(skip)
    (out / "plan.json").write_text(dumps(plan))
    if log:
        log(f"  {'render ' + str(len(kernels)) + ' kernels + write plan':<28} "
            f"{(time.perf_counter() - t0) * 1e3:8.1f} ms")
    if compile and reuse_bins and all(_built_for(out / "bin", kid, target) for kid in kernels):
        if log:
            log(f"  {'reuse ' + str(len(kernels)) + ' cubins':<28}")
    elif compile:
        res = compile_kernels(kernels, out / "bin", target, jobs=jobs, progress=log is not None)
        if log:
            log(f"  {'compile (' + target + ')':<28} {res['seconds'] * 1e3:8.1f} ms  "
                f"{len(res['compiled'])} compiled, {len(kernels) - len(res['compiled'])} cached")
    if log:
        log(f"built {state.model} in {time.perf_counter() - t_all:.2f} s -> {out}")
    return out


def compile_ranks(par: dict, **kw) -> list[tuple]:
    """[(state, plan)] for rank 0..world-1; kw as compiler.build.compile_model takes."""
    out = []
    for rank in range(par["world"]):
        state, plan = compile_model(**kw, parallel={**par, "rank": rank})
        if rank == 0:
            check_used(state, par)
        out.append((state, plan))
    return out


def build_ranks(par: dict, model=None, spec_path=None, model_dir=None, out=None, features=None,
                log=print, gpu="h100", target="sm_90", page_size=None, compile=True, jobs=None,
                fuse=True, spec_dirs=None, **kw) -> Path:
    """`infc build --tensor-parallel-size N`: every rank's plan, their kernels rendered once."""
    from .codegen.aot import compile_kernels
    from .codegen.rank_kernels import attach_rank_kernels
    t_all = time.perf_counter()
    ranks = compile_ranks(par, model=model, spec_path=spec_path, model_dir=model_dir,
                          features=features, log=(lambda m: None) if log is None else log, fuse=fuse,
                          spec_dirs=spec_dirs, **kw)
    state = ranks[0][0]
    for _, plan in ranks:
        check_kernel_schemes(state.quant, plan)
    tag = f"dp{par['dp']}" if par.get("dp", 1) > 1 else f"tp{par['tp']}" if par["tp"] > 1 else ""
    tag += f"{'-' if tag else ''}ep{par['ep']}" if par["ep"] > 1 else ""
    out = Path(out) if out else GENERATED / f"{state.model}-{tag}"
    out.mkdir(parents=True, exist_ok=True)
    kernels = {}
    for rank, (_, plan) in enumerate(ranks):
        mine = generate(plan, out, gpu, page_size, target, spec_path=state.spec.path)
        mine.update(attach_rank_kernels(plan, out))      # the collectives' helper kernels
        # the ranks' launches differ only in the weights they read: one kernels/ serves all
        assert not kernels or set(mine) == set(kernels), f"rank {rank} needs other kernels than rank 0"
        kernels.update(mine)
        rank_plan_path(out, rank).write_text(dumps(plan))
    if compile:
        res = compile_kernels(kernels, out / "bin", target, jobs=jobs, progress=log is not None)
        if log:
            log(f"  {'compile (' + target + ')':<28} {res['seconds'] * 1e3:8.1f} ms")
    if log:
        dp = f", dp {par['dp']}" if par.get("dp") else ""
        log(f"built {state.model} on {par['world']} ranks (tp {par['tp']}, ep {par['ep']}{dp}) in "
            f"{time.perf_counter() - t_all:.2f} s -> {out}/plan.rank{{0..{par['world'] - 1}}}.json")
    return out


def build_variants(spec_path, out=None, **kw) -> list[Path]:
    """`infc build --spec FILE` alone: validate FILE and build every variant it names, each into
    out/<variant> (default generated/<variant>). A spec without variants is an error: it can
    only be built against a checkpoint's config.json (--model-path)."""
    spec = load_spec(spec_path)
    if not spec.variants:
        raise SpecError("this spec names no variants, so there is nothing to build by itself: build it "
                        "against a checkpoint with --model-path DIR, or add a 'variants:' entry "
                        "(a name and its config.json values)", spec.path,
                        spec.raw.key_lines.get("variants") or 1)
    return [build(model=v, spec_path=spec_path, out=Path(out) / v if out else None, **kw)
            for v in spec.variants]
