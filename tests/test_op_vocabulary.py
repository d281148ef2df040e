"""Every op in the vocabulary runs on the GPU without fusion: it has a generic Triton template
for every phase (and the template file exists), or it launches nothing (a view), or a required
lowering pass replaces it before kernel selection."""
import pytest

from infc.compiler.codegen.render import TEMPLATES
from infc.compiler.ops import REGISTRY
from infc.compiler.passes.select_kernels import PHASES

# op -> the required pass that rewrites it into ops that have kernels
LOWERED = {"attention": "split_attention", "moe_experts": "lower_experts",
           "compressed_attention": "split_compression", "indexer_topk": "split_compression"}


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_op_has_a_generic_kernel(name):
    op = REGISTRY[name]
    if op.view:
        return
    if op.collective:            # between ranks: the runtime's NCCL communicator runs it
        assert op.template("triton", "decode") is None, name
        return
    if name in LOWERED:
        assert not op.templates, f"{name} is lowered by {LOWERED[name]}: a template would never run"
        return
    # an op that only some programs launch (OpDef.phases: expert_upcast) needs templates for those
    assert op.phases is None or set(op.phases) <= set(PHASES), name
    for phase in op.phases or PHASES:
        tmpl = op.template("triton", phase)
        assert tmpl is not None, f"{name} has no Triton template for {phase}"
        assert (TEMPLATES / "triton" / f"{tmpl}.py.j2").exists(), f"{name}: template {tmpl} missing"


def test_lowered_ops_are_lowered_by_a_required_pass():
    from infc.compiler.pipeline import FUSIONS, PIPELINE
    names = [n for n, _ in PIPELINE]
    for op, pass_name in LOWERED.items():
        assert pass_name in names and pass_name not in FUSIONS, op
