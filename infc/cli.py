"""The `infc` command: build, inspect, generate, serve, bench.

User errors (a bad spec, a broken model directory, bad flags) print `error: where: what` and
exit 2; nothing a user can type ends in a traceback (INFC_DEBUG=1 shows it for developers).
"""
import argparse
import sys
import traceback

from infc import envs
from infc.config import DEFAULT_TUNE_VERIFY_ROWS
from infc.compiler.contract.errors import ModelDirError, SpecError, TemplateError
from infc.compiler.spec_paths import add_spec_dir_arg


def _build(args):
    from infc.compiler.build import build, build_variants, parse_features
    from infc.server.args import lora_build_setting
    kw = dict(out=args.out, features=parse_features(args.features), gpu=args.gpu, target=args.target,
              page_size=args.page_size, compile=not args.no_compile, jobs=args.jobs,
              fuse=not args.no_fuse, kv_cache_dtype=args.kv_cache_dtype, lora=lora_build_setting(args))
    kw.update(tensor_parallel_size=args.tensor_parallel_size,      # one plan per rank
              enable_expert_parallel=args.enable_expert_parallel,
              data_parallel_size=args.data_parallel_size)
    if args.spec and args.model is None and args.model_path is None:
        build_variants(args.spec, **kw)          # validate the file, build each of its variants
        return
    build(model=args.model, spec_path=args.spec, model_dir=args.model_path, spec_dirs=args.spec_dir, **kw)


def _inspect(args):
    from infc.compiler.inspect import inspect
    from infc.config import narrow_tokens_for, speculative_config
    from infc.server.args import lora_build_setting
    # --speculative-config: the plan a speculative server builds (its verify program, k + 1 rows)
    narrow = narrow_tokens_for(speculative_config(args.speculative_config))
    print(inspect(args.model, spec_path=args.spec, model_dir=args.model_path, dot=args.dot,
                  phases=args.phase, spec_dirs=args.spec_dir,
                  tensor_parallel_size=args.tensor_parallel_size,
                  enable_expert_parallel=args.enable_expert_parallel, rank=args.rank,
                  data_parallel_size=args.data_parallel_size, lora=lora_build_setting(args),
                  narrow_tokens=narrow))


def _generate(args):
    from infc import LLM, SamplingParams
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    with LLM(args.model_path, device=args.device, spec=args.spec,   # device None: cuda if present
             spec_dirs=args.spec_dir, load_format=args.load_format,
             kv_cache_dtype=args.kv_cache_dtype,
             tensor_parallel_size=args.tensor_parallel_size,
             enable_expert_parallel=args.enable_expert_parallel,
             data_parallel_size=args.data_parallel_size,
             speculative_config=args.speculative_config) as llm:
        for out in llm.generate(args.prompt, params):
            print(f"{out.prompt}{out.text}")


def _serve(args):
    import signal

    def stop(sig, frame):        # a SIGTERM before the server's own handlers: a quiet exit 0
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, stop)
    from infc.server.serve import serve_main
    serve_main(args)


def _bench(args):
    import importlib
    mod = importlib.import_module(f"infc.bench.{args.which.replace('-', '_')}")
    mod.main(args.rest)


def _tune(args):
    def _csv(text):
        return [x.strip() for x in (text or "").split(",") if x.strip()] or None

    def _batches(text, flag):
        out = []
        for b in _csv(text) or []:
            if not b.isdigit() or int(b) < 1:
                raise ValueError(f"{flag}: '{b}' is not a batch size (whole numbers >= 1, "
                                 f"comma-separated)")
            out.append(int(b))
        if not out:
            raise ValueError(f"{flag}: no batch size given")
        return out

    if args.tune_cmd == "prepare":
        from infc.compiler.build import parse_features
        from infc.server.args import lora_build_setting
        from infc.compiler.tune import prepare
        prepare(model=args.model, gpu=args.gpu, out=args.out, phases=_csv(args.phases),
                templates=_csv(args.templates), spec_path=args.spec, model_dir=args.model_path,
                features=parse_features(args.features), page_size=args.page_size,
                target=args.target, decode_batches=_batches(args.decode_batches, "--decode-batches"),
                prefill_tokens=args.prefill_tokens, context_len=args.context_len,
                mixed=[tuple(m.split("x")) for m in _csv(args.mixed)],
                compile=not args.no_compile, jobs=args.jobs,
                wide_batches=_batches(args.wide_batches, "--wide-batches"), lora=lora_build_setting(args),
                verify_rows=args.verify_rows)
    else:
        from pathlib import Path
        if not (Path(args.dir) / "manifest.json").exists():      # before cuda-python is imported
            raise ValueError(f"{args.dir}: no manifest.json (run `infc tune prepare` first)")
        from infc.runtime.cuda.tune_run import run
        run(args.dir, write=args.write, reps=args.reps, warmup=args.warmup,
            threshold=args.threshold, results_dir=args.results_dir, any_gpu=args.any_gpu,
            templates=_csv(args.templates))


def _env(args):
    print(envs.markdown() if args.markdown else envs.report(), end="" if args.markdown else "\n")


def _add_parallel_args(p):
    """vLLM's spellings; compiler/parallel.py turns them into one plan per rank."""
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks: attention heads and MLP features split across them, an "
                        "all_reduce after each sublayer (one plan per rank)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tensor-parallel-size N: partition the experts across the N ranks "
                        "(tokens dispatched to their experts' rank and back) instead of splitting each")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="with --enable-expert-parallel: N ranks, each running attention over its "
                        "own sequences, the experts partitioned across them (DP attention)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="infc", description="LLM inference compiler")
    sub = p.add_subparsers(dest="cmd", required=True)

    from infc.server.args import add_kv_cache_dtype_arg, add_lora_build_args
    b = sub.add_parser("build", help="compile a model spec into generated/<model>/")
    b.add_argument("--model", help="a variant name from specs/ (e.g. qwen3-4b)")
    b.add_argument("--spec", help="a spec file (to build a spec from anywhere); alone, without "
                   "--model/--model-path: validate it and build each of its variants into "
                   "OUT/<variant> (default generated/<variant>)")
    add_spec_dir_arg(b)
    b.add_argument("--model-path", help="an HF model directory: bind the spec to its config.json")
    b.add_argument("--out", help="output directory (default generated/<model>)")
    b.add_argument("--features", help="extra kernel backends, comma-separated: tilelang, cuda")
    b.add_argument("--gpu", default="h100", choices=["h100", "h200"], help="tuning table to use")
    b.add_argument("--target", default="sm_90", help="compute capability for the cubins")
    b.add_argument("--page-size", type=int, help="KV cache page size in tokens (default: the GPU "
                   "table's, 64 on the H200; else 16)")
    add_kv_cache_dtype_arg(b)
    add_lora_build_args(b)
    b.add_argument("--no-compile", action="store_true", help="render kernels, skip the cubins")
    b.add_argument("--no-fuse", action="store_true",
                   help="skip every fusion pass: each op runs its generic kernel")
    b.add_argument("--jobs", type=int, help="parallel compile workers (default: all cores)")
    _add_parallel_args(b)
    b.set_defaults(fn=_build)

    i = sub.add_parser("inspect", help="print the graph, the launches and the routing table")
    i.add_argument("model", nargs="?", help="a variant name")
    i.add_argument("--spec")
    add_spec_dir_arg(i)
    i.add_argument("--model-path")
    i.add_argument("--dot", help="write the fused graph as Graphviz DOT to this file")
    i.add_argument("--phase", action="append", choices=["prefill", "decode", "mixed", "short", "wide", "narrow", "verify", "load"],
                   help="phases to list launches for (default: all; wide: decode steps of many sequences)")
    _add_parallel_args(i)
    i.add_argument("--rank", type=int, help="with --tensor-parallel-size: show only this rank")
    add_lora_build_args(i)
    from infc.server.args import add_speculative_config_arg
    add_speculative_config_arg(i)           # the speculative build's plan: --phase verify
    i.set_defaults(fn=_inspect)

    g = sub.add_parser("generate", help="generate text from prompts")
    g.add_argument("--model-path", required=True)
    g.add_argument("--spec")
    add_spec_dir_arg(g)
    g.add_argument("--prompt", action="append", required=True)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--device", choices=["cpu", "cuda"],
                   help="default: cuda when an NVIDIA GPU is present, else cpu (the reference executor)")
    from infc.server.args import add_load_format_arg, add_parallel_args, add_speculative_config_arg
    add_load_format_arg(g)                  # as serve has them
    add_kv_cache_dtype_arg(g)
    add_parallel_args(g)
    add_speculative_config_arg(g)
    g.set_defaults(fn=_generate)

    s = sub.add_parser("serve", help="an OpenAI-compatible server (vLLM's flags)", allow_abbrev=False)
    from infc.server.args import add_serve_args
    add_serve_args(s)
    s.set_defaults(fn=_serve)

    bn = sub.add_parser("bench", help="benchmarks (results go to bench/results/)")
    bn.add_argument("which", choices=["latency", "throughput", "startup", "serve", "profile", "prefix", "allreduce",
                                       "structured", "quant-accuracy", "spec-verify", "spec-e2e"])
    bn.add_argument("rest", nargs=argparse.REMAINDER)
    bn.set_defaults(fn=_bench)

    tu = sub.add_parser("tune", help="fill codegen_templates/tuning/<gpu>.json from GPU timings")
    tsub = tu.add_subparsers(dest="tune_cmd", required=True)
    tp = tsub.add_parser("prepare", help="build machine: render + compile candidate kernels")
    tp.add_argument("--model", help="a variant name from specs/ (e.g. qwen3-4b)")
    tp.add_argument("--spec")
    tp.add_argument("--model-path", help="an HF model directory: bind the spec to its config.json")
    tp.add_argument("--gpu", default="h200", choices=["h100", "h200"], help="tuning table to fill")
    tp.add_argument("--out", help="output folder (default .cache/tune/<model>-<gpu>)")
    tp.add_argument("--phases", default="decode,prefill", help="comma-separated: prefill, decode, mixed, short, wide, "
                    "narrow, verify")
    tp.add_argument("--verify-rows", type=int, default=DEFAULT_TUNE_VERIFY_ROWS, help="the verify phase's rows: a speculative build's "
                    "k + 1 (its verify program; entries keyed per row count)")
    tp.add_argument("--templates", help="comma-separated templates (default: the GEMVs, GEMMs, attention)")
    tp.add_argument("--features", help="extra kernel backends, comma-separated: tilelang, cuda")
    tp.add_argument("--decode-batches", default="1", help="decode batch sizes to time at (T = B)")
    tp.add_argument("--wide-batches", default="128,256", help="wide decode batch sizes to time at (T = B)")
    tp.add_argument("--prefill-tokens", type=int, default=1024, help="prefill step size (one sequence)")
    tp.add_argument("--mixed", default="512x8", help="mixed step sizes TxB, comma-separated (B - 1 "
                    "decode rows and one chunk; e.g. 512x8,511x256)")
    tp.add_argument("--context-len", type=int, default=1024, help="KV length per sequence for attention")
    tp.add_argument("--page-size", type=int, help="default: the build's for --gpu")
    tp.add_argument("--target", default="sm_90")
    tp.add_argument("--no-compile", action="store_true", help="render the candidates, skip the cubins")
    tp.add_argument("--jobs", type=int)
    add_lora_build_args(tp)         # a LoRA build's narrow GEMVs carry its sites (their own table keys)
    tr = tsub.add_parser("run", help="GPU machine: time the candidates, write the table")
    tr.add_argument("--dir", required=True, help="the folder `infc tune prepare` wrote")
    tr.add_argument("--write", help="tuning table to merge into (default <dir>/<gpu>.json)")
    tr.add_argument("--reps", type=int, default=50, help="timed graph replays per candidate")
    tr.add_argument("--warmup", type=int, default=10)
    tr.add_argument("--threshold", type=float, default=0.03, help="store only wins above this fraction")
    tr.add_argument("--results-dir", help="where tune-<model>-<gpu>.json goes (default bench/results)")
    tr.add_argument("--templates", help="time only these templates (comma-separated)")
    tr.add_argument("--any-gpu", action="store_true", help="time on a GPU that is not the table's")
    tu.set_defaults(fn=_tune)

    e = sub.add_parser("env", help="list every INFC_* environment variable: value, default, meaning")
    e.add_argument("--markdown", action="store_true", help="the table docs/configuration.md holds")
    e.set_defaults(fn=_env)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        args.fn(args)
    except (SpecError, ModelDirError, TemplateError, ValueError) as e:
        if envs.value("INFC_DEBUG"):
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:   # an optional backend not installed (e.g. infc[cuda]): say which
        if envs.value("INFC_DEBUG"):
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # a bug in infc, not the user's input: still no traceback by default
        if envs.value("INFC_DEBUG"):
            traceback.print_exc()
        print(f"internal error: {type(e).__name__}: {e} (set INFC_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
