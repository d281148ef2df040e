"""Row logits, the capability behind prompt logprobs: the logits of any rows of a step, not only
each sequence's last.

A plan's logits come from a tail of launches that starts by gathering each sequence's last row
(`last`, or `lm_head_last` once fused) and ends at the logits output: the final norm and the
vocabulary projection, whatever the model's (bias, softcap). Run again with other rows in place
of the last rows (and as many rows as there are), the same tail gives those rows' logits. This
pass finds the tail and has plan_memory keep its per-token inputs alive to the end of every
program (no later launch reuses their memory; they stay graph values, not outputs, so their
dtype is the model's); plan["row_logits"] records it:

    {"tail": [the first output of each tail launch, in order], "inputs": [the kept values]}

The runtime re-runs those launches after a step whose sequences ask for prompt logprobs
(runtime/reference/executor.py `row_logits`). A plan without it (a spec whose logits do not end
in such a chain) has no prompt logprobs on the engine's path.
"""
# ops that pick each sequence's last row ([T, ...] -> [B, ...] at step_metadata last_rows)
GATHERS = ("last", "lm_head_last")


def row_logits(state):
    g = state.graph
    if "logits" not in g.output_names:
        return
    value = g.outputs[g.output_names.index("logits")]
    tail = []
    while True:
        n = g.producer(value)
        if n is None or n.op == "layers":
            state.note("row_logits", "the logits do not start at a last-row gather: no row logits")
            return
        tail.append(n)
        if n.op in GATHERS:
            break
        acts = [i for i in n.inputs if g.values[i].kind not in ("weight", "marker")]
        if len(acts) != 1:
            state.note("row_logits", f"{n.op} (line {n.line}) reads {len(acts)} activations "
                                     f"between the gather and the logits: no row logits")
            return
        value = acts[0]
    tail.reverse()
    kept = [i for i in tail[0].inputs if g.values[i].kind not in ("weight", "marker")]
    state.row_logits = {"tail": [n.outputs[0] for n in tail], "inputs": kept}
    state.note("row_logits", f"tail {' -> '.join(n.op for n in tail)}, keeping {', '.join(kept)}")
