"""`infc serve` flags, with vLLM's spellings and defaults. Light on imports: the `infc` command
builds its parser from here on every run."""
import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from infc import envs
from infc.compiler.spec_paths import add_spec_dir_arg
from infc.config import (DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_KV_CACHE_DTYPE, DEFAULT_MAX_LORA_RANK,
                         DEFAULT_MAX_LORAS, DEFAULT_MAX_NUM_SEQS, LORA_TARGET_MODULES, EngineConfig,
                         kv_events_config, lora_build, speculative_config)

from .reasoning import REASONING_PARSERS
from .tool_parsers import PARSERS as TOOL_CALL_PARSERS


LOAD_FORMATS = ("auto", "dummy")          # runtime/weights/dummy.py checks the same names
SHUTDOWN_TIMEOUT_S = 5.0   # after SIGTERM / SIGINT, for the requests in flight (lifecycle.py)
HEADER_TIMEOUT_S = 30.0    # for a request's headers to arrive (connection.py)
BODY_TIMEOUT_S = 60.0      # for its body, after its headers: 16 MiB (the body cap) at ~280 KB/s


def add_parallel_args(p: argparse.ArgumentParser):
    """vLLM's --tensor-parallel-size / --enable-expert-parallel (serve and generate)."""
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks (one process each, rank 0 serves): heads and linears split per rank")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tensor-parallel-size N: partition the experts across the N ranks")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="with --enable-expert-parallel: N ranks, each serving its own sequences' "
                        "attention, the experts partitioned across them")


def add_load_format_arg(p: argparse.ArgumentParser):
    """vLLM's --load-format: auto reads the safetensors; dummy makes random weights of the right
    shapes (on the GPU, on the device), so a directory with config.json alone runs. An unknown
    value is argparse's usage error (exit 2)."""
    p.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="auto: the directory's safetensors; dummy: random weights, no checkpoint "
                   "needed (config.json, + tokenizer files for text)")


def add_kv_cache_dtype_arg(p: argparse.ArgumentParser, default=DEFAULT_KV_CACHE_DTYPE):
    """vLLM's --kv-cache-dtype (build, serve, generate): a build-time choice, part of the plan.
    Values are checked by infc.config.kv_cache_dtype (fp8_e5m2 gets its own reason)."""
    p.add_argument("--kv-cache-dtype", default=default, metavar="{auto,fp8,fp8_e4m3}",
                   help="the paged KV cache's element type: auto (the model's dtype) or fp8 = fp8_e4m3 "
                        "(e4m3 with per-tensor scales: the checkpoint's k_scale / v_scale, else 1.0; "
                        "half the bytes, twice the tokens)" + (
                        "; default: auto, or the --artifact's own" if default is None else ""))


def add_kv_offloading_args(p: argparse.ArgumentParser):
    """The KV tiers (docs/serving.md, "KV offloading"): vLLM's --kv-offloading-size, and a disk
    folder behind it (LMCache keeps one too; its local_disk / max_local_disk_size)."""
    p.add_argument("--kv-offloading-size", type=float, metavar="GIB", help="GiB of host memory (pinned on a GPU) "
                   "keeping prefix-cache blocks evicted from the KV cache; a prompt whose prefix is "
                   "there has it copied back instead of recomputed (default 0: off)")
    p.add_argument("--kv-offloading-disk", metavar="DIR", help="a folder for blocks the host tier "
                   "evicts (one checksummed file each; emptied at startup)")
    p.add_argument("--kv-offloading-disk-size", type=float, metavar="GIB", help="GiB of --kv-offloading-disk to use")
    p.add_argument("--num-state-snapshots", type=int, metavar="N", help="hybrid models (slot caches): "
                   "snapshots of the per-sequence state kept for prefix caching, taken from the KV "
                   "cache's memory (default: --max-num-seqs; 0: none, and no prefix caching)")


def add_speculative_config_arg(p: argparse.ArgumentParser):
    """vLLM's --speculative-config (serve and generate): a JSON object, checked by
    infc.config.speculative_config (an unknown key, a bad value or a method not built yet is a
    clear error before anything loads)."""
    p.add_argument("--speculative-config", metavar="JSON",
                   help='speculative decoding, as vLLM spells it: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}\' '
                        'or \'{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}\' '
                        '(a draft of the same vocabulary), \'{"method": "eagle3", "model": HEAD_DIR, ...}\' '
                        'or \'{"method": "mtp", "num_speculative_tokens": 1}\' (the checkpoint\'s own '
                        'MTP layer; mtp on --device cpu only so far)')


def add_kv_events_config_arg(p: argparse.ArgumentParser):
    """vLLM's --kv-events-config (serve): a JSON object, checked by infc.config.kv_events_config
    before anything loads (docs/serving.md, "KV events")."""
    p.add_argument("--kv-events-config", metavar="JSON",
                   help='publish the prefix cache\'s KV events for KV-aware routers, as vLLM spells it: '
                        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                        '"replay_endpoint": "tcp://*:5558", "topic": "kv"}\' (also buffer_steps, hwm, '
                        'max_queue_size)')


def add_lora_build_args(p: argparse.ArgumentParser):
    """vLLM's multi-LoRA build flags (build, inspect, serve): the adapter tables are part of the
    plan (compiler/passes/add_lora.py); values are checked by infc.config.lora_build."""
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters: every target linear gets adapter slots")
    p.add_argument("--max-loras", type=int, help=f"adapters a step may mix (device slots; default "
                   f"{DEFAULT_MAX_LORAS})")
    p.add_argument("--max-lora-rank", type=int, help=f"the largest adapter rank (default {DEFAULT_MAX_LORA_RANK})")
    p.add_argument("--lora-target-modules", nargs="+", metavar="MODULE",
                   help=f"the modules that take adapters (default: {' '.join(LORA_TARGET_MODULES)})")


def lora_build_setting(args) -> dict | None:
    """The compiler's lora setting from add_lora_build_args' flags (None without --enable-lora)."""
    if not args.enable_lora:
        return None
    return lora_build(args.max_loras, args.max_lora_rank, args.lora_target_modules)


def lora_module(text: str) -> tuple[str, str]:
    """--lora-modules' item: name=path, or vLLM's JSON {"name": ..., "path": ...}."""
    if text.lstrip().startswith("{"):
        try:
            d = json.loads(text)
            name, path = d["name"], d["path"]
        except (ValueError, KeyError, TypeError, RecursionError):
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: JSON items need 'name' and 'path'") from None
        # str() of a number or null would serve an adapter named '5' from a directory 'None'
        if not (isinstance(name, str) and name and isinstance(path, str) and path):
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: 'name' and 'path' must be non-empty "
                                             f"strings")
        return name, path
    name, eq, path = text.partition("=")
    if not eq or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: expected name=path")
    return name, path


def add_lora_serve_args(p: argparse.ArgumentParser):
    add_lora_build_args(p)
    p.add_argument("--lora-modules", nargs="+", type=lora_module, metavar="NAME=PATH",
                   help="PEFT adapter directories to serve, each requested as model NAME")
    p.add_argument("--max-cpu-loras", type=int, help="adapters kept read in host memory (default: --max-loras)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING)")


def add_serve_args(p: argparse.ArgumentParser):
    p.add_argument("--model-path", required=True, help="an HF model directory (config.json, safetensors, tokenizer)")
    p.add_argument("--model", help="the model (variant) name; default: detected from config.json")
    p.add_argument("--spec", help="a spec file, instead of the one whose architectures match")
    add_spec_dir_arg(p)
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when a GPU is present, else cpu")
    add_load_format_arg(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", help="names the API accepts (the first is reported); "
                   "default: --model, else --model-path")
    p.add_argument("--api-key", help="require Authorization: Bearer <key> (default: $INFC_API_KEY)")
    p.add_argument("--max-model-len", type=int, help="context length (default: the model's, within the KV cache)")
    p.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION)
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    p.add_argument("--max-num-batched-tokens", type=int, help="tokens per step (default: 8192 cuda, 2048 cpu: infc.config.BATCHED_TOKENS)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="run each step to its end before the next is scheduled (default: the next "
                        "step is prepared while the GPU runs this one; also INFC_OVERLAP=0)")
    p.add_argument("--block-size", type=int, help="KV cache page size in tokens (default: the build's "
                   "for this GPU, 64 on an H200; 16 on cpu)")
    p.add_argument("--num-gpu-blocks-override", type=int, help="number of KV pages (either device)")
    add_kv_cache_dtype_arg(p, default=None)
    add_lora_serve_args(p)
    add_parallel_args(p)
    add_speculative_config_arg(p)
    p.add_argument("--kv-cache-memory-bytes", type=int, help="KV cache size on the cpu device (default 1 GiB)")
    add_kv_offloading_args(p)
    add_kv_events_config_arg(p)
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache held")
    p.add_argument("--chat-template", help="a chat template file, or the template itself")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat_template field in requests")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let tool_choice \"auto\" read tool calls out of answers (the parser: "
                        "--tool-call-parser, else the one the chat template implies)")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                   help="the model's tool-call format (default: the chat template's, when it writes one)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                   help="split the answer's <think> section into reasoning_content")
    p.add_argument("--max-queued-requests", type=int, default=1024,
                   help="sequences queued beyond --max-num-seqs before requests get 429 (SGLang's flag)")
    p.add_argument("--max-request-body-bytes", type=int, default=16 << 20)
    p.add_argument("--max-header-bytes", type=int, default=16 << 10)
    p.add_argument("--max-n", type=int, default=128, help="completions per request (prompts x n)")
    p.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT_S,
                   help="seconds the requests in flight may run on after SIGTERM / SIGINT (new ones get "
                        "503); the rest then end with an error. A second signal exits at once")
    p.add_argument("--request-header-timeout", type=float, default=HEADER_TIMEOUT_S,
                   help="seconds a request's headers may take to arrive (else 408, connection closed; "
                        "0: no limit)")
    p.add_argument("--request-body-timeout", type=float, default=BODY_TIMEOUT_S,
                   help="seconds a request's body may take to arrive after its headers (else 408; 0: no limit)")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--disable-uvicorn-access-log", action="store_true")


# Here, not in state.py beside the state it configures: config_from_args runs before the backend's
# load starts, and state.py's imports (jinja2 through chat.py) would delay that start.
@dataclass
class ServerConfig:
    served_model_names: list = field(default_factory=lambda: ["model"])
    api_key: str | None = None
    max_num_seqs: int = 256
    max_queued_requests: int = 1024          # sequences waiting beyond max_num_seqs before 429
    max_logprobs: int = 20
    max_n: int = 128
    max_request_body_bytes: int = 16 << 20
    max_header_bytes: int = 16 << 10         # all request headers together; more is a 431
    chat_template: str | None = None         # overrides the model's
    trust_request_chat_template: bool = False
    root: str | None = None                  # shown as the model's root in /v1/models
    tool_call_parser: str | None = None      # tool_parsers.PARSERS' names; None: the template's
    enable_auto_tool_choice: bool = False    # with no parser named, the template must imply one
    reasoning_parser: str | None = None      # reasoning.REASONING_PARSERS' names
    enable_prompt_tokens_details: bool = False   # usage.prompt_tokens_details.cached_tokens
    allow_runtime_lora_updating: bool = False    # POST /v1/load_lora_adapter, /v1/unload_lora_adapter


def http_env() -> tuple[str, str]:
    """(parser, loop) as INFC_HTTP_PARSER and INFC_EVENT_LOOP name them (server/connection.py);
    read when the flags are, so that a bad value (infc/envs.py checks their choices) fails
    `infc serve` before anything loads."""
    from infc import envs
    return envs.value("INFC_HTTP_PARSER"), envs.value("INFC_EVENT_LOOP")


def config_from_args(args):
    http_env()
    for name in ("max_num_seqs", "max_logprobs", "max_n", "max_request_body_bytes", "max_header_bytes"):
        if getattr(args, name) < (0 if name == "max_logprobs" else 1):
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("shutdown_timeout", "request_header_timeout", "request_body_timeout"):
        if not getattr(args, name) >= 0:                # NaN too
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0 seconds, got {getattr(args, name)}")
    if args.max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests must be >= 0, got {args.max_queued_requests}")
    if not 0 < args.port < 65536 and args.port != 0:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    speculative_config(getattr(args, "speculative_config", None))   # a bad one fails before loading
    kv_events_config(getattr(args, "kv_events_config", None))       # so does this
    served = args.served_model_name or [args.model or args.model_path]
    clash = sorted({n for n, _ in getattr(args, "lora_modules", None) or ()} & set(served))
    if clash:
        raise ValueError(f"--lora-modules: adapter name(s) {clash} are the base model's served name")
    template = args.chat_template
    if template is not None and len(template) < 4096 and Path(template).is_file():
        template = Path(template).read_text()
    return ServerConfig(
        served_model_names=args.served_model_name or [args.model or args.model_path],
        api_key=args.api_key or envs.value("INFC_API_KEY") or None,
        max_num_seqs=args.max_num_seqs, max_queued_requests=args.max_queued_requests,
        max_logprobs=args.max_logprobs, max_n=args.max_n, max_request_body_bytes=args.max_request_body_bytes,
        max_header_bytes=args.max_header_bytes,
        chat_template=template, trust_request_chat_template=args.trust_request_chat_template,
        root=args.model_path, tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice, reasoning_parser=args.reasoning_parser,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        allow_runtime_lora_updating=getattr(args, "allow_runtime_lora_updating", False))


def backend_kwargs(args) -> dict:
    """The engine's settings from the flags, flat with vLLM's names (load_backend's keywords,
    EngineConfig.from_settings: --block-size is cache.page_size)."""
    return dict(model=args.model, spec=args.spec, spec_dirs=getattr(args, "spec_dir", None),
                device=args.device, max_model_len=args.max_model_len,
                gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=args.enable_prefix_caching, block_size=args.block_size,
                num_gpu_blocks_override=args.num_gpu_blocks_override,
                kv_cache_dtype=getattr(args, "kv_cache_dtype", None),
                kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                kv_offloading_size=getattr(args, "kv_offloading_size", None),
                kv_offloading_disk=getattr(args, "kv_offloading_disk", None),
                kv_offloading_disk_size=getattr(args, "kv_offloading_disk_size", None),
                num_state_snapshots=getattr(args, "num_state_snapshots", None),
                load_format=getattr(args, "load_format", "auto"),
                tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                enable_expert_parallel=getattr(args, "enable_expert_parallel", False),
                data_parallel_size=getattr(args, "data_parallel_size", 1),
                overlap=False if getattr(args, "disable_overlap_schedule", False) else None,
                speculative_config=getattr(args, "speculative_config", None),
                kv_events_config=getattr(args, "kv_events_config", None),
                enable_lora=getattr(args, "enable_lora", False), max_loras=getattr(args, "max_loras", None),
                max_lora_rank=getattr(args, "max_lora_rank", None),
                lora_target_modules=getattr(args, "lora_target_modules", None),
                max_cpu_loras=getattr(args, "max_cpu_loras", None),
                lora_modules=getattr(args, "lora_modules", None),
                allow_runtime_lora_updating=getattr(args, "allow_runtime_lora_updating", False))


def engine_config(args) -> EngineConfig:
    """`infc serve`'s EngineConfig (infc/config.py)."""
    return EngineConfig.from_settings(**backend_kwargs(args))
