"""act_mul(lora_expand(gu, xa, b, scale)) -> lora_expand_act(gu, xa, b, scale): a gate|up linear's
adapter expand and the gated activation after it in one launch (compiler/ops/lora.py), so an
--enable-lora plan spends no extra launch a layer on the activation it can no longer put in the
gate|up GEMM's epilogue (the expand must come between). Without --enable-lora there is no
lora_expand: the pass does nothing."""
from ..ir import Node, Value


def fuse_lora_act(state):
    for g in state.graph.walk():
        for act in [n for n in g.ordered() if n.op == "act_mul"]:
            exp = g.producer(act.inputs[0])
            if exp is None or exp.op != "lora_expand" or len(g.users(exp.outputs[0])) != 1 \
                    or exp.outputs[0] in g.outputs or len(exp.attrs["pieces"]) != 2 \
                    or len(set(exp.attrs["pieces"])) != 1:
                continue
            out = g.fresh("act")
            g.add_value(Value(out, "act", line=act.line))
            g.add_node(Node(g.new_node_id("lora_expand_act"), "lora_expand_act", list(exp.inputs), [out],
                            {**exp.attrs, "fn": act.attrs["fn"]}, exp.line,
                            fused_from=list(act.fused_from)), before=exp.id)
            g.replace_uses(act.outputs[0], out)
            g.remove_node(act.id)
            g.remove_node(exp.id)
            state.note("fuse_lora_act", f"{g.name}: line {exp.line} ({act.attrs['fn']})")
