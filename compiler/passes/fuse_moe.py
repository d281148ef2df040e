"""moe_route + moe_align -> moe_route_align: the router launch also groups the tokens by expert.

lower_experts puts a moe_align launch before the experts (the prefill kernels' per-expert token
lists); where its ids are a moe_route's own output (no ep_dispatch in between), the route kernel
can count each token's experts as it picks them, so the alignment costs no launch. The fused
op's decode kernel only routes: the decode expert kernels group their few tokens themselves, so
batch-1 decode keeps exactly the launches it had.
"""
from ..ir import Node


def fuse_route_align(state):
    for g in state.graph.walk():
        for al in [n for n in g.ordered() if n.op == "moe_align"]:
            route = g.producer(al.inputs[0])
            if route is None or route.op != "moe_route" or route.outputs[1] != al.inputs[0]:
                continue
            fused = Node(g.new_node_id("moe_route_align"), "moe_route_align", list(route.inputs),
                         list(route.outputs) + list(al.outputs), {**route.attrs, **al.attrs}, route.line,
                         fused_from=["moe_route", "moe_align"])
            g.add_node(fused, before=route.id)
            g.remove_node(al.id)
            g.remove_node(route.id)
            state.note("fuse_route_align", f"{g.name}: line {route.line}")
