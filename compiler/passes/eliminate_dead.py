"""Dead-code elimination: drop nodes none of whose outputs is read (fusion leaves none in the
shipped specs; a spec that computes unused values gets them removed here)."""


def eliminate_dead(state):
    for g in state.graph.walk():
        changed = True
        while changed:
            changed = False
            for n in reversed(g.ordered()):
                if n.op == "layers":
                    continue
                if any(g.uses(o) for o in n.outputs):
                    continue
                g.remove_node(n.id)
                state.note("eliminate_dead", f"{g.name}: removed unused {n.op} (line {n.line})")
                changed = True
