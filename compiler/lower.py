"""Spec -> graph IR. Statements become op nodes in SSA form; nested calls become temporaries.

Statements run in order and may reassign names (`x = add(x, ...)`); a name used before its
first assignment refers forward, and the statements are reordered by their data flow, so a
true cycle is reported with the lines on it.
"""
import ast

import networkx as nx

from .errors import SpecError, did_you_mean
from .expr import EvalError, Unknown, evaluate, free_names
from .ir import DYNAMIC, Graph, Node, TensorType, Value
from .ops import REGISTRY, REQUIRED
from .spec import Spec, Statement

ACT_DTYPE = "bf16"
STEP_INPUTS = {"tokens": TensorType(("T",), "i32")}


def _order(stmts: list[Statement], known: set[str], spec: Spec) -> list[Statement]:
    """Data-flow order of statements; raises on a cycle."""
    defs: dict[str, list[int]] = {}
    for i, s in enumerate(stmts):
        for t in s.targets:
            defs.setdefault(t, []).append(i)
    g = nx.DiGraph()
    g.add_nodes_from(range(len(stmts)))
    for i, s in enumerate(stmts):
        for name in free_names(s.expr):
            earlier = [j for j in defs.get(name, []) if j < i]
            if earlier:
                g.add_edge(earlier[-1], i)
            elif name not in known and name in defs:
                g.add_edge(defs[name][0], i)        # forward reference
    try:
        cycle = nx.find_cycle(g)
    except nx.NetworkXNoCycle:
        return [stmts[i] for i in nx.lexicographical_topological_sort(g)]
    lines = [stmts[a] for a, _ in cycle]
    path = " -> ".join(f"'{', '.join(s.targets)}' (line {s.line})" for s in lines)
    raise spec.err(f"cycle in graph: {path} -> '{', '.join(lines[0].targets)}'", lines[0].line)


class _Lowerer:
    def __init__(self, spec: Spec, env: dict):
        self.spec, self.env = spec, env

    def err(self, msg, line) -> SpecError:
        return self.spec.err(msg, line)

    def shape(self, exprs, line, what) -> tuple:
        dims = []
        for e in exprs:
            if isinstance(e, ast.Name) and e.id in DYNAMIC:
                dims.append(e.id)
                continue
            if free_names(e) & set(DYNAMIC):
                raise self.err(f"{what}: dynamic dimension T/B must stand alone, got '{ast.unparse(e)}'", line)
            try:
                v = evaluate(e, self.env)
            except Unknown as u:
                raise self.err(f"{what}: unknown symbol '{u.name}' in shape"
                               f"{did_you_mean(u.name, self.env)}", line) from None
            except EvalError as x:
                raise self.err(f"{what}: {x}", line) from None
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise self.err(f"{what}: shape dimension '{ast.unparse(e)}' = {v!r} is not a positive integer", line)
            dims.append(v)
        return tuple(dims)

    def weights(self, g: Graph, decls: dict, per_layer: bool, sources: dict):
        for key, d in decls.items():
            when = False
            if d.when is not None:
                if d.when not in self.env:
                    raise self.err(f"weight '{key}': 'when' names unknown symbol '{d.when}'"
                                   f"{did_you_mean(d.when, self.env)}", d.line)
                when = bool(self.env[d.when])
            shape = self.shape(d.shape, d.line, f"weight '{key}'")
            for dim in shape:
                if isinstance(dim, str):
                    raise self.err(f"weight '{key}': shape uses the dynamic dimension '{dim}' "
                                   f"(tokens/sequences in a step); weight shapes are static", d.line)
            if d.experts is not None:
                if d.experts not in self.env:
                    raise self.err(f"weight '{key}': 'experts' names unknown symbol '{d.experts}'", d.line)
                shape = (self.env[d.experts],) + shape
                if "{e}" not in d.name:
                    raise self.err(f"weight '{key}' has 'experts' but its name has no {{e}}", d.line)
            if per_layer and "{i}" not in d.name:
                raise self.err(f"layer weight '{key}' name has no {{i}} layer index", d.line)
            dtype = d.dtype or ACT_DTYPE
            if d.tied_to is not None and d.tied_to not in sources:   # checked even when not tied
                raise self.err(f"weight '{key}' is tied to unknown weight '{d.tied_to}'"
                               f"{did_you_mean(d.tied_to, sources)}", d.line)
            if d.tied_to is not None and when:
                source = {"tied": d.tied_to}
            else:
                source = {"tensor": d.name}
                if d.experts is not None:
                    source = {"stack": d.name, "count": self.env[d.experts]}
            g.add_value(Value(key, "weight", TensorType(shape, dtype), line=d.line))
            sources[key] = {"source": source, "per_layer": per_layer}

    def statements(self, g: Graph, stmts: list[Statement], scope: dict):
        # Targets are checked before ordering: a target that shadows a weight or a config
        # symbol would otherwise read as a forward reference and be reported as a cycle.
        for s in stmts:
            if len(s.targets) != len(set(s.targets)):
                raise self.err(f"duplicate name in targets of '{s.text}'", s.line)
            for t in s.targets:
                if t in self.env:
                    raise self.err(f"name '{t}' is already a config symbol", s.line)
                if t in g.values and g.values[t].kind == "weight":
                    raise self.err(f"name '{t}' is already a weight", s.line)
        for s in _order(stmts, set(scope), self.spec):
            outs = self.expr(g, s.expr, scope, s.line, len(s.targets), s.targets)
            for t, v in zip(s.targets, outs):
                scope[t] = v

    def tensor_arg(self, g, e, scope, line, op_name, param):
        if isinstance(e, ast.Call):
            (v,) = self.expr(g, e, scope, line, 1)
            return v
        if isinstance(e, ast.Name):
            if e.id in scope:
                return scope[e.id]
            if e.id in g.values and g.values[e.id].kind in ("weight", "input"):
                return e.id
            if e.id in self.env:
                raise self.err(f"{op_name}: '{param}' must be a tensor, but '{e.id}' is a config value", line)
            spec = self.spec
            if g.is_body and e.id in spec.weights:
                raise self.err(f"{op_name}: '{e.id}' is a top-level weight; layer.graph sees only "
                               f"layer.weights and the values layers(...) carries", line)
            if not g.is_body and e.id in spec.layer_weights:
                raise self.err(f"{op_name}: '{e.id}' is a layer weight; only layer.graph can use it", line)
            known = list(scope) + [n for n, v in g.values.items() if v.kind in ("weight", "input")]
            raise self.err(f"{op_name}: unknown name '{e.id}' (not a declared weight, a step input "
                           f"or an assigned value){did_you_mean(e.id, known)}", line)
        raise self.err(f"{op_name}: '{param}' must be a tensor name or an op call, got '{ast.unparse(e)}'", line)

    def attr_arg(self, e, line, op_name, param, tensors=()):
        if param == "shape":
            if not isinstance(e, (ast.List, ast.Tuple)):
                raise self.err(f"{op_name}: shape must be a list like [T, H]", line)
            return list(self.shape(e.elts, line, op_name))
        try:
            return evaluate(e, self.env)
        except Unknown as u:
            if u.name in tensors:
                raise self.err(f"{op_name}: '{param}' must be a config value or a constant, but "
                               f"'{u.name}' is a tensor", line) from None
            raise self.err(f"{op_name}: unknown symbol '{u.name}'{did_you_mean(u.name, self.env)}",
                           line) from None
        except (ValueError, TypeError) as x:
            raise self.err(f"{op_name}: bad attribute '{ast.unparse(e)}': {x}", line) from None

    def expr(self, g: Graph, e, scope, line, n_targets, names=None) -> list[str]:
        """Lower one call; its outputs are named after the statement's targets when given."""
        if isinstance(e, ast.Name):
            return [self.tensor_arg(g, e, scope, line, "assignment", "value")]
        if not isinstance(e, ast.Call) or not isinstance(e.func, ast.Name):
            raise self.err(f"expected an op call, got '{ast.unparse(e)}'", line)
        name = e.func.id
        if name == "layers":
            return self.layers(g, e, scope, line, n_targets)
        if name not in REGISTRY or REGISTRY[name].internal:
            known = sorted(n for n, d in REGISTRY.items() if not d.internal)
            raise self.err(f"unknown op '{name}'{did_you_mean(name, known + ['layers'])} "
                           f"(known ops: {', '.join(known)}, layers)", line)
        op = REGISTRY[name]
        params = op.tensors + list(op.attrs)
        sig = f"{name}({', '.join(params)})"
        if len(e.args) > len(params):
            raise self.err(f"{name} takes at most {len(params)} arguments {sig}, got {len(e.args)}", line)
        bound = dict(zip(params, e.args))
        for kw in e.keywords:
            if kw.arg not in params:
                raise self.err(f"{name} has no parameter '{kw.arg}'; signature {sig}", line)
            if kw.arg in bound:
                raise self.err(f"{name}: parameter '{kw.arg}' given twice", line)
            bound[kw.arg] = kw.value
        missing = [p for p in op.tensors if p not in bound]
        missing += [a for a, dflt in op.attrs.items() if dflt is REQUIRED and a not in bound]
        if missing:
            raise self.err(f"{name} is missing argument(s) {', '.join(missing)}; signature {sig}", line)
        inputs = [self.tensor_arg(g, bound[p], scope, line, name, p) for p in op.tensors]
        tensors = set(scope) | set(g.values)
        attrs = {a: (self.attr_arg(bound[a], line, name, a, tensors) if a in bound else dflt)
                 for a, dflt in op.attrs.items()}
        n_out = op.n_outputs or 1
        if n_out != n_targets and n_targets != 1:
            raise self.err(f"{name} returns {n_out} value(s) but {n_targets} name(s) are assigned", line)
        if n_out != n_targets:
            raise self.err(f"{name} returns {n_out} values; assign them as 'a, b = {name}(...)'", line)
        outs = [g.fresh(t) for t in (names or [name] * n_out)]
        for o in outs:
            g.add_value(Value(o, "act", line=line))
        g.add_node(Node(g.new_node_id(name), name, inputs, outs, attrs, line, fused_from=[name]))
        return outs

    def layers(self, g: Graph, e, scope, line, n_targets) -> list[str]:
        spec = self.spec
        if not spec.layer_graph:
            raise self.err("layers(...) is used but the spec has no 'layer' section", line)
        if e.keywords or not e.args or not all(isinstance(a, ast.Name) for a in e.args):
            raise self.err("layers(...) takes the names of the values carried through the layers", line)
        if n_targets != len(e.args):
            raise self.err(f"layers carries {len(e.args)} value(s) but {n_targets} are assigned", line)
        carried = [a.id for a in e.args]
        body = Graph("layer", parent=g)
        self.weights(body, spec.layer_weights, True, self.sources)
        bscope = {}
        for c in carried:
            outer = self.tensor_arg(g, ast.Name(c), scope, line, "layers", c)
            body.add_value(Value(c, "input", line=line))
            body.inputs.append(c)
            bscope[c] = c
            del outer
        self.statements(body, spec.layer_graph, bscope)
        body.outputs = [bscope[c] for c in carried]
        for o, i in body.carried.items():
            if o == i:
                raise self.err(f"the layer graph never assigns carried value '{i}'", line)
        outs = [g.fresh(c) for c in carried]
        for o in outs:
            g.add_value(Value(o, "act", line=line))
        count = self.env.get("L")
        g.add_node(Node(g.new_node_id("layers"), "layers", [scope[c] for c in carried], outs,
                        {"count": count}, line, body=body))
        return outs


def lower(spec: Spec, env: dict) -> tuple[Graph, dict]:
    """Returns the top graph and the weight source table {name: {source, per_layer}}."""
    lw = _Lowerer(spec, env)
    lw.sources = {}
    g = Graph("model")
    for name, t in STEP_INPUTS.items():
        g.add_value(Value(name, "input", t))
        g.inputs.append(name)
    if "L" not in env and spec.layer_graph:
        raise spec.err("a spec with a 'layer' section must bind the layer count symbol L", 1)
    lw.weights(g, spec.weights, False, lw.sources)
    scope = {n: n for n in STEP_INPUTS}
    lw.statements(g, spec.graph, scope)
    last = spec.graph[-1]
    g.outputs = [scope[t] for t in last.targets]
    g.output_names = list(last.targets)
    return g, lw.sources
