"""Spec -> graph IR. Statements become op nodes in SSA form; nested calls become temporaries.

Statements run in order and may reassign names (`x = add(x, ...)`); a name used before its
first assignment refers forward, and the statements are reordered by their data flow, so a
true cycle is reported with the lines on it.
"""
import ast

import networkx as nx
import numpy as np

from .checkpoint_check import recipe_names
from .contract.errors import SpecError, did_you_mean
from .expr import EvalError, Unknown, evaluate, free_names
from .ir import DYNAMIC, Graph, Node, TensorType, Value
from .ops import REGISTRY, REQUIRED
from .ops.activation import resolve as resolve_activation
from .spec import TRANSFORM_KEYS, WEIGHT_DTYPES, LayerKind, Spec, Statement, weight_name

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


# Ops whose tensor operands may be scalars (config expressions): lowered to affine(x, mul, add).
SCALAR_OPERANDS = {"mul": "mul", "add": "add"}


class _Lowerer:
    def __init__(self, spec: Spec, env: dict):
        self.spec, self.env = spec, env
        self.absent: dict[str, str] = {}     # weight -> why it does not exist (its `when`)

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

    def weights(self, g: Graph, decls: dict, layers: list | None, sources: dict):
        """Declare weights in g; layers: the global layer indices that have them (None: model-level)."""
        per_layer = layers is not None
        for key, d in decls.items():
            when = False
            if d.when is not None:
                if d.when not in self.env:
                    raise self.err(f"weight '{key}': 'when' names unknown symbol '{d.when}'"
                                   f"{did_you_mean(d.when, self.env)}", d.line)
                when = bool(self.env[d.when])
                if d.tied_to is None and not when:
                    self.absent[key] = f"'when: {d.when}' is false for this config"
                    continue
            shape = self.shape(d.shape, d.line, f"weight '{key}'")
            for dim in shape:
                if isinstance(dim, str):
                    raise self.err(f"weight '{key}': shape uses the dynamic dimension '{dim}' "
                                   f"(tokens/sequences in a step); weight shapes are static", d.line)
            if d.experts is not None:
                if d.experts not in self.env:
                    raise self.err(f"weight '{key}': 'experts' names unknown symbol '{d.experts}'", d.line)
                shape = (self.env[d.experts],) + shape
            # one layer may be named without an index (an EAGLE-3 head's `midlayer.*`)
            if per_layer and "{i}" not in d.name and self.env.get("L") != 1:
                raise self.err(f"layer weight '{key}' name has no {{i}} layer index", d.line)
            # An offset weight is HF's `offset + w.float()` (Gemma's and Qwen3.5's x * (1 + w)
            # RMSNorms): kept f32, since 1 + w rounded to bf16 is off by up to 2^-8 of itself, the
            # same for every token (measured on a Qwen3.5: more than all of HF bf16's own drift
            # from fp32). An f32 norm weight also multiplies in fp32 before the one rounding, as
            # torch promotes it (codegen_templates/triton/rms_norm.py.j2).
            dtype = d.dtype or ("f32" if "offset" in d.transforms else ACT_DTYPE)
            if d.tied_to is not None and d.tied_to not in sources:   # checked even when not tied
                raise self.err(f"weight '{key}' is tied to unknown weight '{d.tied_to}'"
                               f"{did_you_mean(d.tied_to, sources)}", d.line)
            if d.tied_to is not None and when:
                source = {"tied": d.tied_to}
            else:
                source = self.source(key, d, shape)
                if d.alternatives:
                    source = self.layout(source, [self.source(key, a, shape) for a in d.alternatives],
                                         layers)
            t = TensorType(shape, dtype)
            have = layers
            if key in sources:         # declared again in another kind's body
                prev = sources[key]
                if prev["type"] != t or prev["source"] != source:
                    raise self.err(f"weight '{key}' differs between layer kinds ({prev['type']} vs "
                                   f"{t}): a kind's symbols may not change a shared weight", d.line)
                # (its own variable: the next weights of this kind keep this kind's layers)
                have = sorted(set(prev["layers"] or []) | set(layers or []))
            g.add_value(Value(key, "weight", t, line=d.line))
            sources[key] = {"source": source, "layers": list(have) if per_layer else None,
                            "type": t, "line": d.line}

    def source(self, key, d, shape: tuple) -> dict:
        """The recipe of one layout of a weight (shape: the declared one, experts first).
        experts: E with {e} in the name stacks E tensors; without it, one checkpoint tensor holds
        them all on its first axis (transformers 5's [E, ...] expert parameters), and the
        transforms apply to each expert's part of it (`batched`)."""
        batched = d.experts is not None and "{e}" not in d.name
        name = weight_name(d.name, self.env, self.spec.path, d.line)
        source = {"tensor": name}
        if d.experts is not None and not batched:
            source = {"stack": name, "count": self.env[d.experts]}
        return self.transforms(key, d, source, shape[1:] if d.experts is not None else shape, batched)

    def layout(self, declared: dict, others: list, layers) -> dict:
        """A weight with `or:` layouts: the first whose every tensor the checkpoint holds, the
        declared one first; the declared one without a checkpoint (or when none is whole: the
        checkpoint check then names what is missing from it)."""
        if self.stored is None:
            return declared
        for src in [declared, *others]:
            if all(n in self.stored for layer in (layers if layers is not None else [None])
                   for n in recipe_names(src, {"i": layer})):
                return src
        return declared

    def transforms(self, key, d, source: dict, shape: tuple, batched: bool = False) -> dict:
        """Wrap a checkpoint source in the declared load-time transforms, in TRANSFORM_KEYS order.
        batched: the source is a stack of experts [E, ...] and shape one expert's; the transforms
        apply to each expert's part (axes shifted by one)."""
        heads = None
        if batched and ("heads" in d.transforms or "stored_shape" in d.transforms):
            raise self.err(f"weight '{key}': heads / stored_shape do not apply to an expert stack "
                           f"read from one tensor (a name without {{e}})", d.line)
        if "heads" in d.transforms:
            heads = self.transform_int(key, d, "heads", d.transforms["heads"], low=1)
            if len(shape) != 3 or shape[0] != heads:
                raise self.err(f"weight '{key}': heads: {heads} gives per-head matrices [{heads}, n, K]; "
                               f"the declared shape {list(shape)} must be 3-D with {heads} first", d.line)
        elif ("cols" in d.transforms or d.transforms.get("transpose")) and len(shape) != 2:
            raise self.err(f"weight '{key}': cols/transpose apply to a 2-D weight, its shape "
                           f"is {list(shape)}", d.line)
        # the declared shape is the result: a slice's length must be that axis (after transpose)
        stored = tuple(reversed(shape)) if d.transforms.get("transpose") else tuple(shape)
        if heads is not None:      # the 2-D tensor the heads are cut from: [G * n, K]
            inner = tuple(reversed(shape[1:])) if d.transforms.get("transpose") else tuple(shape[1:])
            stored = (heads * inner[0], inner[1])
        groups = 1
        if "groups" in d.transforms:
            groups = self.transform_int(key, d, "groups", d.transforms["groups"], low=1)
        for t in TRANSFORM_KEYS:
            if t not in d.transforms or t == "groups":
                continue
            v = d.transforms[t]
            if t == "heads":
                source = {"reshape": source, "from": list(stored),
                          "to": [heads, stored[0] // heads, stored[1]]}
                continue
            if t == "stored_shape":
                full = [self.transform_int(key, d, t, e, low=1) for e in v]
                if len(full) < len(stored):
                    raise self.err(f"weight '{key}': stored_shape {full} has fewer dims than the "
                                   f"declared shape {list(shape)} (only trailing dims are flattened)", d.line)
                r = len(stored)
                to = full[:r - 1] + [int(np.prod(full[r - 1:]))]
                sliced = {0} if "rows" in d.transforms else set()
                sliced |= {1} if "cols" in d.transforms else set()
                if any(to[k] != stored[k] for k in range(r) if k not in sliced):
                    raise self.err(f"weight '{key}': stored_shape {full} flattens to {to}, which the "
                                   f"declared shape {list(shape)} cannot come from", d.line)
                source = {"reshape": source, "from": full, "to": to}
            elif t in ("rows", "cols"):
                bounds = []
                for e in v:
                    try:
                        b = evaluate(e, self.env)
                    except (Unknown, EvalError) as x:
                        name = f"unknown symbol '{x.name}'" if isinstance(x, Unknown) else str(x)
                        raise self.err(f"weight '{key}': {t} bound {ast.unparse(e)}: {name}", d.line) from None
                    if not isinstance(b, int) or isinstance(b, bool) or b < 0:
                        raise self.err(f"weight '{key}': {t} bound '{ast.unparse(e)}' = {b!r} is not a "
                                       f"non-negative integer", d.line)
                    bounds.append(b)
                step = bounds[2] if len(bounds) == 3 else 1
                if bounds[0] >= bounds[1] or step < 1:
                    raise self.err(f"weight '{key}': {t} {bounds} is empty", d.line)
                axis = 0 if t == "rows" else 1
                g = groups if t == "rows" else 1
                if step > 1 and g > 1:
                    raise self.err(f"weight '{key}': a {t} step does not combine with groups", d.line)
                n = len(range(bounds[0], bounds[1], step))
                if g * n != stored[axis]:
                    each = f" in each of {g} groups" if g > 1 else ""
                    raise self.err(f"weight '{key}': {t} {bounds}{each} holds "
                                   f"{g * n} {t} but the declared shape "
                                   f"{list(shape)} needs {stored[axis]}", d.line)
                source = {"slice": source, "axis": axis + batched,
                          "start": bounds[0], "stop": bounds[1]}
                if step > 1:             # every step-th (an interleaved gate|up: step 2)
                    source["step"] = step
                if g > 1:
                    source["groups"] = g
            elif t == "transpose":
                if v:
                    each = heads is not None or batched      # each head's / expert's matrix
                    source = {"transpose": source, **({"per_head": True} if each else {})}
            elif t == "exp":
                if v:
                    source = {"exp": source}
            else:
                try:
                    by = evaluate(v, self.env)
                except (Unknown, EvalError) as x:
                    name = f"unknown symbol '{x.name}'" if isinstance(x, Unknown) else str(x)
                    raise self.err(f"weight '{key}': {t}: {name}", d.line) from None
                if not isinstance(by, (int, float)) or isinstance(by, bool):
                    raise self.err(f"weight '{key}': {t} must be a number, got {by!r}", d.line)
                source = {t: source, "by": float(by)}
        return source

    def transform_int(self, key, d, t, e, low=0) -> int:
        """A transform's integer parameter (a config expression) >= low."""
        try:
            v = evaluate(e, self.env)
        except (Unknown, EvalError) as x:
            name = f"unknown symbol '{x.name}'" if isinstance(x, Unknown) else str(x)
            raise self.err(f"weight '{key}': {t} {ast.unparse(e)}: {name}", d.line) from None
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise self.err(f"weight '{key}': {t} '{ast.unparse(e)}' = {v!r} is not an integer >= {low}",
                           d.line)
        return v

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

    def choose(self, e, line, where):
        """`a if cond else b` in a graph: cond is a config expression, decided here, at lowering;
        only the chosen side is lowered (its weights and ops; the other side's may not exist)."""
        while isinstance(e, ast.IfExp):
            try:
                cond = evaluate(e.test, self.env)
            except Unknown as u:
                raise self.err(f"{where}: the condition '{ast.unparse(e.test)}' must be a config "
                               f"expression (decided when the spec is lowered), but '{u.name}' is not a "
                               f"config symbol{did_you_mean(u.name, self.env)}", line) from None
            except EvalError as x:
                raise self.err(f"{where}: the condition '{ast.unparse(e.test)}': {x}", line) from None
            e = e.body if cond else e.orelse
        return e

    def tensor_arg(self, g, e, scope, line, op_name, param):
        e = self.choose(e, line, op_name)
        if isinstance(e, ast.Call):
            (v,) = self.expr(g, e, scope, line, 1)
            return v
        if isinstance(e, ast.Name):
            if e.id in scope:
                return scope[e.id]
            if e.id in g.values and g.values[e.id].kind in ("weight", "input"):
                return e.id
            if e.id in self.absent:
                raise self.err(f"{op_name}: weight '{e.id}' does not exist here ({self.absent[e.id]}); "
                               f"only an optional argument such as a bias may name it", line)
            if e.id in self.env:
                raise self.err(f"{op_name}: '{param}' must be a tensor, but '{e.id}' is a config value", line)
            spec = self.spec
            if g.is_body and e.id in spec.weights:
                raise self.err(f"{op_name}: '{e.id}' is a top-level weight; layer.graph sees only "
                               f"layer.weights and the values layers(...) carries", line)
            if not g.is_body and (e.id in spec.layer_weights
                                  or any(e.id in k.weights for k in spec.layer_kinds.values())):
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
        if param == "dtype" and isinstance(e, ast.Name) and e.id in WEIGHT_DTYPES and e.id not in self.env:
            return e.id                  # an output dtype written bare: l2_norm(x, dtype=f32)
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

    def present(self, e) -> bool:
        """Whether an optional tensor argument names a tensor: not left out, not None / none, not
        a weight whose `when` is false."""
        if isinstance(e, ast.IfExp):
            e = self.choose(e, None, "optional argument")
        return e is not None and not (isinstance(e, ast.Name) and e.id in self.absent) \
            and not (isinstance(e, ast.Constant) and e.value is None) \
            and not (isinstance(e, ast.Name) and e.id in ("none", "None"))

    def expr(self, g: Graph, e, scope, line, n_targets, names=None) -> list[str]:
        """Lower one call; its outputs are named after the statement's targets when given."""
        e = self.choose(e, line, "assignment")
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
        params = op.tensors + op.omittable + op.optional + op.extra_optional + list(op.attrs) + list(op.extra_attrs) \
            + op.keyword_optional
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
        if name in SCALAR_OPERANDS:
            scalar = self.scalar_operand(g, name, bound, scope, line, names)
            if scalar is not None:
                return scalar
        inputs = [self.tensor_arg(g, bound[p], scope, line, name, p) for p in op.tensors]
        tensors = set(scope) | set(g.values)
        attrs = {}
        for p in op.omittable:           # a norm with no weight: only its absence is recorded
            if self.present(bound.get(p)):
                inputs.append(self.tensor_arg(g, bound[p], scope, line, name, p))
            else:
                attrs[f"has_{p}"] = False
        for p in op.optional + op.extra_optional + op.keyword_optional:
            # a bias naming a weight whose `when` is false is left out; an extra optional tensor
            # leaves no trace where absent (other plans unchanged)
            present = self.present(bound.get(p))
            if present:
                inputs.append(self.tensor_arg(g, bound[p], scope, line, name, p))
            if present or p in op.optional:
                attrs[f"has_{p}"] = present
        attrs.update({a: (self.attr_arg(bound[a], line, name, a, tensors) if a in bound else dflt)
                      for a, dflt in op.attrs.items()})
        attrs.update({a: self.attr_arg(bound[a], line, name, a, tensors) for a in op.extra_attrs if a in bound})
        fused_from = [name]
        if name == "act":                # the config names the activation: lower to that op
            try:
                name = resolve_activation(attrs["fn"])
            except ValueError as x:
                raise self.err(f"act: {x}", line) from None
            attrs, fused_from = {}, ["act"]
        n_out = op.n_outputs or 1
        if op.n_outputs is None:          # variadic (split): one output per assigned name
            n_out = n_targets
        if n_out != n_targets and n_targets != 1:
            raise self.err(f"{name} returns {n_out} value(s) but {n_targets} name(s) are assigned", line)
        if n_out != n_targets:
            raise self.err(f"{name} returns {n_out} values; assign them as 'a, b = {name}(...)'", line)
        outs = [g.fresh(t) for t in (names or [name] * n_out)]
        for o in outs:
            g.add_value(Value(o, "act", line=line))
        g.add_node(Node(g.new_node_id(name), name, inputs, outs, attrs, line, fused_from=fused_from))
        return outs

    def is_tensor(self, g, e, scope) -> bool:
        if isinstance(e, ast.IfExp):
            try:
                return self.is_tensor(g, e.body if evaluate(e.test, self.env) else e.orelse, scope)
            except (Unknown, EvalError):
                return True          # lowered as a tensor, where choose() names the problem
        if isinstance(e, ast.Call):
            return True
        if isinstance(e, ast.Name):
            return e.id in scope or (e.id in g.values and g.values[e.id].kind in ("weight", "input")) \
                or e.id not in self.env and e.id not in ("none", "None", "true", "false")
        return False

    def scalar_operand(self, g, name, bound, scope, line, names):
        """mul(x, c) / add(x, c) with c a config expression -> affine(x, mul=c) / affine(x, add=c)."""
        a, b = bound["a"], bound["b"]
        ta, tb = self.is_tensor(g, a, scope), self.is_tensor(g, b, scope)
        if ta and tb:
            return None
        if not ta and not tb:
            raise self.err(f"{name}: both operands are scalars; write the value as a config "
                           f"symbol '= expression' instead", line)
        x, c = (a, b) if ta else (b, a)
        if "dtype" in bound:
            raise self.err(f"{name}: dtype applies to two tensor operands, not a scalar one", line)
        value = self.attr_arg(c, line, name, "b" if ta else "a", set(scope) | set(g.values))
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise self.err(f"{name}: scalar operand '{ast.unparse(c)}' = {value!r} is not a number", line)
        xv = self.tensor_arg(g, x, scope, line, name, "a" if ta else "b")
        attrs = {"mul": float(value), "add": 0.0} if name == "mul" else {"mul": 1.0, "add": float(value)}
        out = g.fresh((names or [name])[0])
        g.add_value(Value(out, "act", line=line))
        g.add_node(Node(g.new_node_id("affine"), "affine", [xv], [out], attrs, line, fused_from=[name]))
        return [out]

    def layers(self, g: Graph, e, scope, line, n_targets) -> list[str]:
        spec = self.spec
        if not spec.layer_graph and not spec.layer_kinds:
            raise self.err("layers(...) is used but the spec has no 'layer' section", line)
        if g.is_body:       # the layer graph calling layers(...) would lower itself forever
            raise self.err("layers(...) repeats the layer graph; the layer graph itself cannot call it "
                           "(use it in the top-level graph)", line)
        if e.keywords or not e.args or not all(isinstance(a, ast.Name) for a in e.args):
            raise self.err("layers(...) takes the names of the values carried through the layers", line)
        if n_targets != len(e.args):
            raise self.err(f"layers carries {len(e.args)} value(s) but {n_targets} are assigned", line)
        carried = [a.id for a in e.args]
        for c in carried:
            self.tensor_arg(g, ast.Name(c), scope, line, "layers", c)
        count = self.env.get("L")
        kinds = spec.layer_kinds or {"layer": LayerKind("layer", {}, {}, None, line)}
        top_env = self.env
        # A kind's symbols may read the layer index i (`theta: layer_rope_theta[i]`): the layers of
        # a kind whose symbol values differ get a body each, named kind, kind@1, kind@2, ...
        schedule, of = [], {}               # per layer: body name; body name -> (kind, its env)
        for i, kind in enumerate(self.schedule(count)):
            env = self.kind_env(top_env, kinds[kind], i)
            syms = kinds[kind].symbols
            name = next((n for n, (kk, e) in of.items()
                         if kk == kind and all(e[s] == env[s] for s in syms)), None)
            if name is None:
                n = sum(1 for kk, _ in of.values() if kk == kind)
                name = kind if n == 0 else f"{kind}@{n}"
                of[name] = (kind, env)
            schedule.append(name)
        bodies = {}
        for name in dict.fromkeys(schedule):        # bodies in order of first use
            kind, self.env = of[name]
            k = kinds[kind]
            body = Graph("layer" if name == "layer" else f"layer.{name}", parent=g, env=self.env)
            self.weights(body, spec.layer_weights, list(range(count)), self.sources)
            self.weights(body, k.weights, [i for i, s in enumerate(schedule) if s == name], self.sources)
            bscope = {}
            for c in carried:
                body.add_value(Value(c, "input", line=line))
                body.inputs.append(c)
                bscope[c] = c
            self.statements(body, k.graph if k.graph is not None else spec.layer_graph, bscope)
            self.drop_unread(body, [i for i, s in enumerate(schedule) if s == name])
            body.outputs = [bscope[c] for c in carried]
            for o, i in body.carried.items():
                if o == i:
                    raise self.err(f"the layer graph{'' if kind == 'layer' else ' of kind ' + repr(kind)} "
                                   f"never assigns carried value '{i}'", k.line if k.graph else line)
            bodies[name] = body
        self.env = top_env
        outs = [g.fresh(c) for c in carried]
        for o in outs:
            g.add_value(Value(o, "act", line=line))
        g.add_node(Node(g.new_node_id("layers"), "layers", [scope[c] for c in carried], outs,
                        {"count": count, "schedule": schedule}, line, bodies=bodies))
        return outs

    def drop_unread(self, body: Graph, layers: list[int]):
        """A layer weight this kind's graph never reads is not loaded for its layers (a shared
        weight one kind skips; the checkpoint check then flags such a tensor if it exists)."""
        read = {i for n in body.ordered() for i in n.inputs}
        for name in [v.name for v in body.values.values() if v.kind == "weight" and v.name not in read]:
            del body.values[name]
            src = self.sources[name]
            if src["layers"] is not None:
                src["layers"] = [i for i in src["layers"] if i not in layers]
                if not src["layers"]:
                    del self.sources[name]

    def schedule(self, count: int) -> list[str]:
        """The kind of each layer: `layer.kind` evaluated at i = 0..L-1 (one kind when absent)."""
        spec = self.spec
        if spec.layer_kind is None:
            return ["layer"] * count
        expr, line = spec.layer_kind
        out = []
        for i in range(count):
            try:
                kind = evaluate(expr, {**self.env, "i": i})
            except Unknown as u:
                raise self.err(f"layer kind: unknown symbol '{u.name}'{did_you_mean(u.name, self.env)}",
                               line) from None
            except EvalError as x:
                raise self.err(f"layer kind at layer {i}: {x}", line) from None
            if not isinstance(kind, str):       # `1`, `[...]`: kinds are named by strings
                raise self.err(f"layer {i}: the kind expression gives {kind!r}, not the name of a "
                               f"kind (a string; defined: {', '.join(spec.layer_kinds)})", line)
            if kind not in spec.layer_kinds:
                raise self.err(f"layer {i} has kind {kind!r}, which 'layer.kinds' does not define "
                               f"(defined: {', '.join(spec.layer_kinds)})", line)
            out.append(kind)
        return out

    def kind_env(self, env: dict, k: LayerKind, i: int | None = None) -> dict:
        """The config symbols as a kind's layers see them; i: the layer whose values a symbol that
        reads the layer index takes."""
        out = dict(env)
        at = env if i is None else {**env, "i": i}
        for sym, (e, line) in k.symbols.items():
            try:
                out[sym] = evaluate(e, at)
            except Unknown as u:
                raise self.err(f"layer kind '{k.name}': symbol {sym} uses unknown symbol '{u.name}'"
                               f"{did_you_mean(u.name, env)}", line) from None
            except EvalError as x:
                raise self.err(f"layer kind '{k.name}': symbol {sym}: {x}", line) from None
        return out


def lower(spec: Spec, env: dict, checkpoint_names=None) -> tuple[Graph, dict]:
    """Returns the top graph and the weight source table {name: {source, layers, type, line}}.
    checkpoint_names: the tensor names of the checkpoint the build reads (a weight's `or:` layouts
    choose by them), None without one."""
    lw = _Lowerer(spec, env)
    lw.stored = None if checkpoint_names is None else set(checkpoint_names)
    lw.sources = {}
    g = Graph("model")
    for name, t in STEP_INPUTS.items():
        g.add_value(Value(name, "input", t))
        g.inputs.append(name)
    if "L" not in env and (spec.layer_graph or spec.layer_kinds):
        raise spec.err("a spec with a 'layer' section must bind the layer count symbol L", 1)
    scope = {n: n for n in STEP_INPUTS}
    for name, (shape, line) in spec.step_inputs.items():
        g.add_value(Value(name, "input", TensorType(lw.shape(shape, line, f"input '{name}'"), ACT_DTYPE),
                          line=line))
        g.inputs.append(name)
        scope[name] = name
    lw.weights(g, spec.weights, None, lw.sources)
    lw.statements(g, spec.graph, scope)
    names = spec.outputs if spec.outputs is not None else list(spec.graph[-1].targets)
    missing = [n for n in names if n not in scope]
    if missing:
        raise spec.err(f"outputs: '{missing[0]}' is not a value the graph assigns"
                       f"{did_you_mean(missing[0], scope)}", spec.raw.key_lines.get("outputs", 1))
    if "logits" not in names:      # what the runtime samples from: a plan without it fails every request
        where = "'outputs' names" if spec.outputs is not None else "the graph's last statement assigns"
        raise spec.err(f"{where} {', '.join(names)}, not 'logits': the model's output must be "
                       f"assigned to 'logits' (e.g. 'logits = linear(...)')",
                       spec.raw.key_lines.get("outputs", 1) if spec.outputs is not None
                       else spec.graph[-1].line)
    g.outputs = [scope[t] for t in names]
    g.output_names = list(names)
    return g, lw.sources
