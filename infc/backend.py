"""Building the engine for a model directory: the one place that knows about devices.

    backend = load_backend(model_dir, device="cpu", max_model_len=512, log=print)
    backend.engine          # the AsyncEngine: the server's only door into the runtime
    load_backend(model_dir, device="cuda", asynchronous=False).engine   # a plain Engine (LLM)

The server above this is backend-agnostic: it sees an AsyncEngine, a tokenizer and a few numbers
(context length, vocabulary, KV capacity). The CPU backend compiles the directory's spec to a plan
and runs it on the numpy reference executor; the CUDA backend builds (or reuses) the artifact and
loads it with the CUDA runner, imported only when asked for, so a machine without a GPU never
touches cuda-python. Startup prints each stage with its time, the KV capacity in tokens and the
maximum concurrency at full context, as vLLM does.
"""
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

from infc import envs
from infc.config import (DEFAULT_KV_CACHE_DTYPE, DEFAULT_PAGE_SIZE, EngineConfig, artifact_tag,
                         kv_cache_dtype, state_snapshots)
from infc.compiler.build_key import REPO
from infc.compiler.contract import caches
from infc.compiler.contract.errors import ModelDirError
from infc.compiler.contract.schema import plan_max_len
from infc.runtime.tokenization.tokenizer import eos_ids

SERVED_ARTIFACTS = REPO / ".cache" / "artifacts"   # where serving builds (ignored by git)


@dataclass
class Backend:
    engine: object                    # an AsyncEngine (the server's), or an Engine (asynchronous=False)
    tokenizer: object | None          # infc.runtime.tokenization.tokenizer.Tokenizer (None: token ids only)
    model_dir: Path
    model_name: str                   # the plan's model name (e.g. smollm2-135m)
    device: str
    max_model_len: int
    vocab_size: int
    kv_tokens: int                    # KV cache capacity in tokens
    page_size: int
    eos_ids: set = field(default_factory=set)
    tokenizer_config: dict = field(default_factory=dict)
    stages: list = field(default_factory=list)   # (name, seconds)

    @property
    def max_concurrency(self) -> float:
        return self.kv_tokens / self.max_model_len


def detect_device() -> str:
    """cuda when an NVIDIA driver is present, else cpu. Never imports cuda-python: on a machine
    without a driver, cuInit raises instead of returning an error."""
    if Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidiactl").exists():
        return "cuda"
    return "cpu"


def gpu_tuning() -> str:
    """The build's tuning table for the GPU the driver reports (read from /proc, not cuda-python)."""
    for info in sorted(Path("/proc/driver/nvidia/gpus").glob("*/information")):
        try:
            if "H200" in info.read_text():
                return "h200"
        except OSError:
            pass
    return "h100"


class _Stages:
    def __init__(self, log):
        self.log, self.done, self.t_all = log, [], time.perf_counter()

    def run(self, name, fn, *a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        self._record(name, time.perf_counter() - t0)
        return out

    def _record(self, name, dt):
        self.done.append((name, dt))
        if self.log:
            self.log(f"  {name:<32} {dt:8.2f} s")

    def beside(self, name, fn, *a, **kw) -> "_Beside":
        """fn on a thread of its own while the caller goes on (the weights' reads and the device's
        work release the GIL); .result() waits, logs `name` with fn's own time, and re-raises
        what fn raised."""
        return _Beside(self, name, fn, a, kw)


class _Beside:
    def __init__(self, st, name, fn, a, kw):
        self.st, self.name, self.out, self.error = st, name, None, None

        def go():
            t0 = time.perf_counter()
            try:
                self.out = fn(*a, **kw)
            except BaseException as e:  # noqa: BLE001 - re-raised by result() in the caller
                self.error = e
            self.dt = time.perf_counter() - t0
        self.thread = threading.Thread(target=go, name=f"infc-{name}", daemon=True)
        self.thread.start()

    def result(self):
        self.thread.join()
        if self.error is not None:
            raise self.error
        self.st._record(self.name, self.dt)
        return self.out


def device_page_size(device: str) -> int:
    """The KV cache page size when none is asked: on cuda the build's for this GPU (its tuning
    table's, compiler/tuning_table.py default_page_size), on cpu infc.config.DEFAULT_PAGE_SIZE."""
    from infc.compiler.tuning_table import default_page_size
    return default_page_size(gpu_tuning()) if device == "cuda" else DEFAULT_PAGE_SIZE


def resolve(config: EngineConfig) -> EngineConfig:
    """The config with this machine's defaults filled in (EngineConfig.resolved)."""
    return config.resolved(detect_device, lambda: device_page_size("cuda"))


def load_backend(model_dir, config: EngineConfig | None = None, log=print, on_device_work=None,
                 **settings) -> Backend:
    """config: the engine's settings (infc/config.py), or instead flat keyword settings with
    vLLM's names (EngineConfig.from_settings: max_num_seqs=..., block_size=...).
    load.spec_dirs: spec directories searched before specs/ (with $INFC_SPEC_PATH) for the spec
    whose architectures match the directory's config.json. load.load_format: "auto" reads the
    directory's safetensors; "dummy" (vLLM's spelling) makes random weights of the plan's shapes
    (on the GPU, on the device), so config.json alone is enough (runtime/weights/dummy.py).
    parallel.tensor_parallel_size > 1 (and enable_expert_parallel): one rank plan per process
    (runtime/distributed/rank_workers.py), rank 0 here with the engine; on cpu the numpy
    references exchange through rank 0, on cuda rank r runs on GPU r over NCCL.
    data_parallel_size > 1 with enable_expert_parallel: each rank its own sequences (the engine
    schedules every rank, runtime/engine/engine.py). scheduler.overlap: the engine's overlapped
    steps (None: on where the runner can, unless INFC_OVERLAP=0). load.artifact: a built
    artifact directory to run as it is (one GPU), instead of building or reusing
    .cache/artifacts/<name> with this checkout's compiler: an A/B of two commits' plans.
    cache.page_size: the KV cache's page size (None: device_page_size; an artifact keeps its own).
    on_device_work: called once this thread's own Python is done and the device work begins
    (file reads, driver calls: the GIL mostly free), as the tokenizer's load begins beside it."""
    if config is None:
        config = EngineConfig.from_settings(**settings)
    elif settings:
        raise TypeError(f"load_backend: give a config or settings, not both ({', '.join(settings)})")
    from infc.runtime.weights.dummy import check_load_format
    from infc.runtime.engine.async_engine import AsyncEngine
    from infc.runtime.engine.engine import Engine
    from infc.runtime.engine.kv_tier.tiers import OffloadConfig
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelDirError(f"{model_dir}: not a directory")
    c = resolve(config)
    device, model, spec, spec_dirs = c.device.device, c.load.model, c.load.spec, list(c.load.spec_dirs) or None
    dummy = check_load_format(c.load.load_format) == "dummy"
    kv_dtype = c.cache.kv_cache_dtype or DEFAULT_KV_CACHE_DTYPE     # what a build here takes
    lora = c.lora.build()                                           # --enable-lora's tables
    st = _Stages(log)
    if log:
        log(f"infc serve: {model_dir} on {device}")
        if dummy:
            log("  load format dummy: random weights, no checkpoint read or checked")

    tokenizing, begun = None, []

    def device_work():
        """The tokenizer's load holds the GIL from start to end (the tokenizers library's Rust
        from_file: ~0.5 s at 151k tokens, every other thread stopped), so it begins beside device
        work (on cuda the context's creation first: driver calls), not beside this thread's own
        Python; the caller's deferred work (serve: the HTTP layer's imports) too. Before a build
        (minutes, in compile processes) rather than after it: the port opens meanwhile."""
        nonlocal tokenizing
        if begun:
            return
        begun.append(True)
        if (model_dir / "tokenizer.json").exists():
            tokenizing = st.beside("load tokenizer (beside)", _load_tokenizer, model_dir)
        if on_device_work is not None:
            on_device_work()
    par, artifact = None, c.load.artifact
    if c.parallel.ranks:
        from infc.compiler.parallel import settings
        par = settings(c.parallel.tensor_parallel_size, c.parallel.enable_expert_parallel,
                       data_parallel_size=c.parallel.data_parallel_size)
    if artifact is not None:
        artifact = Path(artifact)
        if device != "cuda" or par is not None:
            raise ValueError("--artifact runs a built artifact on one GPU (device cuda, no parallel ranks)")
        if not (artifact / "plan.json").is_file():
            raise ValueError(f"--artifact {artifact}: no plan.json there (not a built artifact)")
        check_artifact_kv_cache(artifact, c.cache.kv_cache_dtype)
    s = c.speculative.speculative_config
    drafting = s is not None and s.method == "draft_model"
    if drafting:
        _check_draft(c, par, dummy)            # before the target loads
    eagle3 = s is not None and s.method == "eagle3"
    if eagle3:
        _check_eagle3(c, par, artifact)
    mtp = s is not None and s.method == "mtp"
    if mtp:
        _check_mtp(c, par, artifact)           # (one rank: the capture below is for both heads)
    # the target layers a speculation head reads, as a plan output
    capture = eagle3_layers(s, model_dir) if eagle3 else \
        mtp_layers(c, model_dir, spec_dirs) if mtp else None
    if par is not None and lora is not None:
        raise ValueError("--enable-lora with --tensor-parallel-size / --data-parallel-size / "
                         "--enable-expert-parallel: not supported yet")
    if par is not None:
        device_work()
        runner, plan, name, model_len = _rank_processes(st, par, c, model_dir, spec_dirs, dummy, kv_dtype)
        page_size = runner.page_size
    elif device == "cpu":
        device_work()
        from infc.compiler.build import compile_model
        state, plan = st.run("compile plan", compile_model, model=model, spec_path=spec,
                             model_dir=str(model_dir), spec_dirs=spec_dirs, check_checkpoint=not dummy,
                             kv_cache_dtype=kv_dtype, lora=lora, capture=capture)
        name = state.model
        page_size = c.cache.page_size
        runner = _cpu_runner(st, plan, model_dir, dummy, c, "", state_snapshots(c.cache, c.scheduler.max_num_seqs))
        model_len = plan_max_len(plan)
    else:
        if artifact is None:
            artifact = served_artifact(st, c, model_dir, spec_dirs, dummy, kv_dtype, lora, log, capture,
                                       before_build=device_work)
        elif log:
            log(f"  artifact {artifact} as built (not rebuilt)")
        if drafting or eagle3 or mtp:
            device_work()                       # their artifacts may build
        from infc.mtp_cuda import cuda_mtp_weights
        draft = (_cuda_draft_artifact(st, c, spec_dirs, dummy, kv_dtype, model_dir, artifact)
                 if drafting else _cuda_head_artifact(st, c, artifact) if eagle3 else
                 cuda_mtp_artifact(st, c, spec_dirs, model_dir, artifact) if mtp else None)
        from infc.runtime.cuda.runner import CudaRunner  # noqa: F401 - cuda-bindings' import is Python
        device_work()
        runner, draft_runner = _cuda_runners(st, c, artifact, model_dir, draft, log,
                                             head=_cuda_head_weights if eagle3 else
                                             cuda_mtp_weights if mtp else None,
                                             what="MTP" if mtp else "EAGLE-3 head" if eagle3 else "draft")
        plan = runner.plan
        name = plan.get("model") or model or model_dir.name
        model_len = int(getattr(runner, "max_model_len", None) or plan_max_len(plan))
        page_size = runner.page_size

    if par is not None or device == "cpu":
        draft_runner = _draft_runner(st, c, par, spec_dirs, dummy, kv_dtype, model_dir)
    if eagle3 and device == "cpu":
        draft_runner = _eagle3_runner(st, c, spec_dirs, dummy, runner)
    if mtp and device == "cpu":
        draft_runner = _mtp_runner(st, c, spec_dirs, dummy, runner, model_dir)
    tokenizer, tok_config = None, {}
    if tokenizing is not None:
        tokenizer = tokenizing.result()
        tok_config = tokenizer.config
    kv_tokens = runner.num_pages * runner.page_size
    max_model_len = c.load.max_model_len
    if max_model_len is not None and max_model_len > model_len:
        raise ValueError(f"--max-model-len {max_model_len} is longer than the model's context "
                         f"length ({model_len} tokens)")
    limit = min(max_model_len or model_len, model_len)
    if limit > kv_tokens:
        if max_model_len is not None:
            raise ValueError(f"--max-model-len {max_model_len} needs {max_model_len} tokens of KV cache, "
                             f"but it holds {kv_tokens}: lower --max-model-len or give the cache more memory")
        limit = kv_tokens                   # the model's own length does not fit: serve what does
    eos = eos_ids(model_dir)
    def start():
        e = Engine(runner, tokenizer, eos, limit, max_num_seqs=c.scheduler.max_num_seqs,
                   max_num_batched_tokens=c.scheduler.max_num_batched_tokens,
                   enable_prefix_caching=c.cache.enable_prefix_caching, log=log, overlap=c.scheduler.overlap,
                   kv_offloading=OffloadConfig(c.cache.kv_offloading_size, c.cache.kv_offloading_disk,
                                               c.cache.kv_offloading_disk_size),
                   speculative_config=c.speculative.speculative_config, draft_runner=draft_runner,
                   max_cpu_loras=c.lora.max_cpu_loras, kv_events_config=c.kv_events.kv_events_config)
        try:
            return _started(e)
        except BaseException:
            e.close()                           # its event sockets are bound: give them back
            raise

    def _started(e):
        if log and e.spec is not None:
            s = e.spec.config
            what = "the checkpoint's MTP layer" if s.method == "mtp" else f"draft {s.model}"
            how = (f"(prompt lookup {s.prompt_lookup_min}..{s.prompt_lookup_max})" if s.method == "ngram" else
                   f"({what}: {draft_runner.num_pages} pages x {draft_runner.page_size} tokens of its own)")
            log(f"  speculative decoding: {s.method}, {s.num_speculative_tokens} draft tokens "
                f"{how}, none while more than {s.disable_by_batch_size} sequences run")
        if (e.loras is None) != (lora is None):
            raise ValueError("--enable-lora: the plan (an --artifact's own) and the flag disagree")
        for lora_name, path in c.lora.lora_modules:      # a bad adapter fails the start, naming it
            e.loras.register(lora_name, path)
            if log:
                log(f"  LoRA adapter {lora_name}: {path}")
        if log:
            log(f"  steps {'overlapped: the next is prepared while the device runs this one' if e.overlap else 'synchronous'}")
        return AsyncEngine(e) if c.scheduler.asynchronous else e
    engine = st.run("start engine", start)
    if par is not None and c.scheduler.asynchronous:
        runner.on_failure = engine.fail     # a rank that dies while idle: /health fails at once
    b = Backend(engine, tokenizer, model_dir, name, device, limit, int(runner.vocab_size), kv_tokens,
                page_size, eos, tok_config, st.done)
    if log:
        kv = caches.of_plan(plan).get("k", {}).get("dtype", "-")
        log(f"  KV cache: {runner.num_pages} pages x {page_size} tokens = {kv_tokens} tokens ({kv}); "
            f"max model len {limit}")
        log(f"  maximum concurrency for {limit} tokens per request: {b.max_concurrency:.2f}x")
        log(f"ready in {time.perf_counter() - st.t_all:.2f} s")
    return b


def _load_tokenizer(model_dir: Path):
    """The tokenizer, its longest token found here (the server's prompt bound) rather than after
    the engine is ready, when the server attaches it."""
    from infc.runtime.tokenization.tokenizer import Tokenizer
    tok = Tokenizer(model_dir)
    _ = tok.max_token_chars
    return tok


def served_artifact(st, c: EngineConfig, model_dir: Path, spec_dirs, dummy: bool, kv_dtype, lora,
                    log, capture=None, before_build=None) -> Path:
    """The artifact `infc serve --device cuda` runs: built into the ignored cache, not generated/
    (whose committed artifacts CI checks). The kernel cache makes an unchanged rebuild
    near-instant, so "built or reused" is one call; the build key (compiler/build_key.py) skips
    even that (and the compiler's imports) when nothing the build reads has changed."""
    from infc.config import narrow_tokens_for
    # a speculative build's verify program takes the verify step's k + 1 rows (config.py)
    narrow = narrow_tokens_for(c.speculative.speculative_config)
    out = SERVED_ARTIFACTS / ((c.load.model or model_dir.name) + artifact_tag(lora, narrow, capture))
    kw = dict(model=c.load.model, spec_path=c.load.spec, model_dir=str(model_dir), out=str(out),
              page_size=c.cache.page_size, gpu=gpu_tuning(), reuse_bins=True, spec_dirs=spec_dirs,
              check_checkpoint=not dummy, kv_cache_dtype=kv_dtype, lora=lora, narrow_tokens=narrow,
              kv_offloading=bool(c.cache.kv_offloading_size), capture=capture)
    return built_or_reused(st, "artifact", kw, log, before_build)


def built_or_reused(st, what: str, kw: dict, log=None, before_build=None) -> Path:
    """The artifact compiler/build.py's build(**kw) writes to kw["out"]: reused where its build
    key (compiler/build_key.py) says nothing the build reads has changed, else built (the kernel
    cache makes an unchanged rebuild near-instant) and keyed. One path for every served build: the
    target, its draft model, its EAGLE-3 head. before_build: called once a build is certain (the
    server opens its port then, not after a build of unknown length)."""
    from infc.compiler import build_key
    out = Path(kw["out"])
    key = st.run(f"{what} key", build_key.build_key, kw, kw.get("model_dir"), kw.get("spec_path"),
                 kw.get("spec_dirs"))
    if build_key.matches(out, key):
        if log:
            log(f"  {what} {out} unchanged (its build key)")
        return out
    if before_build is not None:
        before_build()
    from infc.compiler.build import build
    build_key.forget(out)
    artifact = st.run(f"build {what} (cached)", build, log=None, **kw)
    build_key.record(Path(artifact), key)
    return Path(artifact)


def _draft_runner(st, c: EngineConfig, par, spec_dirs, dummy: bool, kv_dtype, target_dir: Path):
    """The draft model's CPU runner for --speculative-config method draft_model (None otherwise;
    on cuda: _cuda_draft_artifact and _cuda_runners): its "model" a model directory (its weights,
    or random ones under --load-format dummy) or a variant name (random weights of its shapes:
    --load-format dummy only), compiled like the target and run in this process on a KV cache of
    its own, of the target's byte budget. A tokenizer of another vocabulary is refused here, a
    vocabulary of another size by the engine."""
    s = c.speculative.speculative_config
    if s is None or s.method != "draft_model":
        return None
    where = _check_draft(c, par, dummy)
    from infc.compiler.build import compile_model
    path = Path(s.model)
    if path.is_dir():
        _, plan = st.run("compile draft plan", compile_model, model_dir=str(path), spec_dirs=spec_dirs,
                         check_checkpoint=not dummy, kv_cache_dtype=kv_dtype)
        _same_tokenizer(where, path, target_dir)
    else:
        _, plan = st.run("compile draft plan", compile_model, model=s.model, spec_dirs=spec_dirs,
                         kv_cache_dtype=kv_dtype)
    return _cpu_runner(st, plan, path, dummy, c, "draft ")


def _cpu_runner(st, plan: dict, model_dir: Path, dummy: bool, c: EngineConfig, what: str,
                num_state_snapshots: int | None = None):
    """A CPURunner of the plan: the directory's weights (random ones of the plan's shapes under
    --load-format dummy) and the KV pages the budget holds (_cpu_pages); `what` names it in the
    startup stages ("" the target, "draft " a draft model)."""
    from infc.runtime.engine.runner import CPURunner
    _check_cpu_memory(plan, model_dir)
    if dummy:
        from infc.runtime.weights.dummy import dummy_weights
        weights = st.run(f"make {what}random weights", dummy_weights, plan)
    else:
        from infc.compiler.contract.safetensors_io import Checkpoint
        from infc.runtime.weights.load import load_weights
        weights = st.run(f"load {what}weights", lambda: load_weights(plan, Checkpoint(model_dir)))
    return st.run(f"allocate {what}KV cache", CPURunner, plan, weights, _cpu_pages(plan, c), c.cache.page_size,
                  c.scheduler.max_num_seqs, num_state_snapshots)


def _check_cpu_memory(plan: dict, model_dir: Path):
    """The CPU backend holds every weight as float32: refuse a plan whose weights cannot fit this
    machine's memory (a config.json of hidden_size 10**6 under --load-format dummy) before the
    first allocation fails deep in numpy, or the kernel kills the process."""
    import math
    import os
    from infc.runtime.weights.load import layers_of
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return                                   # unknown: nothing to say
    need = sum(4 * math.prod(w["shape"]) * len(layers_of(w))
               for w in plan["weights"].values() if "tied" not in w["source"])
    if need > memory:
        raise ValueError(f"{model_dir}: the CPU backend holds the weights in float32, {need / 2**30:,.1f} "
                         f"GiB for this config.json's sizes, more than this machine's "
                         f"{memory / 2**30:,.1f} GiB of memory")


def _check_hidden_state_target(where: str, par, artifact, what: str):
    """A head that reads the target's hidden states (EAGLE-3, an MTP layer) needs one rank (they
    are one rank's) and, given an --artifact, one built with them as a plan output."""
    if par is not None:
        raise ValueError(f"{where}: with parallel ranks (tensor, data or expert parallel) is not "
                         f"supported yet (the target's hidden states are one rank's)")
    if artifact is not None:
        import json
        plan = json.loads((Path(artifact) / "plan.json").read_text())
        if "aux_hidden" not in plan.get("outputs", {}):
            raise ValueError(f"{where}: the --artifact {artifact} was built without {what} (rebuild "
                             f"it with them, or leave --artifact out: the serving build adds them)")


def _check_eagle3(c: EngineConfig, par, artifact=None):
    """What can be refused of an EAGLE-3 head before anything loads."""
    s = c.speculative.speculative_config
    where = f"--speculative-config: EAGLE-3 head {s.model!r}"
    _check_hidden_state_target(where, par, artifact, "the head's hidden states")
    if not (Path(s.model) / "config.json").is_file():
        raise ValueError(f"{where} is not a directory with a config.json")


def _head_config(s) -> dict:
    from infc.compiler.contract import json_file     # a broken file: ModelDirError naming it
    return json_file.read_object(Path(s.model) / "config.json")


def eagle3_layers(s, target_dir: Path) -> list[int]:
    """The target layers an EAGLE-3 head reads: its config's eagle_aux_hidden_state_layer_ids (at
    the top or in eagle_config), else infc.config.eagle3_default_layers of the target's depth."""
    from infc.compiler.contract import json_file
    from infc.config import eagle3_default_layers
    head = _head_config(s)
    nested = head.get("eagle_config")
    ids = head.get("eagle_aux_hidden_state_layer_ids") or \
        (nested.get("eagle_aux_hidden_state_layer_ids") if isinstance(nested, dict) else None)
    if ids:
        if not isinstance(ids, list) or len(ids) != 3 or not all(isinstance(i, int) for i in ids):
            raise ValueError(f"--speculative-config: EAGLE-3 head {s.model!r}: "
                             f"eagle_aux_hidden_state_layer_ids must be three layer indices, got {ids!r}")
        return list(ids)
    target = json_file.read_object(Path(target_dir) / "config.json")
    text = target.get("text_config")
    L = target.get("num_hidden_layers") or (text.get("num_hidden_layers") if isinstance(text, dict) else None)
    if not isinstance(L, int) or L < 4:
        raise ValueError(f"--speculative-config: EAGLE-3 head {s.model!r} names no target layers and "
                         f"the target's num_hidden_layers ({L!r}) has no default choice (2, L/2, L-3)")
    return eagle3_default_layers(L)


def _eagle3_runner(st, c: EngineConfig, spec_dirs, dummy: bool, target):
    """The EAGLE-3 head's CPURunner (specs/eagle3.yaml), on a KV cache of its own; the target's
    embedding table where the head's checkpoint has none; `d2t` read from the checkpoint (zeros:
    the identity, where it has none)."""
    import numpy as np
    from infc.compiler.build import compile_model
    from infc.runtime.engine.runner import CPURunner
    s = c.speculative.speculative_config
    path = Path(s.model)
    from infc.compiler.spec import SPECS_DIR
    # the method names the family: its spec, whatever the head's config.json calls its class
    _, plan = st.run("compile EAGLE-3 head plan", compile_model, model_dir=str(path),
                     spec_path=str(SPECS_DIR / "eagle3.yaml"), check_checkpoint=False)
    Vd = plan["weights"]["lm_head"]["shape"][0]
    if dummy:
        from infc.runtime.weights.dummy import dummy_weights
        weights = st.run("make EAGLE-3 random weights", dummy_weights, plan)
        embed = target.executor.weights.get("embed")
        if embed is not None and tuple(np.shape(embed)) == tuple(plan["weights"]["embed"]["shape"]):
            weights["embed"] = embed              # the target's table, as a real head shares it
        d2t = np.zeros(Vd, np.int64)
    else:
        from infc.compiler.contract.safetensors_io import Checkpoint
        from infc.runtime.weights.load import load_weights
        ckpt = Checkpoint(path)
        own = "embed_tokens.weight" in ckpt
        sub = plan if own else dict(plan, weights={k: v for k, v in plan["weights"].items() if k != "embed"})
        weights = st.run("load EAGLE-3 weights", lambda: load_weights(sub, ckpt))
        if not own:
            embed = target.executor.weights.get("embed")
            if embed is None or tuple(np.shape(embed)) != tuple(plan["weights"]["embed"]["shape"]):
                raise ValueError(f"--speculative-config: EAGLE-3 head {s.model!r} has no embed_tokens "
                                 f"and the target has no embedding table 'embed' of shape "
                                 f"{plan['weights']['embed']['shape']} to share")
            weights["embed"] = embed
        d2t = _head_d2t(s, ckpt, Vd)
    runner = st.run("allocate EAGLE-3 KV cache", CPURunner, plan, weights, _cpu_pages(plan, c),
                    c.cache.page_size, c.scheduler.max_num_seqs)
    runner.d2t = d2t
    return runner


def _check_mtp(c: EngineConfig, par, artifact=None):
    """What can be refused of MTP speculation before anything loads: parallel ranks (the MTP
    layer would need the target's hidden states gathered from its ranks, and a rank build of its
    own), and an --artifact built without the hidden state the layer reads."""
    _check_hidden_state_target("--speculative-config: method 'mtp'", par, artifact,
                               "the hidden state the MTP layer reads")


def mtp_layers(c: EngineConfig, model_dir: Path, spec_dirs) -> list[int]:
    """The target layer an MTP layer reads: the residual stream after its last one (index L,
    compiler/passes/capture_hidden.py), to which the MTP plan applies the final norm itself. The
    spec's `mtp:` section is bound here first: a config.json declaring no MTP layer is refused
    before the target compiles."""
    from infc.compiler.build import resolve as resolve_spec
    from infc.compiler.contract.errors import SpecError
    spec, config, _, source = resolve_spec(c.load.model, c.load.spec, str(model_dir), spec_dirs)
    try:
        spec.mtp_section().bind(config, source)
    except SpecError as e:                      # str(e) names the spec's line
        raise ValueError(f"--speculative-config: method 'mtp': {e}") from None
    return [spec.bind(config, source)["L"]]


def _mtp_runner(st, c: EngineConfig, spec_dirs, dummy: bool, target, model_dir: Path):
    """The MTP layer's CPURunner: the plan of the family spec's `mtp:` section (compiler/spec.py
    Spec.mtp_section) over the target's own config.json and checkpoint, on a KV cache of its own.
    The tensors it shares with the target (the embedding table, the final norm, lm_head: the same
    checkpoint tensors, the same shapes) are the target's arrays, not read twice."""
    import numpy as np
    from infc.compiler.build import compile_model
    from infc.compiler.contract.errors import ModelDirError, SpecError
    from infc.runtime.engine.runner import CPURunner
    try:
        _, plan = st.run("compile MTP plan", compile_model, model=c.load.model, spec_path=c.load.spec,
                         model_dir=str(model_dir), spec_dirs=spec_dirs, check_checkpoint=False,
                         section="mtp")
    except SpecError as e:                      # str(e) names the spec's line
        raise ValueError(f"--speculative-config: method 'mtp': {e}") from None
    tplan, tw = getattr(target, "plan", {}), getattr(getattr(target, "executor", None), "weights", {})
    shared = {}
    for name, w in plan["weights"].items():
        tw_decl = tplan.get("weights", {}).get(name)
        if (tw_decl is not None and name in tw and tw_decl.get("source") == w.get("source")
                and tuple(np.shape(tw[name])) == tuple(w["shape"])):
            shared[name] = tw[name]
    sub = dict(plan, weights={k: v for k, v in plan["weights"].items() if k not in shared})
    if dummy:
        from infc.runtime.weights.dummy import dummy_weights
        weights = st.run("make MTP random weights", dummy_weights, sub)
    else:
        from infc.compiler.contract.safetensors_io import Checkpoint
        from infc.runtime.weights.load import load_weights
        try:
            weights = st.run("load MTP weights", lambda: load_weights(sub, Checkpoint(model_dir)))
        except (ModelDirError, KeyError) as e:
            raise ValueError(f"--speculative-config: method 'mtp': the checkpoint's MTP layer "
                             f"cannot be read ({e}): its config.json declares one, its weights "
                             f"lack it") from None
    weights.update(shared)
    # its sequences shadow the target's, token for token: more pages than the target's never help
    pages = min(_cpu_pages(plan, c), int(getattr(target, "num_pages", 0) or _cpu_pages(plan, c)))
    runner = st.run("allocate MTP KV cache", CPURunner, plan, weights, pages,
                    c.cache.page_size, c.scheduler.max_num_seqs)
    runner.d2t = np.zeros(plan["config"]["V"], np.int64)     # its vocabulary is the target's
    return runner


def _head_d2t(s, ckpt, Vd: int):
    """The head's draft-to-target offsets (zeros, the identity, where its checkpoint has none)."""
    import numpy as np
    d2t = np.asarray(ckpt.raw("d2t"), np.int64) if ckpt is not None and "d2t" in ckpt else np.zeros(Vd, np.int64)
    if d2t.shape != (Vd,):
        raise ValueError(f"--speculative-config: EAGLE-3 head {s.model!r}: d2t has shape "
                         f"{list(d2t.shape)}, its lm_head {Vd} rows")
    return d2t


def mtp_artifact_dir(name: str) -> Path:
    """Where the MTP layer of the target served under `name` is built."""
    from infc.mtp_cuda import MTP_TAG
    return SERVED_ARTIFACTS / (name + MTP_TAG)


def cuda_mtp_artifact(st, c: EngineConfig, spec_dirs, model_dir: Path, target_artifact: Path) -> tuple[Path, Path]:
    """(artifact, model directory) of the MTP layer: the family spec's `mtp:` section over the
    target's config.json, built or reused like every served build, with the target's page size (the
    split gives both caches the same pages). The checkpoint is not checked against the plan here
    (the target's tensors are all unread by it, as on the cpu); its MTP tensors are read at load,
    and a missing one is named then. KV cache dtype: the model's (the cpu's MTP runner's too)."""
    import json
    from infc.compiler.contract.errors import SpecError
    page_size = json.loads((Path(target_artifact) / "plan.json").read_text())["build"]["page_size"]
    out = mtp_artifact_dir(c.load.model or model_dir.name)
    try:
        art = built_or_reused(st, "MTP artifact", dict(
            model=c.load.model, spec_path=c.load.spec, model_dir=str(model_dir), spec_dirs=spec_dirs,
            out=str(out), page_size=page_size, gpu=gpu_tuning(), reuse_bins=True, check_checkpoint=False,
            section="mtp"))
    except SpecError as e:                      # str(e) names the spec's line
        raise ValueError(f"--speculative-config: method 'mtp': {e}") from None
    return Path(art), model_dir


def _cuda_head_artifact(st, c: EngineConfig, target_artifact: Path) -> tuple[Path, Path]:
    """(artifact, directory) of the EAGLE-3 head on cuda: specs/eagle3.yaml built (or reused)
    into .cache/artifacts/<its directory's name>-eagle3 with the target's page size (the split
    gives both caches the same pages)."""
    import json
    from infc.compiler.spec import SPECS_DIR
    s = c.speculative.speculative_config
    path = Path(s.model)
    page_size = json.loads((Path(target_artifact) / "plan.json").read_text())["build"]["page_size"]
    out = SERVED_ARTIFACTS / (path.name + "-eagle3")
    art = built_or_reused(st, "EAGLE-3 head artifact", dict(
        model_dir=str(path), spec_path=str(SPECS_DIR / "eagle3.yaml"), out=str(out), page_size=page_size,
        gpu=gpu_tuning(), reuse_bins=True, check_checkpoint=False))
    return art, path


def _cuda_head_weights(c: EngineConfig, target, head_artifact: Path) -> tuple[dict, object]:
    """(shared_weights, d2t) of the EAGLE-3 head's CudaRunner beside `target`'s: the target's
    embedding table on the device where the head's checkpoint has none (or its weights are
    random: a real head shares it), and d2t from the checkpoint (zeros where it has none)."""
    import json
    s = c.speculative.speculative_config
    where = f"--speculative-config: EAGLE-3 head {s.model!r}"
    plan = json.loads((Path(head_artifact) / "plan.json").read_text())
    Vd = plan["weights"]["lm_head"]["shape"][0]
    ckpt = None
    if c.load.load_format != "dummy":
        from infc.compiler.contract.safetensors_io import Checkpoint
        ckpt = Checkpoint(Path(s.model))
    try:
        d2t = _head_d2t(s, ckpt, Vd)
        if ckpt is not None and "embed_tokens.weight" in ckpt:
            return {}, d2t                          # its own table
    finally:
        if ckpt is not None:
            ckpt.close()
    want, have = plan["weights"]["embed"], target.plan["weights"].get("embed")
    if have is None or have["layers"] is not None or list(have["shape"]) != list(want["shape"]) \
            or have["dtype"] != want["dtype"]:
        got = "none" if have is None else f"{have['shape']} {have['dtype']}"
        raise ValueError(f"{where} has no embed_tokens and the target has no embedding table 'embed' "
                         f"of shape {want['shape']} {want['dtype']} to share (it has {got})")
    return {"embed": target.weights.ptr("embed", None)}, d2t


def _check_draft(c: EngineConfig, par, dummy: bool) -> str:
    """What can be refused of a draft model before anything loads; its name for messages."""
    s = c.speculative.speculative_config
    where = f"--speculative-config: draft model {s.model!r}"
    if par is not None:
        raise ValueError(f"{where}: a draft model with parallel ranks is not supported yet")
    if not Path(s.model).is_dir() and not dummy:
        raise ValueError(f"{where} is not a model directory; a variant name has no weights (random "
                         f"ones need --load-format dummy)")
    return where


def _cuda_draft_artifact(st, c: EngineConfig, spec_dirs, dummy: bool, kv_dtype, target_dir: Path,
                         target_artifact: Path) -> tuple[Path, Path]:
    """(artifact, model directory) of the draft model on cuda: built, or reused, into
    .cache/artifacts/<its directory's or variant's name> as the target's is (the kernel cache
    makes an unchanged rebuild near-instant; a self-draft reuses the target's very artifact), with
    the target's page size (the split gives both the same pages) and KV cache dtype. Its
    vocabulary is checked against the target's plan here, before either loads its weights."""
    import json
    from infc.runtime.engine.speculative.draft_model import check_draft_runner
    s = c.speculative.speculative_config
    where, path = f"--speculative-config: draft model {s.model!r}", Path(s.model)
    target_plan = json.loads((Path(target_artifact) / "plan.json").read_text())
    if path.is_dir():
        _same_tokenizer(where, path, target_dir)
        name, kw = path.name, {"model_dir": str(path), "check_checkpoint": not dummy}
    else:
        name, kw = s.model, {"model": s.model, "check_checkpoint": False}
    out = SERVED_ARTIFACTS / name
    if out.resolve() == Path(target_artifact).resolve():
        if path.is_dir() and path.resolve() == target_dir.resolve():
            return Path(target_artifact), path     # a self-draft: the target's very build
        out = out.with_name(name + "-draft")     # another model of the target's directory name
    art = built_or_reused(st, "draft artifact", dict(
        out=str(out), page_size=target_plan["build"]["page_size"], gpu=gpu_tuning(), reuse_bins=True,
        spec_dirs=spec_dirs, kv_cache_dtype=kv_dtype, **kw))
    draft_plan = json.loads((Path(art) / "plan.json").read_text())
    shape = lambda p: SimpleNamespace(vocab_size=p["config"]["V"], num_slots=caches.has_slots(caches.of_plan(p)))  # noqa: E731
    check_draft_runner(shape(draft_plan), shape(target_plan))
    return Path(art), path


def _cuda_runners(st, c: EngineConfig, artifact: Path, model_dir: Path, draft, log, head=None,
                  what: str = "draft"):
    """The target's CudaRunner, and the draft model's beside it (draft: (artifact, directory) or
    None); head: for an EAGLE-3 head or an MTP layer as the draft, head(c, target runner, head
    artifact) -> (shared_weights, d2t) (_cuda_head_weights: the target's embedding, its own d2t;
    infc/mtp_cuda.py cuda_mtp_weights: the target's embedding, final norm and lm_head); what:
    the draft's name in the startup stages ("draft", "EAGLE-3 head", "MTP"). Both load
    their weights, arena and scratch first; then the cache budget left is split so that both
    caches hold the same tokens (compiler/memory_budget.draft_pages), and each
    allocates its caches and captures its own graphs. Each runner has its own stream, staging
    buffers and arena in the device's one primary context (driver.Context)."""
    from infc.runtime.cuda.runner import CudaRunner     # lazily: cuda-python only here
    settings = _cuda_runner_settings(c)
    num_pages = settings.pop("num_pages", None)
    # the weights and the caches + graphs as two stages, so a start's lines say which takes the time
    runner = st.run("load weights", CudaRunner, artifact, model_dir, defer_cache=True, **settings)
    if draft is None:
        try:
            st.run("KV cache, graphs", runner.start_cache, num_pages)
        except BaseException:
            runner.close()
            raise
        return runner, None
    from infc.compiler.memory_budget import draft_pages, draft_split_line
    try:
        shared, d2t = head(c, runner, draft[0]) if head is not None else ({}, None)
        try:
            d = st.run(f"load {what} weights", CudaRunner, draft[0], draft[1], defer_cache=True,
                       shared_weights=shared, **dict(settings, num_state_snapshots=0))
        except ModelDirError as e:
            if what != "MTP":
                raise
            # as on the cpu (_mtp_runner): the config.json that declared the layer is not at fault
            raise ValueError(f"--speculative-config: method 'mtp': the checkpoint's MTP layer cannot "
                             f"be read ({e}): its config.json declares one, its weights lack it") from None
        if head is not None:
            d.d2t = d2t
        try:
            if d.page_size != runner.page_size:
                raise ValueError(f"--speculative-config: the draft's artifact {draft[0]} has pages of "
                                 f"{d.page_size} tokens, the target's {runner.page_size}")
            tc, dc = caches.of_plan(runner.plan), caches.of_plan(d.plan)
            budget = None if num_pages else d.cache_budget()
            pages = num_pages or draft_pages(tc, dc, runner.page_size, budget, runner.cache_slots)
            if log:
                log("  " + draft_split_line(tc, dc, runner.page_size, pages, budget))
            st.run("KV cache, graphs", runner.start_cache, pages)
            st.run(f"{what} KV cache, graphs", d.start_cache, pages)
        except BaseException:
            d.close()
            raise
    except BaseException:
        runner.close()
        raise
    return runner, d


def _same_tokenizer(where: str, draft_dir: Path, target_dir: Path):
    """Both directories' tokenizers, where both have one, map every token to the same id."""
    a, b = draft_dir / "tokenizer.json", target_dir / "tokenizer.json"
    if not (a.exists() and b.exists()) or a.read_bytes() == b.read_bytes():
        return
    from tokenizers import Tokenizer
    va, vb = (Tokenizer.from_file(str(f)).get_vocab(with_added_tokens=True) for f in (a, b))
    if va != vb:
        diff = sorted(set(va.items()) ^ set(vb.items()))[:1]
        raise ValueError(f"{where}: its tokenizer's vocabulary is not the target's ({len(va)} and "
                         f"{len(vb)} tokens; e.g. {diff[0][0]!r} -> {diff[0][1]} in one only): a "
                         f"draft must share the target's token ids")


def check_artifact_kv_cache(artifact: Path, flag: str | None):
    """An --artifact runs as built: a --kv-cache-dtype given with it must be the one it was built
    with (the cache dtype and scales are in its plan; the kernels were rendered for them)."""
    if flag is None:
        return
    import json
    try:
        decl = caches.of_plan(json.loads((Path(artifact) / "plan.json").read_text()))
    except (OSError, ValueError) as e:
        raise ValueError(f"--artifact {artifact}: cannot read its plan.json ({e})") from None
    built = decl["k"]["dtype"] if "k" in decl else None
    want = kv_cache_dtype(flag)
    if (built == caches.FP8) != (want == caches.FP8):
        raise ValueError(f"--kv-cache-dtype {flag} does not match the artifact {artifact}, built with "
                         f"{'fp8 (f8e4m3)' if built == caches.FP8 else 'the model dtype (auto)'} KV "
                         f"caches: rebuild it (`infc build ... --kv-cache-dtype {flag} --out {artifact}`) "
                         f"or leave the flag out to run it as built")


def _cpu_pages(plan: dict, c: EngineConfig) -> int:
    """The CPU backend's KV pages: asked for, else what the byte budget holds."""
    from infc.runtime.engine.runner import CPURunner
    num_pages = c.cache.num_gpu_blocks_override
    if not num_pages:
        budget = c.cache.kv_cache_memory_bytes or envs.value("INFC_CPU_KV_CACHE_BYTES")
        num_pages = CPURunner.pages_for_budget(plan, c.cache.page_size, budget, c.scheduler.max_num_seqs,
                                               state_snapshots(c.cache, c.scheduler.max_num_seqs))
    if num_pages < 1:
        raise ValueError("the KV cache budget holds no page: raise --kv-cache-memory-bytes")
    return num_pages


def _cuda_runner_settings(c: EngineConfig) -> dict:
    """CudaRunner's keyword arguments (on one GPU, and each rank's over NCCL)."""
    return dict(max_num_batched_tokens=c.scheduler.max_num_batched_tokens, max_num_seqs=c.scheduler.max_num_seqs,
                max_model_len=c.load.max_model_len, gpu_memory_utilization=c.cache.gpu_memory_utilization,
                cuda_graphs=c.device.cuda_graphs, load_format=c.load.load_format,
                num_state_snapshots=state_snapshots(c.cache, c.scheduler.max_num_seqs),
                **({"num_pages": c.cache.num_gpu_blocks_override} if c.cache.num_gpu_blocks_override else {}))


def _rank_processes(st, par, c: EngineConfig, model_dir, spec_dirs, dummy, kv_dtype):
    """(runner, rank 0's plan, model name, model length) of a parallel build, one process per
    rank (runtime/distributed/rank_workers.py: MultiProcessRunner)."""
    import json
    import tempfile
    from infc.runtime.distributed.rank_workers import MultiProcessRunner
    world, model, spec = par["world"], c.load.model, c.load.spec
    if c.device.device == "cpu":
        from infc.compiler.build import compile_ranks
        if dummy:
            raise ValueError("--load-format dummy with --tensor-parallel-size runs on cuda only")
        ranks = st.run("compile rank plans", compile_ranks, par, model=model, spec_path=spec,
                       model_dir=str(model_dir), spec_dirs=spec_dirs, kv_cache_dtype=kv_dtype)
        plans = [p for _, p in ranks]
        where = Path(tempfile.mkdtemp(prefix="infc-ranks-"))
        paths = []
        for r, p in enumerate(plans):
            paths.append(str(where / f"plan.rank{r}.json"))
            Path(paths[-1]).write_text(json.dumps(p))
        num_pages = _cpu_pages(plans[0], c)
        try:
            runner = st.run(f"start {world} rank processes", MultiProcessRunner,
                            "infc.runtime.distributed.rank_runners:reference_rank_runner",
                            {"plans": paths, "model_dir": str(model_dir), "num_pages": num_pages,
                             "page_size": c.cache.page_size, "max_num_seqs": c.scheduler.max_num_seqs}, world)
        finally:                                    # every rank has read its plan once started
            import shutil
            shutil.rmtree(where, ignore_errors=True)
        plan = plans[0]
        return runner, plan, ranks[0][0].model, plan_max_len(plan)
    from infc.compiler.build import REPO, build
    tag = (f"dp{par['dp']}" if par.get("dp") else f"tp{par['tp']}") + (f"-ep{par['ep']}" if par["ep"] > 1 else "")
    out = REPO / ".cache" / "artifacts" / f"{model or model_dir.name}-{tag}"
    artifact = st.run("build rank artifacts", build, model=model, spec_path=spec,
                      model_dir=str(model_dir), out=out, page_size=c.cache.page_size, gpu=gpu_tuning(),
                      log=None, spec_dirs=spec_dirs, check_checkpoint=not dummy,
                      tensor_parallel_size=par["tp"], enable_expert_parallel=par["ep"] > 1,
                      data_parallel_size=par.get("dp", 1), kv_cache_dtype=kv_dtype)
    config = dict(artifact=str(artifact), model_dir=str(model_dir), **_cuda_runner_settings(c))
    runner = st.run(f"start {world} rank processes (NCCL)", MultiProcessRunner,
                    "infc.runtime.distributed.rank_runners:nccl_rank_runner", config, world)
    plan = runner.plan
    r0 = runner.runner
    model_len = int(getattr(r0, "max_model_len", None) or plan_max_len(plan))
    return runner, plan, plan.get("model") or model or model_dir.name, model_len
