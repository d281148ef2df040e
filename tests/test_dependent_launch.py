"""Programmatic dependent launch (codegen_templates/triton/_pdl.j2): a kernel whose META allows it
may start while the kernel before it still runs, so it must wait (griddepcontrol.wait) before it
reads or writes anything. Checked on every kernel rendered for every spec variant in generated/
(`make generated` keeps them current), since a missing wait is a race no CPU test would see."""
import ast
from pathlib import Path

import pytest

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


@pytest.mark.parametrize("path", KERNELS, ids=lambda p: f"{p.parent.parent.name}/{p.stem}")
def test_a_dependent_kernel_waits_before_anything_else(path):
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
    assert _is_pdl_call(body[1], "gdc_wait"), ast.unparse(body[1])


def test_the_decode_chain_of_qwen3_is_dependent():
    """Every launch of Qwen3-4B's decode step allows it: a plain kernel in the chain would
    serialize the launches around it again."""
    import json
    plan = json.loads((REPO / "generated/qwen3-4b/plan.json").read_text())
    from infc.runtime.program import unrolled
    kernels = {p.stem: _meta(ast.parse(p.read_text())) for p in (REPO / "generated/qwen3-4b/kernels").glob("*.py")}
    launched = [launch["kernel_id"] for launch, _ in unrolled(plan["programs"]["decode"])]
    assert len(launched) > 200
    assert all(kernels[k].get("pdl") for k in launched), sorted({k for k in launched if not kernels[k].get("pdl")})
