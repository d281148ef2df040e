"""Loading a spec file: structure checks with line numbers, and binding config symbols.

A spec is data: `Spec` holds its parsed pieces; `bind()` turns a config.json (or a named
variant's values) into the concrete symbol table the compiler lowers with.
"""
import ast
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import config_values, spec_paths
from .contract import json_file
from .contract.errors import SpecError, did_you_mean
from .expr import EvalError, Unknown, evaluate, parse_expr, parse_statement
from .yaml_lines import LDict, item_line, line_of, load_yaml

SPECS_DIR = spec_paths.SPECS_DIR

TOP_KEYS = {"family", "architectures", "config", "requires", "variants", "weights", "layer",
            "graph", "description", "ignore", "nested_config", "inputs", "outputs", "mtp"}
# `mtp:` a model's multi-token-prediction layer, shipped in its checkpoint and run by speculation
# only (--speculative-config method mtp): a plan of its own compiled from the same config.json
# (Spec.mtp_section); its keys replace the family's graph, weights, inputs and outputs.
MTP_KEYS = {"config", "requires", "count", "layer", "inputs", "weights", "graph", "outputs",
            "target_ignore"}
WEIGHT_KEYS = {"name", "shape", "tied_to", "when", "experts", "dtype", "or",
               "stored_shape", "rows", "groups", "cols", "heads", "transpose", "exp", "scale", "offset"}
# Load-time transforms, applied in this order to the checkpoint tensor: a reshape (stored_shape:
# the checkpoint's shape, whose trailing dims are flattened to the declared rank, e.g. a depthwise
# conv weight [C, 1, K] read as [C, K]), a row slice (with `groups: G`, the rows are G equal
# groups, e.g. one per head, and the slice is taken in each: a per-head interleaved projection),
# a column slice (fused qkv_proj / gate_up_proj checkpoints), `heads: G` (the 2-D [G*n, K] result
# read as G per-head matrices [G, n, K]: a 3-D declared shape), a transpose (of each head's matrix
# when `heads` is given: [G, K, n]; DeepSeek MLA's W_uk / W_uv from kv_b_proj), then exp(w) (exp:
# true), w * scale, w + offset.
TRANSFORM_KEYS = ("stored_shape", "rows", "groups", "cols", "heads", "transpose", "exp", "scale", "offset")
# `or:` another checkpoint layout of the same weight (a mapping, or a list of them, each a `name`
# and its own transforms; shape, experts, dtype and when are the weight's): the build reads the
# first layout whose every tensor the checkpoint holds, the declared one first (without a
# checkpoint, the declared one). E.g. per-expert `experts.{e}.gate_proj.weight` or transformers 5's
# fused `experts.gate_up_proj` [E, 2F, H] (`rows: [0, F]`).
ALTERNATIVE_KEYS = {"name", *TRANSFORM_KEYS}
LAYER_KEYS = {"weights", "graph", "kind", "kinds"}
KIND_KEYS = {"symbols", "weights", "graph"}
WEIGHT_DTYPES = {"bf16", "f16", "f32", "i32"}      # i32: an index table (ops/moe_table.py)
# Names the compiler binds itself: the step's token count and sequence count.
DYNAMIC_SYMBOLS = ("T", "B")



def _values_in(node, env: dict) -> str:
    """' (L = 30, act = "gelu")': the values a failed requirement read, so its message says
    which of the checkpoint's settings the family does not take."""
    names = sorted({n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in env})
    vals = ", ".join(f"{n} = {env[n]!r}" for n in names if not callable(env[n]))
    return f" ({vals})" if vals else ""

@dataclass
class Binding:
    symbol: str
    keys: list[str]          # alternatives, each a dotted path into config.json; [] = derived
    default: object | None   # ast of the default (of the value, when derived), or None
    line: int
    # keys written `key?`: a null there is the value none (HF's "None: off", as a
    # sliding_window of null), not an absent key that takes the default
    null_is_value: frozenset = frozenset()


@dataclass
class WeightDecl:
    key: str                 # the spec's own name (wq, embed, ...)
    name: str                # HF tensor name pattern, {i} layer, {e} expert
    shape: list              # asts
    line: int
    tied_to: str | None = None
    when: str | None = None
    experts: str | None = None
    dtype: str | None = None
    transforms: dict = field(default_factory=dict)   # TRANSFORM_KEYS -> ast | [ast, ast] | bool
    alternatives: list = field(default_factory=list)  # `or:` other layouts (WeightDecl each)


@dataclass
class Statement:
    targets: list[str]
    expr: object             # ast.expr
    text: str
    line: int


@dataclass
class LayerKind:
    """One kind of layer: its config symbol overrides, extra weights, and graph (None: the
    shared layer graph)."""
    name: str
    symbols: dict            # symbol -> (ast, line)
    weights: dict
    graph: list | None
    line: int


@dataclass
class Spec:
    path: str
    family: str
    architectures: list[str]
    bindings: dict[str, Binding]
    requires: list[tuple[object, str, int]]
    variants: dict[str, dict]
    weights: dict[str, WeightDecl]
    layer_weights: dict[str, WeightDecl]
    layer_graph: list[Statement]
    graph: list[Statement]
    raw: dict = field(repr=False, default_factory=dict)
    layer_kind: tuple | None = None                   # (ast over config symbols and i, line)
    layer_kinds: dict = field(default_factory=dict)   # kind name -> LayerKind
    # Glob patterns (fnmatch) of checkpoint tensors the spec deliberately does not use: any
    # other tensor no weight reads fails the build (compiler/checkpoint_check.py).
    ignore: list = field(default_factory=list)
    # config.json objects a key absent at its top is looked up in next, in order (`nested_config:
    # [text_config]`): a multimodal wrapper's text model, as HF's get_text_config() finds it.
    nested: list = field(default_factory=list)
    # `inputs: {name: [T, dims...]}`: per-token activations the step feeds besides `tokens` (an
    # EAGLE-3 head's target hidden states); `outputs: [names]`: the plan's outputs, by default the
    # last statement's targets. name -> (shape asts, line); [] / None when absent.
    step_inputs: dict = field(default_factory=dict)
    outputs: list | None = None
    # `mtp.target_ignore`: the MTP layer's checkpoint tensors (their names over the family's
    # symbols), which the family's own plan leaves unread (compiler/checkpoint_check.py)
    mtp_ignore: list = field(default_factory=list)
    # the section this spec was made from ("mtp": Spec.mtp_section), None for the family's model
    section: str | None = None
    mtp_count: tuple | None = None         # (symbol, line): the MTP layers config.json declares

    def err(self, msg, line=None) -> SpecError:
        return SpecError(msg, self.path, line)

    def bind(self, config: dict, source: str | None = None) -> dict:
        """Resolve every config symbol from a config.json dict; check each value
        (compiler/config_values.py) and `requires`. source: the config.json's path (errors point
        at its lines) or a description of where config came from."""
        env: dict = {}
        where = f" in {source}" if source else ""
        sizes = config_values.size_symbols(self)
        for sym, b in self.bindings.items():
            value, found = None, False
            # a derived symbol has no keys: its default is its value
            for key in config_values.lookup_keys(b.keys, self.nested):
                ok, cur = config_at(config, key)
                if ok and (cur is not None or b.default is None or _null_kept(b, key)):
                    value, found = cur, True
                    self._check_config_value(sym, b, key, value, sym in sizes, source)
                    break
            if not found:
                if b.default is None:
                    also = f" (nor under {', '.join(self.nested)})" if self.nested else ""
                    raise self.err(f"config key '{b.keys[0]}' (symbol {sym}) is missing{where}{also}", b.line)
                what = "value" if not b.keys else "default"
                try:
                    value = evaluate(b.default, env)
                except Unknown as e:
                    raise self.err(f"{what} of {sym} uses unknown symbol '{e.name}'"
                                   f"{did_you_mean(e.name, env)}", b.line) from None
                except EvalError as e:
                    raise self.err(f"{what} of {sym}: {e}", b.line) from None
                problem = config_values.size_problem(value, sym) if sym in sizes else None
                if problem:
                    raise self.err(f"{what} of {sym} ('{ast.unparse(b.default)}'{where}) is a size "
                                   f"and must be a positive integer: {problem}", b.line)
            env[sym] = value
        if self.section == "mtp":              # before requires: the first thing to say
            sym, line = self.mtp_count
            n = env.get(sym)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                key = self.bindings[sym].keys[0] if self.bindings[sym].keys else sym
                raise self.err(f"this checkpoint has no MTP layer: {key} is {n!r}{where} (a model "
                               f"published without its multi-token-prediction weights cannot "
                               f"speculate with method 'mtp')", line)
        for node, text, line in self.requires:
            try:
                ok = evaluate(node, env)
            except Unknown as e:
                raise self.err(f"requirement '{text}' uses unknown symbol '{e.name}'"
                               f"{did_you_mean(e.name, env)}", line) from None
            except EvalError as e:
                raise self.err(f"requirement '{text}' cannot be evaluated: {e.reason}", line) from None
            if ok is not None and not isinstance(ok, bool):
                # `- act` for `- act == "silu"`: a value is no condition (a null one, an absent
                # optional flag, does not hold)
                raise self.err(f"requirement '{text}' is {config_values.shown(ok)}{where}, not true "
                               f"or false: write a condition", line)
            if not ok:
                raise self.err(f"unsupported configuration{where}: requirement '{text}' does not hold"
                               f"{_values_in(node, env)}", line)
        if self.section == "mtp":
            env["L"] = 1                       # the MTP layer is the section's one layer
        return env

    def mtp_section(self) -> "Spec":
        """The family's MTP layer as a spec of its own (`mtp:`): the family's config symbols and
        requirements plus the section's (its symbols are bound with L the model's layer count;
        L is then 1), the family's layer kinds with their checkpoint names moved by
        `layer.names: [from, to]` and the one kind `layer.kind` names, and the section's inputs,
        weights, graph and outputs."""
        doc, file = self.raw, self.path
        m = doc.get("mtp")
        if m is None:
            raise self.err(f"family '{self.family}' declares no MTP layer (its spec has no 'mtp:' "
                           f"section): speculative method 'mtp' needs one", 1)
        line = doc.key_lines.get("mtp")
        if not isinstance(m, dict):
            raise self.err("'mtp' must be a mapping with config, count, layer, weights, graph", line)
        for key in m:
            if key not in MTP_KEYS:
                raise self.err(f"unknown key '{key}' in 'mtp'{did_you_mean(key, MTP_KEYS)} "
                               f"(expected {', '.join(sorted(MTP_KEYS))})", m.key_lines.get(key))
        cfg = m.get("config") or {}
        if not isinstance(cfg, dict):
            raise self.err("'mtp.config' must map symbols to config.json keys", m.key_lines.get("config"))
        bindings = dict(self.bindings)
        for sym, v in cfg.items():
            bindings.pop(sym, None)
            _check_symbol_name(sym, file, cfg.key_lines.get(sym))
            bindings[sym] = _binding(sym, v, file, cfg.key_lines.get(sym))
        requires = list(self.requires) + _requires(m, file, "mtp.requires")
        count = m.get("count")
        if not isinstance(count, str) or count not in bindings:
            raise self.err("'mtp.count' must name the config symbol of the MTP layers the checkpoint "
                           "ships (e.g. n_mtp: num_nextn_predict_layers), bound in mtp.config",
                           m.key_lines.get("count", line))
        layer = _require(m, "layer", dict, file, line)
        kline = layer.key_lines.get("kind", layer.line)
        kind = (parse_expr(str(_require(layer, "kind", str, file, layer.line)), file, kline), kline)
        names = layer.get("names")
        if (not isinstance(names, list) or len(names) != 2
                or not all(isinstance(n, str) and n for n in names)):
            raise self.err("'mtp.layer.names' must be [from, to]: the family's layer weight name "
                           "prefix and the MTP layer's, like ['{prefix}layers.{i}.', "
                           "'{prefix}layers.{at}.']", layer.key_lines.get("names", layer.line))
        old, new = names

        def moved(ws: dict) -> dict:
            return {k: replace(w, name=w.name.replace(old, new),
                               alternatives=[replace(a, name=a.name.replace(old, new))
                                             for a in w.alternatives])
                    for k, w in ws.items()}
        kinds = {n: replace(k, weights=moved(k.weights)) for n, k in self.layer_kinds.items()}
        return Spec(file, self.family, list(self.architectures), bindings, requires, dict(self.variants),
                    _weights(_require(m, "weights", dict, file, line), file, "mtp.weights"),
                    moved(self.layer_weights), list(self.layer_graph),
                    _statements(_require(m, "graph", list, file, line), file, "mtp.graph"), doc,
                    kind, kinds, [], list(self.nested), _step_inputs(m, file), _outputs(m, file),
                    section="mtp", mtp_count=(count, m.key_lines.get("count", line)))

    def _check_config_value(self, sym, b, key, value, is_size, source):
        """A value read from config.json (or a variant) for symbol sym, by the rules of
        compiler/config_values.py: the error names the file and the key (its line there)."""
        bad = config_values.non_finite(value)
        size = config_values.size_problem(value, sym) if is_size else None
        length = config_values.max_len_problem(value) if sym == config_values.MAX_LEN else None
        if bad is not None:
            problem = f"{'is' if not bad[0] else f'holds at {bad[0]}'} {bad[1]}: not a finite number"
        elif size:
            problem = f"must be a positive integer (symbol {sym} is a size): {size}"
        elif length:
            problem = f"must not be negative (symbol {sym}, the context length): {length}"
        else:
            kinds = config_values.expected_kinds(self, b)
            kind = config_values.kind_of(value)
            if not kinds or kind is None or kind in kinds:
                return
            problem = f"must be {' or '.join(sorted(kinds))} (symbol {sym}), got {config_values.shown(value)}"
        msg = f"config key '{key}' {problem}"
        if source and source.endswith(".json") and Path(source).is_file():
            raise SpecError(msg, source, json_file.json_key_line(Path(source), key.split(".")[-1]))
        raise self.err(f"{msg}{f' (in {source})' if source else ''}", self.raw.key_lines.get("variants")
                       if isinstance(self.raw, LDict) else None)


def config_at(config: dict, key: str) -> tuple[bool, object]:
    """(found, value) of a dotted key in a config.json dict."""
    cur = config
    for part in key.split("."):
        if not (isinstance(cur, dict) and part in cur):
            return False, None
        cur = cur[part]
    return True, cur


_NAME_FIELD = re.compile(r"\{(\w+)\}")


def weight_name(pattern: str, env: dict, file: str | None = None, line: int | None = None) -> str:
    """A weight's checkpoint name with its config fields filled in: `{prefix}layers.{i}.mlp...`
    reads string/integer symbol `prefix` (one spec for checkpoints that nest the same weights
    under different prefixes); {i} (layer) and {e} (expert) stay for the loaders."""
    def fill(m):
        sym = m.group(1)
        if sym in ("i", "e"):
            return m.group(0)
        if sym not in env:
            raise SpecError(f"weight name '{pattern}' uses unknown symbol '{sym}'"
                            f"{did_you_mean(sym, env)}", file, line)
        v = env[sym]
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise SpecError(f"weight name '{pattern}': symbol '{sym}' is {v!r}, not a string or "
                            f"integer", file, line)
        return str(v)
    return _NAME_FIELD.sub(fill, pattern)


def _require(d, key, kind, file, line):
    if key not in d:
        raise SpecError(f"missing required key '{key}'", file, line)
    v = d[key]
    if not isinstance(v, kind):
        raise SpecError(f"'{key}' must be a {kind.__name__ if isinstance(kind, type) else 'mapping'}",
                        file, line_of(v, line))
    return v


def _weights(section, file, where) -> dict[str, WeightDecl]:
    if not isinstance(section, dict):
        raise SpecError(f"'{where}' must be a mapping of weight name -> {{name, shape}}", file,
                        line_of(section))
    out = {}
    for key, decl in section.items():
        line = section.key_lines.get(key) if isinstance(section, LDict) else None
        if not isinstance(decl, dict):
            raise SpecError(f"weight '{key}' must be a mapping with 'name' and 'shape'", file, line)
        fields = decl.key_lines if isinstance(decl, LDict) else {}
        unknown = set(decl) - WEIGHT_KEYS
        if unknown:
            first = sorted(unknown)[0]
            raise SpecError(f"weight '{key}' has unknown field(s) {sorted(unknown)}"
                            f"{did_you_mean(first, WEIGHT_KEYS)}", file, fields.get(first, line))
        if "name" not in decl:
            raise SpecError(f"weight '{key}' has no 'name'", file, line)
        _check_name_field(key, decl, fields, line, file)
        if "shape" not in decl or not isinstance(decl["shape"], list) or not decl["shape"]:
            raise SpecError(f"weight '{key}' needs a 'shape' list", file, line)
        for f, what in (("tied_to", "another weight"), ("when", "a config symbol"),
                        ("experts", "the config symbol of the expert count"), ("dtype", "a dtype")):
            v = decl.get(f)
            if v is not None and not isinstance(v, str):   # a list/number would be looked up as a name
                raise SpecError(f"weight '{key}': '{f}' must name {what}, got {v!r}", file,
                                fields.get(f, line))
        dtype = decl.get("dtype")
        if dtype is not None and dtype not in WEIGHT_DTYPES:
            raise SpecError(f"weight '{key}' has unknown dtype '{dtype}' (one of {sorted(WEIGHT_DTYPES)})",
                            file, fields.get("dtype", line))
        shape = [parse_expr(str(s), file, line) for s in decl["shape"]]
        transforms = _transforms(key, decl, fields, line, file)
        alternatives = []
        alts = decl.get("or")
        if alts is not None:
            aline = fields.get("or", line)
            alts = [alts] if isinstance(alts, dict) else alts
            if not isinstance(alts, list) or not alts or not all(isinstance(a, dict) for a in alts):
                raise SpecError(f"weight '{key}': 'or' must be another layout ({{name, transforms}}) "
                                f"or a list of them, got {decl['or']!r}", file, aline)
            for a in alts:
                afields = a.key_lines if isinstance(a, LDict) else {}
                bad = set(a) - ALTERNATIVE_KEYS
                if bad:
                    first = sorted(bad)[0]
                    raise SpecError(f"weight '{key}': its 'or' layout has unknown field(s) {sorted(bad)}"
                                    f"{did_you_mean(first, ALTERNATIVE_KEYS)} (a layout gives 'name' and "
                                    f"its transforms; shape, experts, dtype and when are the weight's)",
                                    file, afields.get(first, aline))
                if "name" not in a:
                    raise SpecError(f"weight '{key}': its 'or' layout has no 'name'", file, aline)
                _check_name_field(key, a, afields, aline, file)
                alternatives.append(WeightDecl(key, str(a["name"]), shape, afields.get("name", aline),
                                               None, decl.get("when"), decl.get("experts"), dtype,
                                               _transforms(key, a, afields, aline, file)))
        out[key] = WeightDecl(key, str(decl["name"]), shape, line, decl.get("tied_to"),
                              decl.get("when"), decl.get("experts"), dtype, transforms, alternatives)
    return out


def _check_name_field(key, decl, fields, line, file):
    """A weight's (or layout's) `name` is the checkpoint tensor's name: a non-empty string (a
    number or null would become the name '5' / 'None', found missing only with a checkpoint)."""
    v = decl["name"]
    if not isinstance(v, str) or not v.strip():
        raise SpecError(f"weight '{key}': 'name' must be the checkpoint tensor's name (a non-empty "
                        f"string), got {v!r}", file, fields.get("name", line))


def _transforms(key, decl, fields, line, file) -> dict:
    """A weight's (or one of its layouts') load-time transforms, parsed."""
    transforms = {}
    for t in TRANSFORM_KEYS:
        if t not in decl:
            continue
        tline = fields.get(t, line)
        v = decl[t]
        if t == "stored_shape":
            if not isinstance(v, list) or not v:
                raise SpecError(f"weight '{key}': 'stored_shape' must be the checkpoint tensor's "
                                f"shape, a list like [C, 1, K], got {v!r}", file, tline)
            transforms[t] = [parse_expr(str(x), file, tline) for x in v]
        elif t == "groups" and "rows" not in decl:
            raise SpecError(f"weight '{key}': 'groups' divides the rows that 'rows' slices; "
                            f"give 'rows' too", file, tline)
        elif t in ("rows", "cols"):
            if not isinstance(v, list) or len(v) not in (2, 3):
                raise SpecError(f"weight '{key}': '{t}' must be [start, stop] or [start, stop, "
                                f"step] (a slice of the checkpoint tensor's "
                                f"{'first' if t == 'rows' else 'second'} axis), got {v!r}",
                                file, tline)
            transforms[t] = [parse_expr(str(x), file, tline) for x in v]
        elif t in ("transpose", "exp"):
            if not isinstance(v, bool):
                raise SpecError(f"weight '{key}': '{t}' must be true or false, got {v!r}",
                                file, tline)
            transforms[t] = v
        else:
            transforms[t] = parse_expr(str(v), file, tline)
    return transforms


def _statements(section, file, where) -> list[Statement]:
    if not isinstance(section, list) or not section:
        raise SpecError(f"'{where}' must be a non-empty list of statements", file, line_of(section))
    out = []
    for k, item in enumerate(section):
        line = item_line(section, k, line_of(section))
        if not isinstance(item, str):
            raise SpecError(f"statement in '{where}' must be a string 'name = op(...)'", file, line)
        targets, expr = parse_statement(item, file, line)
        out.append(Statement(targets, expr, str(item), line))
    return out


# Names the expression language gives a meaning of its own: a config symbol named so would change
# every expression that says `none`, `true`, ... (symbols are looked up first), or be shadowed by
# the layer index i (layer.kind, a kind's symbols) and the expert index e (weight names' {e}).
RESERVED_NAMES = {"none": "a constant", "None": "a constant", "true": "a constant",
                  "True": "a constant", "false": "a constant", "False": "a constant",
                  "i": "the layer index", "e": "the expert index"}


def _check_symbol_name(sym, file, line):
    """A config symbol is an identifier the expression language does not already give a meaning."""
    if not isinstance(sym, str) or not re.fullmatch(r"[A-Za-z_]\w*", sym):
        raise SpecError(f"symbol {sym!r} must be an identifier (letters, digits, _), as the "
                        f"expressions that use it are written", file, line)
    if sym in RESERVED_NAMES:
        raise SpecError(f"symbol '{sym}' is reserved ({RESERVED_NAMES[sym]} in spec expressions)",
                        file, line)


def _requires(parent, file, where) -> list:
    """The `requires` list of a mapping (the spec's, or its mtp section's; `where` names it):
    each entry a condition written as an expression string (a YAML `true` is one too). A number,
    list or empty entry is a mistake, not a condition that holds."""
    section = parent.get("requires", []) or []
    if not isinstance(section, list):
        raise SpecError(f"'{where}' must be a list of conditions like '- act == \"silu\"'", file,
                        parent.key_lines.get("requires"))
    out = []
    for k, r in enumerate(section):
        line = item_line(section, k)
        if isinstance(r, bool):
            r = "true" if r else "false"
        if not isinstance(r, str) or not r.strip():
            raise SpecError(f"'{where}' entry {k + 1} must be a condition like 'act == \"silu\"', "
                            f"got {r!r}", file, line)
        out.append((parse_expr(r, file, line), str(r), line))
    return out


def _binding(sym, text, file, line) -> Binding:
    if not isinstance(text, str):
        raise SpecError(f"symbol '{sym}' must name a config.json key, as in "
                        f"'{sym}: key [| other.key] [= default]', got {text!r}", file, line)
    text = str(text)
    default = None
    cut = _assign_at(text)
    if cut is not None:
        text, dflt = text[:cut], text[cut + 1:]
        if not dflt.strip():
            raise SpecError(f"symbol '{sym}': nothing after '='", file, line)
        default = parse_expr(dflt, file, line)
    written = [k.strip() for k in text.split("|") if k.strip()]
    if not written and default is None:
        raise SpecError(f"symbol '{sym}' names no config key (write '{sym}: key' or a derived "
                        f"'{sym}: = expression')", file, line)
    keys = [k.removesuffix("?").strip() for k in written]
    if not all(keys):
        raise SpecError(f"symbol '{sym}': '?' follows a config key ('{sym}: key? = default')", file, line)
    kept = frozenset(k for k, w in zip(keys, written) if w.endswith("?"))
    return Binding(sym, keys, default, line, kept)


def _null_kept(b: Binding, key: str) -> bool:
    """Whether a null at `key` (one of b's keys, or it under a nested object) is b's value."""
    return any(key == k or key.endswith("." + k) for k in b.null_is_value)


def _assign_at(text: str) -> int | None:
    """Index of the '=' that starts a default, skipping ==, <=, >=, != inside expressions."""
    for i, ch in enumerate(text):
        if ch != "=":
            continue
        prev = text[i - 1] if i else ""
        nxt = text[i + 1] if i + 1 < len(text) else ""
        if nxt == "=" or (prev and prev in "=<>!"):
            continue
        return i
    return None


def load_spec(path: str | Path) -> Spec:
    path = Path(path)
    file = str(path)
    if path.exists() and not path.is_file():    # a FIFO would block the read forever
        raise SpecError("cannot read spec: not a regular file", file)
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(f"cannot read spec: {e.strerror}", file) from None
    except UnicodeDecodeError as e:       # a binary file, or another encoding: YAML is UTF-8
        raise SpecError(f"cannot read spec: not UTF-8 text (byte {e.start}: {e.reason})", file) from None
    doc = load_yaml(text, file)
    if not isinstance(doc, dict):
        raise SpecError("a spec is a YAML mapping with family, config, weights, layer, graph", file, 1)
    for key in doc:
        if key not in TOP_KEYS:
            raise SpecError(f"unknown top-level key '{key}'{did_you_mean(key, TOP_KEYS)} "
                            f"(expected one of {sorted(TOP_KEYS)})", file, doc.key_lines.get(key))
    family = _require(doc, "family", str, file, 1)
    archs = doc.get("architectures", [])
    if not isinstance(archs, list) or not all(isinstance(a, str) and a for a in archs):
        raise SpecError(f"'architectures' must be a list of class names like [Qwen3ForCausalLM], "
                        f"got {archs!r}", file, doc.key_lines.get("architectures"))
    cfg = _require(doc, "config", dict, file, 1)
    bindings = {sym: _binding(sym, v, file, cfg.key_lines.get(sym)) for sym, v in cfg.items()}
    for sym in DYNAMIC_SYMBOLS:
        if sym in bindings:
            raise SpecError(f"symbol '{sym}' is reserved (tokens/sequences in a step)", file,
                            cfg.key_lines.get(sym))
    for sym in bindings:
        _check_symbol_name(sym, file, cfg.key_lines.get(sym))
    requires = _requires(doc, file, "requires")
    variants = doc.get("variants", {}) or {}
    if not isinstance(variants, dict):
        raise SpecError("'variants' must map a variant name to its config.json values", file,
                        line_of(variants, doc.key_lines.get("variants")))
    for v, values in variants.items():
        if not isinstance(values, dict):
            raise SpecError(f"variant '{v}' must be a mapping of config.json keys to values, "
                            f"got {values!r}", file, variants.key_lines.get(v))
    weights = _weights(_require(doc, "weights", dict, file, 1), file, "weights")
    layer = doc.get("layer")
    layer_weights, layer_graph, layer_kind, layer_kinds = {}, [], None, {}
    if layer is not None:
        if not isinstance(layer, dict):
            raise SpecError("'layer' must be a mapping with 'weights' and 'graph'", file, line_of(layer))
        for key in layer:
            if key not in LAYER_KEYS:
                raise SpecError(f"unknown key '{key}' in 'layer'{did_you_mean(key, LAYER_KEYS)} "
                                f"(expected {', '.join(sorted(LAYER_KEYS))})", file, layer.key_lines.get(key))
        layer_kind, layer_kinds = _kinds(layer, file)
        if "weights" in layer or not layer_kinds:
            layer_weights = _weights(_require(layer, "weights", dict, file, layer.line), file,
                                     "layer.weights")
        if "graph" in layer or not layer_kinds:
            layer_graph = _statements(_require(layer, "graph", list, file, layer.line), file, "layer.graph")
        for k in layer_kinds.values():
            if k.graph is None and not layer_graph:
                raise SpecError(f"layer kind '{k.name}' has no graph and 'layer' has no shared graph",
                                file, k.line)
    all_layer = dict(layer_weights)
    for k in layer_kinds.values():
        for name, w in k.weights.items():
            if name in layer_weights:
                raise SpecError(f"weight '{name}' of layer kind '{k.name}' is also a shared layer "
                                f"weight (declare it once: under layer.weights, or per kind)", file, w.line)
            all_layer.setdefault(name, w)   # several kinds may declare it; lowering checks they agree
    dup = set(weights) & set(all_layer)
    if dup:
        name = sorted(dup)[0]
        raise SpecError(f"duplicate weight name '{name}' in weights and layer.weights", file,
                        all_layer[name].line)
    graph = _statements(_require(doc, "graph", list, file, 1), file, "graph")
    return Spec(file, str(family), [str(a) for a in archs], bindings, requires, dict(variants),
                weights, layer_weights, layer_graph, graph, doc, layer_kind, layer_kinds,
                _ignore(doc, file), _nested(doc, file), _step_inputs(doc, file), _outputs(doc, file),
                _mtp_ignore(doc, file))


def _mtp_ignore(doc, file) -> list[str]:
    """`mtp.target_ignore`: checked as `ignore` is."""
    m = doc.get("mtp")
    if not isinstance(m, dict) or "target_ignore" not in m:
        return []
    return _ignore(_Keyed({"ignore": m["target_ignore"]}, {"ignore": m.key_lines.get("target_ignore")}), file)


class _Keyed(dict):
    """A mapping with the yaml loader's key_lines, for a section's key checked out of its place."""
    def __init__(self, d, lines):
        super().__init__(d)
        self.key_lines = lines


def _step_inputs(doc, file) -> dict:
    """`inputs: {aux: [T, 3*H]}`: extra per-token step inputs (their first dimension is T)."""
    if "inputs" not in doc:
        return {}
    section, line = doc["inputs"], doc.key_lines.get("inputs")
    if not isinstance(section, dict) or not section:
        raise SpecError(f"'inputs' must be a mapping of input name -> shape, like {{aux: [T, 3*H]}}, "
                        f"got {section!r}", file, line)
    out = {}
    for name, shape in section.items():
        at = section.key_lines.get(name, line) if hasattr(section, "key_lines") else line
        if not re.fullmatch(r"[A-Za-z_]\w*", str(name)) or name == "tokens":
            raise SpecError(f"input name {name!r} must be an identifier other than 'tokens'", file, at)
        if not isinstance(shape, list) or len(shape) < 2 or str(shape[0]) != "T":
            raise SpecError(f"input '{name}': its shape must be a list starting with T (one row a "
                            f"token), like [T, H], got {shape!r}", file, at)
        out[str(name)] = ([parse_expr(str(d), file, at) for d in shape], at)
    return out


def _outputs(doc, file) -> list | None:
    """`outputs: [logits, hidden]`: the plan's outputs (values the graph assigns)."""
    if "outputs" not in doc:
        return None
    section, line = doc["outputs"], doc.key_lines.get("outputs")
    if not isinstance(section, list) or not section or not all(
            isinstance(n, str) and re.fullmatch(r"[A-Za-z_]\w*", n) for n in section):
        raise SpecError(f"'outputs' must be a list of value names the graph assigns, like "
                        f"[logits, hidden], got {section!r}", file, line)
    return [str(n) for n in section]


def _nested(doc, file) -> list[str]:
    """`nested_config: [text_config]`: config.json objects a key missing at the top is read from."""
    if "nested_config" not in doc:
        return []
    section, line = doc["nested_config"], doc.key_lines.get("nested_config")
    if (not isinstance(section, list) or not section
            or not all(isinstance(n, str) and re.fullmatch(r"\w+", n) for n in section)):
        raise SpecError(f"'nested_config' must be a list of config.json object names, like "
                        f"[text_config], got {section!r}", file, line_of(section, line))
    return [str(n) for n in section]


def _ignore(doc, file) -> list[str]:
    """`ignore: [glob, ...]`: checkpoint tensors no weight reads, on purpose."""
    if "ignore" not in doc:
        return []
    section, line = doc["ignore"], doc.key_lines.get("ignore")
    if not isinstance(section, list):
        raise SpecError(f"'ignore' must be a list of glob patterns of checkpoint tensor names, "
                        f"like ['model.layers.*.self_attn.rotary_emb.inv_freq'], got {section!r}",
                        file, line_of(section, line))
    for p in section:
        if not isinstance(p, str) or not p.strip():
            raise SpecError(f"'ignore' entries must be non-empty glob patterns (strings), got {p!r}",
                            file, line_of(p, line_of(section, line)))
    return [str(p) for p in section]


def _kinds(layer, file) -> tuple:
    """`kind: expr` (a kind name per layer index i) and `kinds: {name: {symbols, weights, graph}}`."""
    has_kind, has_kinds = "kind" in layer, "kinds" in layer
    if has_kind != has_kinds:
        missing = "kinds" if has_kind else "kind"
        raise SpecError(f"'layer' has '{'kind' if has_kind else 'kinds'}' but no '{missing}': "
                        f"'kind' is an expression over config symbols and the layer index i that "
                        f"names one of 'kinds'", file, layer.key_lines.get("kind" if has_kind else "kinds"))
    if not has_kind:
        return None, {}
    kline = layer.key_lines.get("kind")
    kind = (parse_expr(str(layer["kind"]), file, kline), kline)
    section = layer["kinds"]
    if not isinstance(section, dict) or not section:
        raise SpecError("'layer.kinds' must map each kind name to {symbols, weights, graph}", file,
                        layer.key_lines.get("kinds"))
    out = {}
    for name, body in section.items():
        line = section.key_lines.get(name)
        body = body if body is not None else LDict()
        if not isinstance(body, dict):
            raise SpecError(f"layer kind '{name}' must be a mapping with symbols, weights, graph "
                            f"(any of them)", file, line)
        for key in body:
            if key not in KIND_KEYS:
                raise SpecError(f"unknown key '{key}' in layer kind '{name}'"
                                f"{did_you_mean(key, KIND_KEYS)} (expected {', '.join(sorted(KIND_KEYS))})",
                                file, body.key_lines.get(key, line))
        symbols = {}
        syms = body.get("symbols", {}) or {}
        if not isinstance(syms, dict):
            raise SpecError(f"layer kind '{name}': 'symbols' must map a config symbol to an "
                            f"expression", file, line_of(syms, line))
        for sym, text in syms.items():
            sline = syms.key_lines.get(sym, line)
            symbols[sym] = (parse_expr(str(text), file, sline), sline)
        weights = _weights(body["weights"], file, f"layer.kinds.{name}.weights") if "weights" in body else {}
        graph = _statements(body["graph"], file, f"layer.kinds.{name}.graph") if "graph" in body else None
        out[str(name)] = LayerKind(str(name), symbols, weights, graph, line)
    return kind, out


def spec_files(spec_dirs=None) -> list[Path]:
    """Spec files on the search path: --spec-dir dirs, $INFC_SPEC_PATH, then specs/."""
    return spec_paths.spec_files(spec_dirs)


def _first_claim(spec_dirs, claims, what: str) -> tuple[Spec | None, list]:
    """The first spec along the search path that `claims(spec)`, and every spec's claims list
    seen on the way (for the error that names the known ones). A user's directory is read whole
    once it has a match: two of its specs claiming the same thing are ambiguous (which one wins
    would be the files' sort order), while across directories the earlier one wins, as
    documented. specs/ claims each name once (tests/test_inputs_malformed_more.py checks it), so
    its search stops at the match: no build pays for loading every built-in spec."""
    known, found = [], None
    for d in spec_paths.search_path(spec_dirs):
        builtin = d.resolve() == SPECS_DIR.resolve()
        for f in sorted(d.glob("*.yaml")):
            if found is not None and builtin:
                break
            spec = load_spec(f)
            hit = claims(spec)
            if hit and found is not None:
                raise SpecError(f"{what} {hit} is claimed by two specs in {d}: {Path(found.path).name} "
                                f"and {f.name}; remove or rename one", spec.path,
                                spec.raw.key_lines.get("architectures" if what == "architecture" else "variants"))
            if hit:
                found = spec
            known.append(spec)
        if found is not None:
            return found, known
    return None, known


def find_variant(name: str, spec_dirs=None) -> tuple[Spec, dict]:
    """The spec and config values of a named variant, searched along the spec path."""
    spec, seen = _first_claim(spec_dirs, lambda s: repr(name) if name in s.variants else None, "variant")
    if spec is not None:
        return spec, dict(spec.variants[name])
    known = [v for s in seen for v in s.variants]
    raise SpecError(f"unknown variant '{name}'{did_you_mean(name, known)} "
                    f"(known: {', '.join(sorted(known))}; searched {spec_paths.describe(spec_dirs)}); "
                    f"for a model of your own, {spec_paths.HOW_TO_POINT}", "specs/")


def find_architecture(architectures: list[str], spec_dirs=None, where: str = "config.json",
                      line: int | None = None) -> Spec:
    """The spec whose `architectures` names one of a config.json's architectures (the first
    on the search path). `where`/`line` locate the config.json for the error."""
    def claims(s):
        both = [a for a in s.architectures if a in (architectures or [])]
        return repr(both[0]) if both else None
    spec, seen = _first_claim(spec_dirs, claims, "architecture")
    if spec is not None:
        return spec
    known = [a for s in seen for a in s.architectures]
    what = (f"no spec implements architectures {list(architectures)}" if architectures
            else "names no 'architectures' to pick a spec by")
    raise SpecError(f"{what}; known architectures: "
                    f"{', '.join(sorted(set(known))) or 'none'} (searched {spec_paths.describe(spec_dirs)}). "
                    f"To run this model, {spec_paths.HOW_TO_POINT}", where, line)


def all_variants() -> list[str]:
    """The built-in specs' variants (the committed generated/ artifacts), not the user's."""
    return sorted(v for f in sorted(SPECS_DIR.glob("*.yaml")) for v in load_spec(f).variants)
