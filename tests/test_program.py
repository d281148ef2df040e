"""compiler/contract/program.py (the one walker of plan programs) and compiler/contract/bind.py's Resolver (the one
kernel-argument resolver), on hand-written plan fragments."""
import pytest

from infc.compiler.contract.bind import CACHE_MARKER, KernelInfo, Resolver, dim_slots
from infc.compiler.contract.program import bodies, count_launches, launches, layer_counts, program_name, repeats, unrolled


def L(op):
    return {"op": op, "inputs": [], "outputs": []}


def program():
    # 4 layers: attention, attention, mamba, attention (a hybrid model's schedule)
    return [L("embed"),
            {"repeat": "layers", "count": 4, "schedule": ["attn", "attn", "ssm", "attn"],
             "kinds": {"attn": [L("qkv"), L("attention"), L("mlp")], "ssm": [L("conv"), L("scan")]},
             "carried": {}, "inputs": ["x"], "outputs": ["x"]},
            L("lm_head")]


def test_unrolled_runs_each_layer_with_its_kind_in_order():
    got = [(l["op"], layer) for l, layer in unrolled(program())]
    assert got == [("embed", None),
                   ("qkv", 0), ("attention", 0), ("mlp", 0),
                   ("qkv", 1), ("attention", 1), ("mlp", 1),
                   ("conv", 2), ("scan", 2),
                   ("qkv", 3), ("attention", 3), ("mlp", 3),
                   ("lm_head", None)]


def test_launches_counts_and_bodies():
    p = program()
    runs = {l["op"]: n for l, n in launches(p)}
    assert runs == {"embed": 1, "qkv": 3, "attention": 3, "mlp": 3, "conv": 1, "scan": 1, "lm_head": 1}
    assert sum(runs.values()) == len(list(unrolled(p)))
    assert count_launches(p) == (13, 3)                 # per layer: the most common kind ("attn")
    (r,) = repeats(p)
    assert list(bodies(r)) == ["attn", "ssm"] and layer_counts(r) == {"attn": 3, "ssm": 1}
    assert count_launches([L("a"), L("b")]) == (2, 0)
    # a kind's launch dict is shared by its layers: walking it once per kind is what render needs
    assert len({id(l) for l, _ in launches(p)}) == 7


@pytest.mark.parametrize("bad,match", [
    ({"schedule": ["attn"]}, "schedule names 1 layers"),
    ({"schedule": ["attn", "attn", "moe", "attn"]}, "unknown kinds"),
    ({"kinds": None}, "infc.plan/2"),
])
def test_malformed_repeats_fail_loud(bad, match):
    p = program()
    p[1].update(bad)
    with pytest.raises(ValueError, match=match):
        list(unrolled(p))


def test_program_name_picks_short_for_few_token_prefill_and_mixed():
    plan = {"short_tokens": 64, "programs": {p: [] for p in ("prefill", "decode", "mixed", "short")}}
    assert program_name(plan, "prefill", 1) == "short"
    assert program_name(plan, "prefill", 64) == "short"
    assert program_name(plan, "prefill", 65) == "prefill"
    assert program_name(plan, "mixed", 9) == "short"
    assert program_name(plan, "mixed", 511) == "mixed"
    assert program_name(plan, "decode", 8) == "decode"          # decode keeps its graphs' program
    # a plan built before the short phase (no short_tokens, no program) runs every phase as itself
    old = {"programs": {p: [] for p in ("prefill", "decode", "mixed")}}
    assert program_name(old, "prefill", 4) == "prefill" and program_name(old, "mixed", 4) == "mixed"
    assert program_name({"short_tokens": 64, "programs": old["programs"]}, "prefill", 4) == "prefill"
    assert program_name({**plan, "short_tokens": 0}, "prefill", 1) == "prefill"


def test_program_name_picks_wide_for_many_token_decode_and_graphs_capture_it(fake_driver):
    plan = {"wide_tokens": 96, "programs": {p: [] for p in ("prefill", "decode", "mixed", "short", "wide")}}
    assert [program_name(plan, "decode", T) for T in (1, 95, 96, 256)] == ["decode", "decode", "wide", "wide"]
    assert program_name(plan, "mixed", 300) == "mixed" and program_name(plan, "prefill", 300) == "prefill"
    assert program_name({**plan, "programs": {p: [] for p in ("decode", "mixed")}}, "decode", 256) == "decode"
    # the runner captures each decode bucket's graph over the program its steps would run
    ran = captured_programs(fake_driver, plan, (64, 128))
    assert ran == [("decode", 64), ("decode", 64), ("wide", 128), ("wide", 128)]   # warm-up, capture
    # the narrow program takes the one-row bucket, a speculative build's verify program
    # (plan["verify_tokens"]: a verify step's k + 1 rows at batch 1) the buckets up to it
    # (tests/test_verify_program.py: its own bucket)
    ran = captured_programs(fake_driver, {**plan, "narrow_tokens": 1, "verify_tokens": 8,
                                          "programs": {**plan["programs"], "narrow": [], "verify": []}}, (1, 8, 16))
    assert [name for name, _ in ran] == ["narrow"] * 2 + ["verify"] * 2 + ["decode"] * 2


def captured_programs(fake_driver, plan: dict, buckets) -> list:
    """(program, T) of each launch sequence CudaRunner._capture runs for each bucket (a warm-up,
    then the capture), on the fake driver with the launches recorded instead of run."""
    from infc.runtime.cuda import runner as runner_mod
    r = object.__new__(runner_mod.CudaRunner)
    r.ctx, r.plan, r.graphs = fake_driver.Context(), plan, {}
    ran = []
    r.program = lambda name: name
    r._upload = lambda arrays, dims: []
    r._metadata = lambda meta, T, B: {}
    r._launch_all = lambda bound, dims: ran.append((bound, dims["T"]))
    for bucket in buckets:
        r._capture(bucket)
    return ran


def test_old_plan_body_is_refused():
    old = [{"repeat": "layers", "count": 2, "body": [L("x")]}]
    with pytest.raises(ValueError, match="plan/2"):
        list(unrolled(old))


# -- the resolver ----------------------------------------------------------------------------

META = {"entry": "k", "params": [
    ["x", "*bf16", "in:0"], ["w", "*bf16", "in:1"], ["y", "*bf16", "out:0"],
    ["kc", "*bf16", "cache:k"], ["vc", "*bf16", "cache:v"], ["slots", "*i32", "meta:slot_mapping"],
    ["mp", "i32", "meta:max_pages"], ["T", "i32", "dim:T"], ["B", "i32", "dim:B"],
    ["ws", "*i32", "scratch:partials"], ["c", "i32", "const:7"]]}


def resolver(**over):
    kw = dict(tensor=lambda n, layer: f"{n}@{layer}", cache=lambda n, layer: f"cache {n}@{layer}",
              meta=lambda n: f"meta {n}", scratch=lambda k, n: f"{k}.{n}", dim={"T": 5, "B": 2}.__getitem__,
              meta_names=["slot_mapping", "block_tables"])
    kw.update(over)
    return Resolver(**kw)


def test_resolver_binds_every_source_kind():
    got = resolver().values(META, ["h", "wq"], ["q", CACHE_MARKER], layer=3, kernel="kid")
    assert got == ["h@3", "wq@3", "q@3", "cache k@3", "cache v@3", "meta slot_mapping", "meta max_pages",
                   5, 2, "kid.partials", 7]
    assert dim_slots(META) == [(7, "T"), (8, "B")]


def test_resolver_fails_loud():
    with pytest.raises(ValueError, match="cache marker"):
        resolver().values(META, [CACHE_MARKER, "w"], ["q"], 0, "kid")
    with pytest.raises(ValueError, match="only 1 inputs"):
        resolver().values(META, ["h"], ["q"], 0, "kid")
    with pytest.raises(ValueError, match="not step metadata"):
        resolver(meta_names=["positions"]).values(META, ["h", "w"], ["q"], 0, "kid")
    with pytest.raises(ValueError, match="no caches"):
        Resolver(tensor=lambda n, layer: 0, meta=lambda n: 0, dim=lambda d: 0).values(META, ["h", "w"], ["q"])
    with pytest.raises(ValueError, match="unknown parameter source"):
        resolver().values({"params": [["p", "*i8", "kv:x"]]}, [], [])


def test_kernel_info_appends_the_hidden_pointers():
    k = KernelInfo("kid", {"params": [["x", "*bf16", "in:0"], ["n", "i32", "dim:T"]]},
                   {"name": "e", "num_warps": 4, "shared": 128, "hidden_args": 2})
    assert k.block == (128, 1, 1) and k.shared == 128
    assert k.arg_lists([11, 3]) == ([11, 3, 0, 0], ["*bf16", "i32", "*i8", "*i8"])
    g = KernelInfo("kid", {"params": [["n", "i32", "dim:T"]], "grid": ["min(132, cdiv(T, 128) * 3)", 2, 1]},
                   {"name": "e", "num_warps": 4, "global_scratch_size": 256, "hidden_args": 2})
    with pytest.raises(RuntimeError, match="global scratch"):
        g.arg_lists([5])
    # TMA descriptors live there: one 256-byte slot per program of the grid at the given dims
    assert g.global_scratch_bytes({"T": 200, "B": 1}) == 256 * 6 * 2
    assert g.global_scratch_bytes({"T": 8192, "B": 1}) == 256 * 132 * 2
    assert k.global_scratch_bytes({"T": 8192, "B": 1}) == 0
    # the address is Triton's first hidden argument, the profile scratch stays null
    assert g.arg_lists([5], global_scratch=0xABC0) == ([5, 0xABC0, 0], ["i32", "*i8", "*i8"])


def test_the_runner_binds_each_kernels_global_scratch(fake_driver):
    """A kernel with Triton global scratch (the TMA GEMM) is packed with its own allocation as the
    first hidden argument; the others with null."""
    from infc.runtime.cuda import runner as runner_mod

    packed = {}

    class Kernel(KernelInfo):
        def pack(self, values, global_scratch=0):
            packed[self.id] = self.arg_lists(values, global_scratch)
            return self.id

    meta = {"params": [["x", "*bf16", "in:0"]], "grid": ["min(132, cdiv(T, 128))", 1, 1]}
    kernels = {"tma": Kernel("tma", meta, {"name": "a", "num_warps": 8, "global_scratch_size": 256,
                                            "hidden_args": 2}),
               "plain": Kernel("plain", meta, {"name": "b", "num_warps": 4, "hidden_args": 2})}
    r = object.__new__(runner_mod.CudaRunner)
    r.plan = {"buffers": {"h": {}}, "step_metadata": {},
              "programs": {"prefill": [{"op": "linear", "kernel_id": k, "backend": "triton", "inputs": ["h"],
                                        "outputs": []} for k in kernels]}}
    r.kernels, r.pdl, r.meta, r.max_pages_per_seq = kernels, False, {}, 1
    r.grids = {k: runner_mod.grid_code(meta) for k in kernels}
    r.caches = type("NoCaches", (), {"ptr": staticmethod(lambda name, layer: 0)})()
    r.global_scratch, r.scratch = {"tma": 0x7000}, {}
    r._buffer_ptr = lambda name: 0x100
    assert [b[2] for b in r.bind("prefill")] == ["tma", "plain"]
    assert packed["tma"][0] == [0x100, 0x7000, 0] and packed["plain"][0] == [0x100, 0, 0]
