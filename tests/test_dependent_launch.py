"""Programmatic dependent launch (codegen_templates/triton/_pdl.j2): a kernel whose META allows it
may start while the kernel before it still runs, so it must wait (griddepcontrol.wait) before it
reads or writes anything. Checked on every kernel rendered for every spec variant in generated/
(`make generated` keeps them current), since a missing wait is a race no CPU test would see."""
import ast
import functools
from pathlib import Path

import pytest

from exhaustive import EXHAUSTIVE

REPO = Path(__file__).resolve().parents[1]
KERNELS = sorted(REPO.glob("generated/*/kernels/*.py"))


def _meta(tree) -> dict:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "META" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("no META")


def _is_pdl_call(stmt, name: str) -> bool:
    """`if PDL: name()` and nothing else."""
    return (isinstance(stmt, ast.If) and isinstance(stmt.test, ast.Name) and stmt.test.id == "PDL"
            and not stmt.orelse and len(stmt.body) == 1 and isinstance(stmt.body[0], ast.Expr)
            and isinstance(stmt.body[0].value, ast.Call)
            and getattr(stmt.body[0].value.func, "id", None) == name)


def test_generated_kernels_exist():
    assert len(KERNELS) > 100


def _unwaited_reads(block, allowed: set, tainted: set, waited: bool) -> tuple[list, bool]:
    """Statements of `block` that may run before a gdc_wait and name a pointer parameter (or a
    local made from one) outside `allowed`; and whether the block always ends waited. Structured
    code only (if / for / while): a branch counts as waited after `if PDL: gdc_wait()` in it."""
    bad = []
    for st in block:
        if waited:
            return bad, True
        if _is_pdl_call(st, "gdc_wait"):
            waited = True
            continue
        if isinstance(st, ast.If):
            names = {n.id for n in ast.walk(st.test) if isinstance(n, ast.Name)}
            bad += [st.test] if names & tainted else []
            b1, w1 = _unwaited_reads(st.body, allowed, tainted, False)
            b2, w2 = _unwaited_reads(st.orelse, allowed, tainted, False)
            bad += b1 + b2
            waited = w1 and w2 and bool(st.orelse)
            continue
        if isinstance(st, (ast.For, ast.While)):
            head = st.iter if isinstance(st, ast.For) else st.test
            names = {n.id for n in ast.walk(head) if isinstance(n, ast.Name)}
            bad += [head] if names & tainted else []
            b1, _ = _unwaited_reads(st.body, allowed, tainted, False)
            bad += b1
            continue
        names = {n.id for n in ast.walk(st) if isinstance(n, ast.Name)}
        if names & tainted and isinstance(st, ast.Assign) and not any(isinstance(n, ast.Call) for n in ast.walk(st.value)):
            # arithmetic on a pointer is no read: what it makes is tainted in turn
            tainted |= {n.id for tg in st.targets for n in ast.walk(tg) if isinstance(n, ast.Name)}
        elif names & tainted:
            bad.append(st)
        elif isinstance(st, ast.Assign) and names & allowed:
            # a local made from an allowed pointer (w_rows = w_ptr + ...) stays allowed
            allowed |= {t.id for t in st.targets if isinstance(t, ast.Name)}
    return bad, waited


# A kernel's file name is its template and the hash of its source: a name met again under another
# variant is the same source, checked in the fast suite once (every copy with --exhaustive).
_SEEN: set = set()
CASES = [pytest.param(p, id=f"{p.parent.parent.name}/{p.stem}",
                      marks=EXHAUSTIVE if p.name in _SEEN or _SEEN.add(p.name) else ()) for p in KERNELS]


def _check_waits(source: str):
    """The wait comes right after the trigger, or, in a kernel whose META names
    reads_before_wait, before any use of a pointer parameter outside those (on every path)."""
    tree = ast.parse(source)
    meta = _meta(tree)
    entry = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == meta["entry"])
    uses_gdc = "gdc_wait" in source
    if not meta.get("pdl"):
        # a kernel without the META flag is launched plainly: it must not pretend otherwise
        assert not uses_gdc and "PDL" not in meta["constexprs"]
        return
    assert meta["constexprs"].get("PDL") is True
    assert "PDL" in [a.arg for a in entry.args.args]
    body = [s for s in entry.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    assert _is_pdl_call(body[0], "gdc_launch_dependents"), ast.unparse(body[0])
    early = set(meta.get("reads_before_wait", []))
    if not early:
        assert _is_pdl_call(body[1], "gdc_wait"), ast.unparse(body[1])
        return
    pointers = {name for name, ty, _ in meta["params"] if ty.startswith("*")}
    assert early <= pointers, early - pointers
    bad, _ = _unwaited_reads(body[1:], set(early), pointers - early, False)
    assert not bad, "\n".join(ast.unparse(b) for b in bad)
    assert uses_gdc


@pytest.mark.parametrize("path", CASES)
def test_a_dependent_kernel_waits_before_anything_else(path):
    _check_waits(path.read_text())


@functools.cache
def _generated() -> list:
    """(variant, plan, kernel id -> META) of every variant in generated/, parsed once."""
    import json
    out = []
    for plan_path in sorted(REPO.glob("generated/*/plan.json")):
        metas = {p.stem: _meta(ast.parse(p.read_text())) for p in (plan_path.parent / "kernels").glob("*.py")}
        out.append((plan_path.parent.name, json.loads(plan_path.read_text()), metas))
    return out


def _check_early_reads(variant: str, plan: dict, metas: dict, checked: dict):
    """Every launch of a kernel that reads parameters before its wait binds them to what no kernel
    of the step writes before it; counts the bindings by kind into `checked`."""
    from infc.compiler.contract.program import unrolled
    for program in plan["programs"].values():
        order = list(unrolled(program))
        for launch, layer in order:
            meta = metas.get(launch.get("kernel_id"))
            if not meta or not meta.get("reads_before_wait"):
                continue
            binding = {name: src for name, _, src in meta["params"]}
            where = (variant, launch["kernel_id"])
            for name in meta["reads_before_wait"]:
                kind, _, idx = binding[name].partition(":")
                assert kind in checked, (where, name, binding[name])
                if kind == "in":
                    value = launch["inputs"][int(idx)]
                    assert value in plan["weights"], (where, name, value)
                elif kind == "cache":
                    # every launch of the layer that writes this cache (lists it as an output)
                    assert launch.get("caches"), (where, name)
                    # a paged cache's writer outputs the `cache` marker; a slot cache (a sequence's
                    # state) is read and written by every launch that names it
                    slot = all(plan["caches"][c]["kind"] == "slot" for c in launch["caches"])
                    writers = [other for other, lay in order if lay == layer and ("cache" in other["outputs"] or slot)
                               and other.get("caches") == launch["caches"]]
                    assert writers == [launch], (where, name, [w["op"] for w in writers])
                checked[kind] += 1


def test_reads_before_the_wait_are_step_invariant():
    """Every launch of a kernel that reads parameters before its wait binds them to what no kernel
    of the step writes before it, in every spec variant's plan: weights (immutable for the whole
    run), the step's metadata (uploaded before its first kernel), or a cache that only this
    launch writes in its layer (the narrow attention with its cache write merged in: it reads the
    keys of earlier steps before the wait and its own token's after its own barrier; the decode
    delta rule: its sequences' state slots, which it alone reads and writes in its layer)."""
    checked = {"in": 0, "meta": 0, "cache": 0}
    for variant, plan, metas in _generated():
        _check_early_reads(variant, plan, metas, checked)
    assert checked["in"] > 100 and checked["meta"] > 10 and checked["cache"] > 10, checked


def test_the_unwaited_read_check_follows_pointer_arithmetic():
    """Arithmetic on a pointer before the wait is no read (a LoRA site's set of sync words, taken
    by layer), but a load through what it made is one."""
    ok = ("def k(s_ptr, w_ptr, lset, PDL):\n"
          "    if PDL:\n        gdc_launch_dependents()\n"
          "    base, lset = s_ptr, (lset + 1) % 64\n    p = base + lset * 4\n"
          "    w = tl.load(w_ptr)\n"
          "    if PDL:\n        gdc_wait()\n    x = tl.load(p)\n")
    bad = ok.replace("    w = tl.load(w_ptr)\n", "    w = tl.load(p)\n")
    for src, n in ((ok, 0), (bad, 1)):
        body = ast.parse(src).body[0].body
        found, waited = _unwaited_reads(body[1:], {"w_ptr"}, {"s_ptr"}, False)
        assert len(found) == n and waited


def test_the_unwaited_read_check_catches_an_activation_read():
    """The check above fails a kernel that loads an activation before its wait."""
    src = (
        "def k(a_ptr, w_ptr, M, PDL):\n"
        "    if PDL:\n        gdc_launch_dependents()\n"
        "    w = tl.load(w_ptr)\n"
        "    if M <= 1:\n"
        "        x = tl.load(a_ptr)\n"
        "        if PDL:\n            gdc_wait()\n"
        "    else:\n"
        "        if PDL:\n            gdc_wait()\n"
        "        y = tl.load(a_ptr)\n")
    body = ast.parse(src).body[0].body
    bad, _ = _unwaited_reads(body[1:], {"w_ptr"}, {"a_ptr"}, False)
    assert [ast.unparse(b) for b in bad] == ["x = tl.load(a_ptr)"]
    fixed = src.replace("        x = tl.load(a_ptr)\n        if PDL:\n            gdc_wait()\n",
                        "        if PDL:\n            gdc_wait()\n        x = tl.load(a_ptr)\n")
    bad, waited = _unwaited_reads(ast.parse(fixed).body[0].body[1:], {"w_ptr"}, {"a_ptr"}, False)
    assert not bad and waited


# the programs a decode step runs (compiler/contract/program.py program_name) whose every launch
# is a dependent one; "wide" (many sequences a step) still launches the grouped expert GEMMs plainly
STEP_PROGRAMS = ("decode", "narrow")


def _plain_launches(plan: dict, metas: dict, programs=STEP_PROGRAMS) -> dict:
    from infc.compiler.contract.program import unrolled
    return {name: sorted({launch["kernel_id"] for launch, _ in unrolled(plan["programs"][name])
                          if launch["backend"] != "nccl" and not metas[launch["kernel_id"]].get("pdl")})
            for name in programs if name in plan["programs"]}


def test_the_decode_chain_of_qwen3_is_dependent():
    """Every launch of Qwen3-4B's decode step allows it: a plain kernel in the chain would
    serialize the launches around it again."""
    from infc.compiler.contract.program import unrolled
    variant, plan, metas = next(g for g in _generated() if g[0] == "qwen3-4b")
    assert len(list(unrolled(plan["programs"]["decode"]))) > 200
    assert _plain_launches(plan, metas) == {"decode": [], "narrow": []}


def test_every_variants_decode_step_is_dependent():
    """Every variant's decode steps, one token or a batch: the families' own kernels too (GPT-2's
    pos_embedding and layer_norm, Gemma's logit scale, DeepSeek-V4's moe_align, gather_last)."""
    plain = {variant: p for variant, plan, metas in _generated()
             if any((p := _plain_launches(plan, metas)).values())}
    assert not plain, plain


@pytest.fixture(scope="module")
def lora_kernels():
    """Qwen3-0.6B built with --enable-lora (2 slots, rank 16), its kernels rendered for the H200:
    (plan, kernel id -> Kernel). The LoRA launches are nowhere in generated/."""
    from infc.compiler.build import compile_model
    from infc.compiler.codegen.render import render_plan
    from infc.compiler.tuning_table import load_tuning
    from infc.config import lora_build
    _, plan = compile_model(model="qwen3-0.6b", lora=lora_build(2, 16))
    return plan, render_plan(plan, load_tuning("h200"), 64)


def test_the_lora_build_waits_and_its_decode_step_is_dependent(lora_kernels):
    """The LoRA build's kernels keep the wait contract, its early reads bind to weights (the
    narrow GEMVs' W, the decode shrinks' first A tiles: adapter tables change only by copies
    between steps) or step metadata (the shrinks' row tiles), and its decode steps have no plain
    launch: the
    shrink / expand launches of a wide and a decode step (infc/config.py LORA_DECODE_SITES off)
    and the merged sites of the narrow one."""
    plan, kernels = lora_kernels
    for k in kernels.values():
        _check_waits(k.source)
    metas = {kid: k.meta for kid, k in kernels.items()}
    checked = {"in": 0, "meta": 0, "cache": 0}
    _check_early_reads("qwen3-0.6b+lora", plan, metas, checked)
    assert checked["in"] > 0 and checked["meta"] > 0, checked
    from infc.compiler.contract.program import unrolled
    for program in ("wide", "decode"):
        ops = {kernels[launch["kernel_id"]].template for launch, _ in unrolled(plan["programs"][program])}
        assert {"lora_shrink", "lora_expand", "lora_expand_act"} <= ops, (program, ops)
    ops = {kernels[launch["kernel_id"]].template for launch, _ in unrolled(plan["programs"]["narrow"])}
    assert not {"lora_shrink", "lora_expand", "lora_expand_act"} & ops, ops
    assert _plain_launches(plan, metas, STEP_PROGRAMS + ("wide",)) == {"decode": [], "narrow": [], "wide": []}


def test_a_merged_lora_launch_waits_first():
    """lora_expand / lora_expand_act with the shrink merged in (a narrow step's form where the GEMV
    cannot take the site, compiler/passes/merge_prologues.py) wait before their tickets."""
    from infc.compiler.codegen.render import render_template
    t = lambda name, shape, dtype="bf16", k="buffer": {"name": name, "shape": shape, "dtype": dtype, "kind": k}  # noqa: E731
    shrink = {"split": 4, "prefill_split": 2}
    prologue = {"op": "lora_shrink", "inputs": 2, "output": 0, "value": "xa", "writes": 0, "feeds": 1, "attrs": shrink}
    for op, fn, out in (("lora_expand", {}, t("y", ["T", 96])), ("lora_expand_act", {"fn": "silu"}, t("act", ["T", 48]))):
        ctx = {"op": op, "phase": "decode", "narrow": True, "narrow_rows": 1, "prologue": prologue,
               "attrs": {"pieces": [48, 48], "rank": 16, **shrink, **fn}, "config": {}, "caches": {},
               "page_size": 16, "tune": {},
               "inputs": [t("x", ["T", 80]), t("a", [3, 32, 80], k="weight"), t("y", ["T", 96]),
                          t("b", [3, 96, 16], k="weight"), t("scale", [3, 2], "f32", "weight")],
               "outputs": [out]}
        k = render_template("triton", op, ctx)
        assert "_ticket" in k.source and k.meta.get("pdl"), op      # the merged form, dependent
        _check_waits(k.source)


@pytest.mark.parametrize("kind", ["weight", "buffer"])
def test_only_a_weight_is_read_before_the_wait(kind):
    """The batch-1 GEMV reads its first W tiles before the wait only when W is a weight; a W that
    an earlier kernel computes (x @ y^T of two activations) waits first, like every other input."""
    from infc.compiler.codegen.render import render_template
    t = lambda name, shape, k="buffer": {"name": name, "shape": shape, "dtype": "bf16", "kind": k}  # noqa: E731
    ctx = {"op": "linear", "phase": "decode", "attrs": {}, "config": {}, "caches": {}, "page_size": 16,
           "tune": {}, "inputs": [t("x", ["T", 2560]), t("w", [6144, 2560], kind)],
           "outputs": [t("y", ["T", 6144])]}
    k = render_template("triton", "gemv", ctx)
    tree = ast.parse(k.source)
    entry = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == k.meta["entry"])
    body = [s for s in entry.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if kind == "weight":
        assert k.meta["reads_before_wait"] == ["w_ptr"]
        assert not _is_pdl_call(body[1], "gdc_wait")
        pointers = {name for name, ty, _ in k.meta["params"] if ty.startswith("*")}
        bad, _ = _unwaited_reads(body[1:], {"w_ptr"}, pointers - {"w_ptr"}, False)
        assert not bad
    else:
        assert "reads_before_wait" not in k.meta
        assert _is_pdl_call(body[1], "gdc_wait")
