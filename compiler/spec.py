"""Loading a spec file: structure checks with line numbers, and binding config symbols.

A spec is data: `Spec` holds its parsed pieces; `bind()` turns a config.json (or a named
variant's values) into the concrete symbol table the compiler lowers with.
"""
from dataclasses import dataclass, field
from pathlib import Path

from .errors import SpecError, did_you_mean
from .expr import EvalError, Unknown, evaluate, parse_expr, parse_statement
from .yaml_lines import LDict, line_of, load_yaml

SPECS_DIR = Path(__file__).resolve().parent.parent / "specs"

TOP_KEYS = {"family", "architectures", "config", "requires", "variants", "weights", "layer",
            "graph", "description"}
WEIGHT_KEYS = {"name", "shape", "tied_to", "when", "experts", "dtype"}
WEIGHT_DTYPES = {"bf16", "f16", "f32"}
# Names the compiler binds itself: the step's token count and sequence count.
DYNAMIC_SYMBOLS = ("T", "B")


@dataclass
class Binding:
    symbol: str
    keys: list[str]          # alternatives, each a dotted path into config.json
    default: object | None   # ast of the default, or None when required
    line: int


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


@dataclass
class Statement:
    targets: list[str]
    expr: object             # ast.expr
    text: str
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

    def err(self, msg, line=None) -> SpecError:
        return SpecError(msg, self.path, line)

    def bind(self, config: dict, source: str | None = None) -> dict:
        """Resolve every config symbol from a config.json dict; check `requires`."""
        env: dict = {}
        where = f" in {source}" if source else ""
        for sym, b in self.bindings.items():
            value, found = None, False
            for key in b.keys:
                cur, ok = config, True
                for part in key.split("."):
                    if isinstance(cur, dict) and part in cur:
                        cur = cur[part]
                    else:
                        ok = False
                        break
                if ok and (cur is not None or b.default is None):
                    value, found = cur, True
                    break
            if not found:
                if b.default is None:
                    raise self.err(f"config key '{b.keys[0]}' (symbol {sym}) is missing{where}", b.line)
                try:
                    value = evaluate(b.default, env)
                except Unknown as e:
                    raise self.err(f"default of {sym} uses unknown symbol '{e.name}'"
                                   f"{did_you_mean(e.name, env)}", b.line) from None
                except EvalError as e:
                    raise self.err(f"default of {sym}: {e}", b.line) from None
            env[sym] = value
        for node, text, line in self.requires:
            try:
                ok = evaluate(node, env)
            except Unknown as e:
                raise self.err(f"requirement '{text}' uses unknown symbol '{e.name}'"
                               f"{did_you_mean(e.name, env)}", line) from None
            except EvalError as e:
                raise self.err(f"requirement '{text}' cannot be evaluated: {e.reason}", line) from None
            if not ok:
                raise self.err(f"unsupported configuration{where}: requirement '{text}' does not hold", line)
        return env


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
        if "shape" not in decl or not isinstance(decl["shape"], list) or not decl["shape"]:
            raise SpecError(f"weight '{key}' needs a 'shape' list", file, line)
        dtype = decl.get("dtype")
        if dtype is not None and dtype not in WEIGHT_DTYPES:
            raise SpecError(f"weight '{key}' has unknown dtype '{dtype}' (one of {sorted(WEIGHT_DTYPES)})",
                            file, fields.get("dtype", line))
        shape = [parse_expr(str(s), file, line) for s in decl["shape"]]
        out[key] = WeightDecl(key, str(decl["name"]), shape, line, decl.get("tied_to"),
                              decl.get("when"), decl.get("experts"), dtype)
    return out


def _statements(section, file, where) -> list[Statement]:
    if not isinstance(section, list) or not section:
        raise SpecError(f"'{where}' must be a non-empty list of statements", file, line_of(section))
    out = []
    for item in section:
        line = line_of(item)
        if not isinstance(item, str):
            raise SpecError(f"statement in '{where}' must be a string 'name = op(...)'", file, line)
        targets, expr = parse_statement(item, file, line)
        out.append(Statement(targets, expr, str(item), line))
    return out


def _binding(sym, text, file, line) -> Binding:
    if not isinstance(text, str):
        raise SpecError(f"symbol '{sym}' must name a config.json key, as in "
                        f"'{sym}: key [| other.key] [= default]', got {text!r}", file, line)
    text = str(text)
    default = None
    if "=" in text and "==" not in text:
        text, dflt = text.split("=", 1)
        default = parse_expr(dflt, file, line)
    keys = [k.strip() for k in text.split("|") if k.strip()]
    if not keys:
        raise SpecError(f"symbol '{sym}' names no config key", file, line)
    return Binding(sym, keys, default, line)


def load_spec(path: str | Path) -> Spec:
    path = Path(path)
    file = str(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(f"cannot read spec: {e.strerror}", file) from None
    doc = load_yaml(text, file)
    if not isinstance(doc, dict):
        raise SpecError("a spec is a YAML mapping with family, config, weights, layer, graph", file, 1)
    for key in doc:
        if key not in TOP_KEYS:
            raise SpecError(f"unknown top-level key '{key}'{did_you_mean(key, TOP_KEYS)} "
                            f"(expected one of {sorted(TOP_KEYS)})", file, doc.key_lines.get(key))
    family = _require(doc, "family", str, file, 1)
    archs = doc.get("architectures", [])
    if not isinstance(archs, list):
        raise SpecError("'architectures' must be a list like [Qwen3ForCausalLM]", file,
                        doc.key_lines.get("architectures"))
    cfg = _require(doc, "config", dict, file, 1)
    bindings = {sym: _binding(sym, v, file, cfg.key_lines.get(sym)) for sym, v in cfg.items()}
    for sym in DYNAMIC_SYMBOLS:
        if sym in bindings:
            raise SpecError(f"symbol '{sym}' is reserved (tokens/sequences in a step)", file,
                            cfg.key_lines.get(sym))
    requires = []
    if not isinstance(doc.get("requires", []) or [], list):
        raise SpecError("'requires' must be a list of conditions like '- act == \"silu\"'", file,
                        doc.key_lines.get("requires"))
    for r in doc.get("requires", []) or []:
        requires.append((parse_expr(str(r), file, line_of(r)), str(r), line_of(r)))
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
    layer_weights, layer_graph = {}, []
    if layer is not None:
        if not isinstance(layer, dict):
            raise SpecError("'layer' must be a mapping with 'weights' and 'graph'", file, line_of(layer))
        for key in layer:
            if key not in ("weights", "graph"):
                raise SpecError(f"unknown key '{key}' in 'layer' (expected weights, graph)", file,
                                layer.key_lines.get(key))
        layer_weights = _weights(_require(layer, "weights", dict, file, layer.line), file, "layer.weights")
        layer_graph = _statements(_require(layer, "graph", list, file, layer.line), file, "layer.graph")
    dup = set(weights) & set(layer_weights)
    if dup:
        name = sorted(dup)[0]
        raise SpecError(f"duplicate weight name '{name}' in weights and layer.weights", file,
                        layer_weights[name].line)
    graph = _statements(_require(doc, "graph", list, file, 1), file, "graph")
    return Spec(file, str(family), [str(a) for a in archs], bindings, requires, dict(variants),
                weights, layer_weights, layer_graph, graph, doc)


def spec_files() -> list[Path]:
    return sorted(SPECS_DIR.glob("*.yaml"))


def find_variant(name: str) -> tuple[Spec, dict]:
    """The spec and config values of a named variant, searched across specs/."""
    known = []
    for f in spec_files():
        spec = load_spec(f)
        if name in spec.variants:
            return spec, dict(spec.variants[name])
        known += list(spec.variants)
    raise SpecError(f"unknown variant '{name}'{did_you_mean(name, known)} "
                    f"(known: {', '.join(sorted(known))})", "specs/")


def find_architecture(architectures: list[str]) -> Spec:
    """The spec whose `architectures` names one of a config.json's architectures."""
    for f in spec_files():
        spec = load_spec(f)
        if set(spec.architectures) & set(architectures or []):
            return spec
    raise SpecError(f"no spec in {SPECS_DIR} implements architectures {architectures}", "config.json")


def all_variants() -> list[str]:
    return sorted(v for f in spec_files() for v in load_spec(f).variants)
