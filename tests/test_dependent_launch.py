"""Programmatic dependent launch (codegen_templates/triton/_pdl.j2): a kernel whose META allows it
may start while the kernel before it still runs, so it must wait (griddepcontrol.wait) before it
reads or writes anything. Checked on every kernel rendered for every spec variant in generated/
(`make generated` keeps them current), since a missing wait is a race no CPU test would see."""
import ast
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
        if names & tainted:
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


@pytest.mark.parametrize("path", CASES)
def test_a_dependent_kernel_waits_before_anything_else(path):
    """The wait comes right after the trigger, or, in a kernel whose META names
    reads_before_wait, before any use of a pointer parameter outside those (on every path)."""
    tree = ast.parse(path.read_text())
    meta = _meta(tree)
    entry = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == meta["entry"])
    uses_gdc = "gdc_wait" in path.read_text()
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
    assert "gdc_wait" in path.read_text()


def test_reads_before_the_wait_are_step_invariant():
    """Every launch of a kernel that reads parameters before its wait binds them to what no kernel
    of the step writes before it, in every spec variant's plan: weights (immutable for the whole
    run), the step's metadata (uploaded before its first kernel), or a KV cache that only this
    launch writes in its layer (the narrow attention with its cache write merged in: it reads the
    keys of earlier steps before the wait and its own token's after its own barrier)."""
    import json
    from infc.compiler.contract.program import unrolled
    checked = {"in": 0, "meta": 0, "cache": 0}
    for plan_path in sorted(REPO.glob("generated/*/plan.json")):
        plan = json.loads(plan_path.read_text())
        metas = {p.stem: _meta(ast.parse(p.read_text())) for p in (plan_path.parent / "kernels").glob("*.py")}
        for program in plan["programs"].values():
            order = list(unrolled(program))
            for launch, layer in order:
                meta = metas.get(launch.get("kernel_id"))
                if not meta or not meta.get("reads_before_wait"):
                    continue
                binding = {name: src for name, _, src in meta["params"]}
                where = (plan_path.parent.name, launch["kernel_id"])
                for name in meta["reads_before_wait"]:
                    kind, _, idx = binding[name].partition(":")
                    assert kind in checked, (where, name, binding[name])
                    if kind == "in":
                        value = launch["inputs"][int(idx)]
                        assert value in plan["weights"], (where, name, value)
                    elif kind == "cache":
                        # every launch of the layer that writes this cache (lists it as an output)
                        assert launch.get("caches"), (where, name)
                        writers = [other for other, lay in order if lay == layer and "cache" in other["outputs"]
                                   and other.get("caches") == launch["caches"]]
                        assert writers == [launch], (where, name, [w["op"] for w in writers])
                    checked[kind] += 1
    assert checked["in"] > 100 and checked["meta"] > 10 and checked["cache"] > 10, checked


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


def test_the_decode_chain_of_qwen3_is_dependent():
    """Every launch of Qwen3-4B's decode step allows it: a plain kernel in the chain would
    serialize the launches around it again."""
    import json
    plan = json.loads((REPO / "generated/qwen3-4b/plan.json").read_text())
    from infc.compiler.contract.program import unrolled
    kernels = {p.stem: _meta(ast.parse(p.read_text())) for p in (REPO / "generated/qwen3-4b/kernels").glob("*.py")}
    launched = [launch["kernel_id"] for launch, _ in unrolled(plan["programs"]["decode"])]
    assert len(launched) > 200
    assert all(kernels[k].get("pdl") for k in launched), sorted({k for k in launched if not kernels[k].get("pdl")})


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
