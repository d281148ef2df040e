"""One all-reduce's time on two GPUs: NCCL against the one-shot peer_sum (runtime/cuda/p2p.py),
over the message sizes a plan's all-reduces have, inside CUDA Graphs as decode replays them.

    python3 -m infc.bench.allreduce --artifact .cache/artifacts/qwen3-4b-tp2 --out OUT

One process per GPU (spawned here, rank r on GPU r). Each rank binds the artifact's first decode
all_reduce ([B, H] fp32 partials, bf16 out) twice: through NcclCollectives (NCCL alone) and through P2PCollectives
(peer_sum); for each B it captures CALLS back-to-back calls of each in one graph and times REPS
replays with CUDA events on rank 0; the time per call is the median replay over CALLS. Both ranks
replay in step (each replay waits for the other rank's), so a call's time includes the barrier,
as in a model step. Result: allreduce-<model>-<gpu>.json (+ PNG): per B the bytes, NCCL and
peer_sum microseconds a call.
"""
import argparse
import os
import statistics
import sys
from pathlib import Path

CALLS, REPS = 50, 15
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 1536]


def _rank(rank: int, world: int, artifact: str, rows: list, uid_q, out_q):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    from infc.runtime.cuda import nccl
    from infc.compiler.contract.schema import DTYPE_BYTES
    from infc.runtime.cuda.artifact import load_kernels
    from infc.runtime.cuda.collectives import Buffer, CollectiveLaunch, NcclCollectives
    from infc.runtime.cuda.driver import Context, Graph
    from infc.runtime.cuda.p2p import P2PCollectives, p2p_collectives
    from infc.runtime.cuda.ranks import load_rank_plans
    from infc.compiler.contract.program import launches
    try:
        ctx = Context(rank)
        if rank == 0:
            uid = nccl.unique_id()
            for _ in range(world - 1):
                uid_q.put(uid)
        else:
            uid = uid_q.get(timeout=60)
        comm = nccl.Communicator(world, rank, uid)
        p2p = p2p_collectives(comm, ctx)
        if not isinstance(p2p, P2PCollectives):
            raise RuntimeError("these GPUs cannot map each other's memory: nothing to compare")
        plain = NcclCollectives(comm, ctx)
        plan = load_rank_plans(artifact)[rank]
        ar = next(l for l, _ in launches(plan["programs"]["decode"]) if l["op"] == "all_reduce")
        kernels = load_kernels(artifact, plan)
        helpers = {mode: kernels[kid] for mode, kid in ar["helpers"].items()}
        shape = plan["buffers"][ar["inputs"][0]]["shape"]
        # the plan's dtypes: fp32 partials in, bf16 out (the row linears' partial sums)
        x_dtype, y_dtype = (plan["buffers"][ar[k][0]]["dtype"] for k in ("inputs", "outputs"))
        dim = next(d for d in shape if isinstance(d, str))
        H = shape[1]
        n_max = max(rows) * H * 4
        x, y = ctx.alloc(n_max), ctx.alloc(n_max)
        ctx.memset(x, n_max, 0x3C)         # 0x3C3C... is about 0.011 in bf16, 0.0115 in f32: not zero
        place = {"T": max(rows), "B": max(rows)}

        def launch(modes):
            return CollectiveLaunch("all_reduce", {}, [Buffer("x", x, shape, x_dtype)],
                                    [Buffer("y", y, shape, y_dtype)],
                                    {m: helpers[m] for m in modes if m in helpers}, 0, place, "bench")
        fires = {"nccl": plain.bind(launch(["cast"])), "peer_sum": p2p.bind(launch(["p2p", "cast"]))}
        results = []
        isz = DTYPE_BYTES[x_dtype]
        for B in rows:
            dims = {dim: B, "T": B, "B": B}
            row = {"rows": B, "bytes": B * H * isz}
            for name, fire in fires.items():
                g = Graph(ctx, lambda f=fire: [f(dims) for _ in range(CALLS)])
                g.launch()
                ctx.sync()
                times = []
                for _ in range(REPS):
                    e0, e1 = ctx.event(), ctx.event()
                    e0.record()
                    g.launch()
                    e1.record()
                    times.append(e1.ms_since(e0) * 1000 / CALLS)
                row[f"{name}_us"] = statistics.median(times)
            row["peer_sum_calls"] = p2p.peer_calls
            results.append(row)
        errors = p2p.errors()
        ctx.close()
        p2p.close(graceful=True)
        if rank == 0:
            out_q.put({"ok": True, "gpu": ctx.name, "H": H, "rows": results, "errors": errors,
                       "dtype": f"{x_dtype} partials -> {y_dtype}"})
    except BaseException as e:               # noqa: BLE001 - the parent reports it
        out_q.put({"ok": False, "rank": rank, "error": f"{type(e).__name__}: {e}"})


def main(argv=None):
    ap = argparse.ArgumentParser(prog="infc bench allreduce", description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", required=True, help="a two-rank artifact (its decode all_reduce's shape and peer_sum)")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="message rows (B) to time")
    a = ap.parse_args(argv)
    import multiprocessing as mp
    from .common import header, save
    rows = [int(r) for r in a.rows.split(",")]
    sp = mp.get_context("spawn")
    uid_q, out_q = sp.Queue(), sp.Queue()
    procs = [sp.Process(target=_rank, args=(r, 2, a.artifact, rows, uid_q, out_q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        res = out_q.get(timeout=300)
    except Exception:
        res = {"ok": False, "error": "no result within 300 s"}
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if not res.pop("ok"):
        print(f"error: infc bench allreduce: {res.get('error')}", file=sys.stderr)
        return 1
    out = {**header(res["gpu"], Path(a.artifact).name), "world": 2, "calls_per_graph": CALLS, "replays": REPS,
           "hidden": res["H"], "dtype": res["dtype"], "rows": res["rows"], "peer_sum_errors": res["errors"],
           "nvls": os.environ.get("NCCL_NVLS_ENABLE", "unset")}
    print(f"{'rows':>6} {'bytes':>9} {'NCCL us':>9} {'peer_sum us':>12}")
    for r in out["rows"]:
        print(f"{r['rows']:>6} {r['bytes']:>9} {r['nccl_us']:>9.2f} {r['peer_sum_us']:>12.2f}")
    path = save("allreduce", out, a.out)
    _plot(out, path.with_suffix(".png"))
    print(f"wrote {path}")
    return 0


def _plot(res: dict, path: Path):
    from .common import figure, finish
    fig, ax = figure()
    xs = [r["bytes"] for r in res["rows"]]
    ax.plot(xs, [r["nccl_us"] for r in res["rows"]], "o-", label="NCCL (ncclAllReduce)")
    ax.plot(xs, [r["peer_sum_us"] for r in res["rows"]], "s-", label="peer_sum (one-shot, P2P)")
    ax.set_xscale("log")
    ax.set_xlabel("message bytes (bf16)")
    ax.set_ylabel("us per all-reduce (in a CUDA Graph)")
    ax.legend()
    finish(fig, ax, path, f"all-reduce, 2 ranks, {res['gpu']}", res)


if __name__ == "__main__":
    sys.exit(main())
