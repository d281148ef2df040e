"""What structured outputs cost decode: TPOT with every request under a JSON schema against the
same run without, at each concurrency, in alternating rounds on one engine; and what a new
schema costs its first token (its compile, then the TTFT of a request that brings it).

    infc bench structured --artifact A --model-path DIR [--concurrency 1,64] [--rounds 3]

DIR needs a tokenizer (tokenizer.json) beside config.json: the grammar is compiled against it.
Weights may be dummy (--load-format dummy): the masks make any logits follow the schema. The
default schema (SCHEMA) keeps a request inside it for the whole output: a 400-integer array, so
every request decodes --output-len tokens under the grammar and the runs compare token for token.
"""
import argparse
import json
import statistics
import time

import numpy as np

SCHEMA = {"type": "object", "properties": {"values": {"type": "array", "items": {"type": "integer"},
                                                      "minItems": 400, "maxItems": 400}},
          "required": ["values"], "additionalProperties": False}


def _params(out_len: int, so=None):
    from infc.runtime.engine.sampling import SamplingParams
    return SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True, structured_outputs=so)


def first_token_cost(engine, vocab: int, in_len: int, rng, fresh: int = 5) -> dict:
    """Median over `fresh` new schemas: the compile (GrammarCache.check, as the server awaits it)
    and the TTFT of one request with that schema once compiled, beside TTFTs with a cached schema
    and with none."""
    from infc.runtime.engine.structured.request import StructuredOutputs

    def ttft(so) -> float:
        engine.add_request(rng.integers(0, vocab, in_len).tolist(), _params(2, so), f"ft-{time.perf_counter_ns()}")
        t0, first = time.perf_counter(), None
        while engine.has_unfinished():
            for o in engine.step():
                if first is None and o.token_ids:
                    first = time.perf_counter()
        return (first - t0) * 1e3

    compile_ms, new_ttft, cached_ttft, plain_ttft = [], [], [], []
    for i in range(fresh):
        schema = dict(SCHEMA, properties={**SCHEMA["properties"], f"k{i}_{rng.integers(1 << 30)}": {"type": "string"}})
        so = StructuredOutputs(json=json.dumps(schema))
        t0 = time.perf_counter()
        engine.grammars.check(so)
        compile_ms.append((time.perf_counter() - t0) * 1e3)
        new_ttft.append(ttft(so))
        cached_ttft.append(ttft(so))
        plain_ttft.append(ttft(None))
    med = statistics.median
    return {"schemas": fresh, "compile_ms": med(compile_ms), "ttft_ms_first_use": med(new_ttft),
            "ttft_ms_cached": med(cached_ttft), "ttft_ms_no_schema": med(plain_ttft)}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="infc bench structured")
    ap.add_argument("--model-path", required=True, help="config.json and tokenizer.json")
    ap.add_argument("--artifact", help="a built artifact to run as it is (default: build or reuse)")
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--schema", help="a JSON schema file (default: SCHEMA, a 400-integer array)")
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to try the benchmark itself")
    from infc.server.args import add_load_format_arg
    add_load_format_arg(ap)
    a = ap.parse_args(argv)
    from infc.backend import load_backend
    from infc.runtime.engine.structured.request import StructuredOutputs
    from .common import header, save
    from .throughput import run_point
    conc = [int(c) for c in a.concurrency.split(",")]
    b = load_backend(a.model_path, device=a.device, max_num_seqs=max(conc), max_model_len=a.input_len + a.output_len + 16,
                     asynchronous=False, load_format=a.load_format, artifact=a.artifact)
    engine = b.engine
    runner = engine.runner
    schema = json.loads(open(a.schema).read()) if a.schema else SCHEMA
    so = StructuredOutputs(json=json.dumps(schema))
    engine.grammars.check(so)                            # compiled before any timing
    res = header(getattr(runner, "ctx", "cpu"), runner.plan["model"])
    res.update({"input_len": a.input_len, "output_len": a.output_len, "rounds": a.rounds, "schema": schema,
                "overlap": engine.overlap, "points": []})
    rng = np.random.default_rng(0)
    run_point(engine, b.vocab_size, 2, 64, 8, rng, total=2)                       # warm-up
    run_point(engine, b.vocab_size, 2, 64, 8, rng, total=2, params=_params(8, so))
    for c in conc:
        tpot = {"plain": [], "schema": []}
        toks = {"plain": [], "schema": []}
        for r in range(a.rounds):
            order = ("plain", "schema") if r % 2 == 0 else ("schema", "plain")
            for kind in order:
                p = run_point(engine, b.vocab_size, c, a.input_len, a.output_len, rng, total=c,
                              params=_params(a.output_len, so if kind == "schema" else None))
                tpot[kind].append(p["mean_tpot_ms"])
                toks[kind].append(p["output_tok_s"])
        med = {k: statistics.median(v) for k, v in tpot.items()}
        point = {"concurrency": c, "tpot_ms_plain": med["plain"], "tpot_ms_schema": med["schema"],
                 "tpot_ratio": med["schema"] / med["plain"], "tpot_ms_rounds": tpot,
                 "output_tok_s_rounds": toks}
        res["points"].append(point)
        print(f"concurrency {c:4d}: TPOT {med['plain']:.3f} ms plain, {med['schema']:.3f} ms with a JSON schema "
              f"({100 * (point['tpot_ratio'] - 1):+.1f} %), median of {a.rounds} rounds", flush=True)
        save("structured", res, a.out)
    res["first_token"] = first_token_cost(engine, b.vocab_size, a.input_len, rng)
    ft = res["first_token"]
    print(f"a new schema: compile {ft['compile_ms']:.1f} ms; TTFT {ft['ttft_ms_first_use']:.1f} ms at first use, "
          f"{ft['ttft_ms_cached']:.1f} ms cached, {ft['ttft_ms_no_schema']:.1f} ms without (median of "
          f"{ft['schemas']})", flush=True)
    path = save("structured", res, a.out)
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    main()
