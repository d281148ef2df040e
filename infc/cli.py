"""The `infc` command: build, inspect, generate, serve, bench.

User errors (a bad spec, a broken model directory, bad flags) print `error: where: what` and
exit 2; nothing a user can type ends in a traceback (INFC_DEBUG=1 shows it for developers).
"""
import argparse
import os
import sys
import traceback

from infc.compiler.codegen.render import TemplateError
from infc.compiler.errors import ModelDirError, SpecError


def _build(args):
    from infc.compiler.build import build, parse_features
    build(model=args.model, spec_path=args.spec, model_dir=args.model_path, out=args.out,
          features=parse_features(args.features), gpu=args.gpu, target=args.target,
          page_size=args.page_size, compile=not args.no_compile, jobs=args.jobs)


def _inspect(args):
    from infc.compiler.inspect import inspect
    print(inspect(args.model, spec_path=args.spec, model_dir=args.model_path, dot=args.dot,
                  phases=args.phase))


def _generate(args):
    from infc import LLM, SamplingParams
    llm = LLM(args.model_path, device=args.device, spec=args.spec)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    for out in llm.generate(args.prompt, params):
        print(f"{out.prompt}{out.text}")


def _serve(args):
    from infc.server.serve import serve_main
    serve_main(args)


def _bench(args):
    import importlib
    mod = importlib.import_module(f"infc.bench.{args.which}")
    mod.main(args.rest)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="infc", description="LLM inference compiler")
    sub = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build", help="compile a model spec into generated/<model>/")
    b.add_argument("--model", help="a variant name from specs/ (e.g. qwen3-4b)")
    b.add_argument("--spec", help="a spec file (to build a spec from anywhere)")
    b.add_argument("--model-path", help="an HF model directory: bind the spec to its config.json")
    b.add_argument("--out", help="output directory (default generated/<model>)")
    b.add_argument("--features", help="extra kernel backends, comma-separated: tilelang, cuda")
    b.add_argument("--gpu", default="h100", choices=["h100", "h200"], help="tuning table to use")
    b.add_argument("--target", default="sm_90", help="compute capability for the cubins")
    b.add_argument("--page-size", type=int, default=16, help="KV cache page size in tokens")
    b.add_argument("--no-compile", action="store_true", help="render kernels, skip the cubins")
    b.add_argument("--jobs", type=int, help="parallel compile workers (default: all cores)")
    b.set_defaults(fn=_build)

    i = sub.add_parser("inspect", help="print the graph, the launches and the routing table")
    i.add_argument("model", nargs="?", help="a variant name")
    i.add_argument("--spec")
    i.add_argument("--model-path")
    i.add_argument("--dot", help="write the fused graph as Graphviz DOT to this file")
    i.add_argument("--phase", action="append", choices=["prefill", "decode", "mixed"],
                   help="phases to list launches for (default: all)")
    i.set_defaults(fn=_inspect)

    g = sub.add_parser("generate", help="generate text from prompts")
    g.add_argument("--model-path", required=True)
    g.add_argument("--spec")
    g.add_argument("--prompt", action="append", required=True)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    g.set_defaults(fn=_generate)

    s = sub.add_parser("serve", help="an OpenAI-compatible server (vLLM's flags)", allow_abbrev=False)
    from infc.server.args import add_serve_args
    add_serve_args(s)
    s.set_defaults(fn=_serve)

    bn = sub.add_parser("bench", help="benchmarks (results go to bench/results/)")
    bn.add_argument("which", choices=["latency", "serve"])
    bn.add_argument("rest", nargs=argparse.REMAINDER)
    bn.set_defaults(fn=_bench)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        args.fn(args)
    except (SpecError, ModelDirError, TemplateError, ValueError) as e:
        if os.environ.get("INFC_DEBUG"):
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # a bug in infc, not the user's input: still no traceback by default
        if os.environ.get("INFC_DEBUG"):
            traceback.print_exc()
        print(f"internal error: {type(e).__name__}: {e} (set INFC_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
