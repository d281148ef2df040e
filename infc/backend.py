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
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from infc.compiler.contract.errors import ModelDirError
from infc.runtime.tokenization.tokenizer import eos_ids

CPU_KV_CACHE_BYTES = 1 << 30          # the CPU backend's default KV budget (float32 pages)


@dataclass
class Backend:
    engine: object                    # an AsyncEngine (the server's), or an Engine (asynchronous=False)
    tokenizer: object | None          # infc.runtime.tokenizer.Tokenizer (None: token ids only)
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
        dt = time.perf_counter() - t0
        self.done.append((name, dt))
        if self.log:
            self.log(f"  {name:<32} {dt:8.2f} s")
        return out


# Step token budgets (max_num_batched_tokens) when none is given, as vLLM sets them per use on cards
# of 70 GiB or more (its arg_utils: LLM class 16384, OpenAI server 8192; the H100s and H200s this
# project runs on; smaller cards keep the same values here, which vLLM halves and quarters): the
# server's steps keep decodes' inter-token gaps short (a mixed step of 8k prompt tokens is ~0.1 s
# on an H200), while offline work (LLM, `bench throughput`) takes 16k-token steps: fewer, larger
# prefill bursts that run while fewer sequences decode. qwen3-4b at 1024 in / 128 out on an H200:
# mean TPOT at 64 concurrent 10.72 -> 9.95 ms, 256 concurrent +1 % output tok/s, median TTFT
# 222 -> 430 ms (bench/NOTES.md, eighth session).
BATCHED_TOKENS = {("cuda", True): 8192, ("cuda", False): 16384, ("cpu", True): 2048, ("cpu", False): 2048}


def default_batched_tokens(device: str, server: bool) -> int:
    return BATCHED_TOKENS[(device, server)]


def default_block_size(device: str) -> int:
    """The KV cache page size when none is asked: on cuda the build's for this GPU (its tuning
    table's, compiler/build.py default_page_size), on cpu 16."""
    from infc.compiler.build import DEFAULT_PAGE_SIZE, default_page_size
    return default_page_size(gpu_tuning()) if device == "cuda" else DEFAULT_PAGE_SIZE


def load_backend(model_dir, model: str | None = None, spec: str | None = None, device: str | None = None,
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.9,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool = True, block_size: int | None = None,
                 num_gpu_blocks_override: int | None = None, kv_cache_memory_bytes: int | None = None,
                 asynchronous: bool = True, cuda_graphs: bool = True, log=print,
                 spec_dirs=None, load_format: str = "auto", tensor_parallel_size: int = 1,
                 enable_expert_parallel: bool = False, overlap: bool | None = None,
                 data_parallel_size: int = 1, artifact=None) -> Backend:
    """spec_dirs: spec directories searched before specs/ (with $INFC_SPEC_PATH) for the spec
    whose architectures match the directory's config.json. load_format: "auto" reads the
    directory's safetensors; "dummy" (vLLM's spelling) makes random weights of the plan's shapes
    (on the GPU, on the device), so config.json alone is enough (runtime/dummy_weights.py).
    tensor_parallel_size > 1 (and enable_expert_parallel): one rank plan per process
    (runtime/rank_workers.py), rank 0 here with the engine; on cpu the numpy references exchange
    through rank 0, on cuda rank r runs on GPU r over NCCL. data_parallel_size > 1 with
    enable_expert_parallel: each rank its own sequences (the engine schedules every rank,
    runtime/engine.py). overlap: the engine's overlapped
    steps (runtime/engine.py; None: on where the runner can, unless INFC_OVERLAP=0). artifact: a
    built artifact directory to run as it is (one GPU), instead of building or reusing
    .cache/artifacts/<name> with this checkout's compiler: an A/B of two commits' plans.
    block_size: the KV cache's page size (None: default_block_size; an artifact keeps its own)."""
    from infc.runtime.weights.dummy import check_load_format
    from infc.runtime.engine.async_engine import AsyncEngine
    from infc.runtime.engine.engine import Engine
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelDirError(f"{model_dir}: not a directory")
    device = device or detect_device()
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {device!r}")
    dummy = check_load_format(load_format) == "dummy"
    if block_size is None:
        block_size = default_block_size(device)
    if max_num_batched_tokens is None:
        max_num_batched_tokens = default_batched_tokens(device, server=asynchronous)
    for name, v in (("--max-num-seqs", max_num_seqs), ("--max-num-batched-tokens", max_num_batched_tokens),
                    ("--block-size", block_size)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    if max_model_len is not None and max_model_len < 2:
        raise ValueError(f"--max-model-len must be >= 2, got {max_model_len}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    st = _Stages(log)
    if log:
        log(f"infc serve: {model_dir} on {device}")
        if dummy:
            log("  load format dummy: random weights, no checkpoint read or checked")

    par = None
    if tensor_parallel_size != 1 or enable_expert_parallel or data_parallel_size != 1:
        from infc.compiler.parallel import settings
        par = settings(tensor_parallel_size, enable_expert_parallel, data_parallel_size=data_parallel_size)
    if artifact is not None:
        artifact = Path(artifact)
        if device != "cuda" or par is not None:
            raise ValueError("--artifact runs a built artifact on one GPU (device cuda, no parallel ranks)")
        if not (artifact / "plan.json").is_file():
            raise ValueError(f"--artifact {artifact}: no plan.json there (not a built artifact)")
    if par is not None:
        runner, plan, name, model_len = _rank_processes(
            st, par, device, model_dir, model, spec, spec_dirs, dummy, load_format, block_size,
            num_gpu_blocks_override, kv_cache_memory_bytes, max_num_seqs, max_num_batched_tokens,
            max_model_len, gpu_memory_utilization, cuda_graphs)
        page_size = runner.page_size
    elif device == "cpu":
        from infc.compiler.build import compile_model
        from infc.runtime.engine.runner import CPURunner
        from infc.compiler.contract.safetensors_io import Checkpoint
        from infc.runtime.weights.load import load_weights
        state, plan = st.run("compile plan", compile_model, model=model, spec_path=spec,
                             model_dir=str(model_dir), spec_dirs=spec_dirs, check_checkpoint=not dummy)
        name = state.model
        if dummy:
            from infc.runtime.weights.dummy import dummy_weights
            weights = st.run("make random weights", dummy_weights, plan)
        else:
            weights = st.run("load weights", lambda: load_weights(plan, Checkpoint(model_dir)))
        page_size = block_size
        if num_gpu_blocks_override:
            num_pages = num_gpu_blocks_override
        else:
            budget = kv_cache_memory_bytes or int(os.environ.get("INFC_CPU_KV_CACHE_BYTES", CPU_KV_CACHE_BYTES))
            num_pages = CPURunner.pages_for_budget(plan, page_size, budget, max_num_seqs)
        if num_pages < 1:
            raise ValueError("the KV cache budget holds no page: raise --kv-cache-memory-bytes")
        runner = st.run("allocate KV cache", CPURunner, plan, weights, num_pages, page_size, max_num_seqs)
        model_len = int(plan["config"].get("max_len") or 1 << 30)
    else:
        from infc.compiler.build import REPO, build
        # Into the ignored cache, not generated/ (whose committed artifacts CI checks): the kernel
        # cache makes an unchanged rebuild near-instant, so "built or reused" is the same call.
        if artifact is None:
            out = REPO / ".cache" / "artifacts" / (model or model_dir.name)
            artifact = st.run("build artifact (cached)", build, model=model, spec_path=spec,
                              model_dir=str(model_dir), out=out, page_size=block_size, gpu=gpu_tuning(), log=None,
                              reuse_bins=True, spec_dirs=spec_dirs, check_checkpoint=not dummy)
        elif log:
            log(f"  artifact {artifact} as built (not rebuilt)")
        from infc.runtime.cuda.runner import CudaRunner     # lazily: cuda-python only here
        runner = st.run("load weights, KV cache, graphs", CudaRunner, artifact, model_dir,
                        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                        max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                        cuda_graphs=cuda_graphs, load_format=load_format,
                        **({"num_pages": num_gpu_blocks_override} if num_gpu_blocks_override else {}))
        plan = runner.plan
        name = plan.get("model") or model or model_dir.name
        model_len = int(getattr(runner, "max_model_len", None) or plan["config"].get("max_len") or 1 << 30)
        page_size = runner.page_size

    tokenizer, tok_config = None, {}
    if (model_dir / "tokenizer.json").exists():
        from infc.runtime.tokenization.tokenizer import Tokenizer
        tokenizer = st.run("load tokenizer", Tokenizer, model_dir)
        tok_config = tokenizer.config
    kv_tokens = runner.num_pages * runner.page_size
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
        e = Engine(runner, tokenizer, eos, limit, max_num_seqs=max_num_seqs,
                   max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
                   log=log, overlap=overlap)
        if log:
            log(f"  steps {'overlapped: the next is prepared while the device runs this one' if e.overlap else 'synchronous'}")
        return AsyncEngine(e) if asynchronous else e
    engine = st.run("start engine", start)
    if par is not None and asynchronous:
        runner.on_failure = engine.fail     # a rank that dies while idle: /health fails at once
    b = Backend(engine, tokenizer, model_dir, name, device, limit, int(runner.vocab_size), kv_tokens,
                page_size, eos, tok_config, st.done)
    if log:
        log(f"  KV cache: {runner.num_pages} pages x {page_size} tokens = {kv_tokens} tokens; "
            f"max model len {limit}")
        log(f"  maximum concurrency for {limit} tokens per request: {b.max_concurrency:.2f}x")
        log(f"ready in {time.perf_counter() - st.t_all:.2f} s")
    return b


def _rank_processes(st, par, device, model_dir, model, spec, spec_dirs, dummy, load_format,
                    block_size, num_gpu_blocks_override, kv_cache_memory_bytes, max_num_seqs,
                    max_num_batched_tokens, max_model_len, gpu_memory_utilization, cuda_graphs):
    """(runner, rank 0's plan, model name, model length) of a parallel build, one process per
    rank (runtime/rank_workers.py: MultiProcessRunner)."""
    import json
    import tempfile
    from infc.runtime.distributed.rank_workers import MultiProcessRunner
    world = par["world"]
    if device == "cpu":
        from infc.compiler.parallel import compile_ranks
        from infc.runtime.engine.runner import CPURunner
        if dummy:
            raise ValueError("--load-format dummy with --tensor-parallel-size runs on cuda only")
        ranks = st.run("compile rank plans", compile_ranks, par, model=model, spec_path=spec,
                       model_dir=str(model_dir), spec_dirs=spec_dirs)
        plans = [p for _, p in ranks]
        where = Path(tempfile.mkdtemp(prefix="infc-ranks-"))
        paths = []
        for r, p in enumerate(plans):
            paths.append(str(where / f"plan.rank{r}.json"))
            Path(paths[-1]).write_text(json.dumps(p))
        if num_gpu_blocks_override:
            num_pages = num_gpu_blocks_override
        else:
            budget = kv_cache_memory_bytes or int(os.environ.get("INFC_CPU_KV_CACHE_BYTES", CPU_KV_CACHE_BYTES))
            num_pages = CPURunner.pages_for_budget(plans[0], block_size, budget, max_num_seqs)
        if num_pages < 1:
            raise ValueError("the KV cache budget holds no page: raise --kv-cache-memory-bytes")
        try:
            runner = st.run(f"start {world} rank processes", MultiProcessRunner,
                            "infc.runtime.distributed.rank_workers:reference_rank_runner",
                            {"plans": paths, "model_dir": str(model_dir), "num_pages": num_pages,
                             "page_size": block_size, "max_num_seqs": max_num_seqs}, world)
        finally:                                    # every rank has read its plan once started
            import shutil
            shutil.rmtree(where, ignore_errors=True)
        plan = plans[0]
        return runner, plan, ranks[0][0].model, int(plan["config"].get("max_len") or 1 << 30)
    from infc.compiler.build import REPO, build
    tag = (f"dp{par['dp']}" if par.get("dp") else f"tp{par['tp']}") + (f"-ep{par['ep']}" if par["ep"] > 1 else "")
    out = REPO / ".cache" / "artifacts" / f"{model or model_dir.name}-{tag}"
    artifact = st.run("build rank artifacts", build, model=model, spec_path=spec,
                      model_dir=str(model_dir), out=out, page_size=block_size, gpu=gpu_tuning(),
                      log=None, spec_dirs=spec_dirs, check_checkpoint=not dummy,
                      tensor_parallel_size=par["tp"], enable_expert_parallel=par["ep"] > 1,
                      data_parallel_size=par.get("dp", 1))
    config = dict(artifact=str(artifact), model_dir=str(model_dir),
                  max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                  max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                  cuda_graphs=cuda_graphs, load_format=load_format)
    if num_gpu_blocks_override:
        config["num_pages"] = num_gpu_blocks_override
    runner = st.run(f"start {world} rank processes (NCCL)", MultiProcessRunner,
                    "infc.runtime.distributed.rank_workers:nccl_rank_runner", config, world)
    plan = runner.plan
    r0 = runner.runner
    model_len = int(getattr(r0, "max_model_len", None) or plan["config"].get("max_len") or 1 << 30)
    return runner, plan, plan.get("model") or model or model_dir.name, model_len
