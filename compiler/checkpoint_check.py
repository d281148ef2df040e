"""Checkpoint honesty: the plan's weights against the checkpoint's tensors, before anything loads.

Reads only the safetensors headers (names, dtypes, shapes), so it costs milliseconds even for a
large model, and fails with the spec's file:line of the weight declaration involved when:

  (a) a tensor a weight's recipe reads is missing;
  (b) a tensor's shape (or dtype) is not what the weight's declared shape and its load-time
      transforms (slice, transpose, stack, concat) need;
  (c) a checkpoint tensor is read by no weight and matches no glob pattern of the spec's
      top-level `ignore:` list: a spec that silently drops a bias or a norm computes another
      model than the checkpoint's, and nothing else would notice.

Tied weights. A weight `tied_to` another (lm_head -> embed) reads the other weight, but its own
declared tensor still names something real: a checkpoint saved with tie_word_embeddings often
stores the tied copy too. That tensor is accounted for by the declaration itself (HF ignores it
the same way when it ties the weights), so it needs no `ignore:` entry; when present, its shape
must still be the declared one. Only the declaration makes it so: an undeclared tensor is
never silently skipped.

A directory with no safetensors at all (a config.json alone, as `infc build --model-path` for a
build machine) is not checked: there is nothing to be dishonest about, and loading weights
later fails on its own, naming the directory.

Works from the plan (schema infc.plan/2 `layers`, or plan/1 `per_layer`) and the spec (for
lines): a recipe's checkpoint tensor is traced back to the declaration whose `name` pattern it
is; fused weights (wqkv = concat of wq, wk, wv) are traced through their parts.
"""
import re
from fnmatch import fnmatchcase
from pathlib import Path

from .contract.weight_roles import is_derived
from .kv_scales import is_kv_scale
from .contract.errors import SpecError, did_you_mean
from .expr import EvalError, Unknown, evaluate
from .quant.leaves import LEAVES
from .spec import weight_name

READABLE_DTYPES = ("BF16", "F16", "F32", "F64")     # what compiler/contract/safetensors_io.py turns into floats
INDEX_DTYPES = ("I32", "I64")                       # an i32 weight's (exact as floats below 2^24)


def check_model_dir(plan: dict, spec, model_dir, log=None, ignore=(), headers=None, quant=None) -> bool:
    """Check DIR's safetensors headers against the plan. False when DIR has no checkpoint.
    ignore: glob patterns of tensors the checkpoint may hold unread (beside the spec's own: a
    quantization format's bookkeeping, compiler/quant/format_base.py); headers: DIR's
    checkpoint_headers when the caller has read them already; quant: the checkpoint's
    QuantFormat, which says which of its schemes expected a missing tensor (missing_note)."""
    tensors = headers if headers is not None else checkpoint_headers(model_dir)
    if tensors is None:
        if log:
            log(f"  no *.safetensors in {model_dir}: checkpoint not checked (config.json only)")
        return False
    check_tensors(plan, spec, tensors, str(Path(model_dir)), ignore, quant)
    return True


def checkpoint_headers(model_dir) -> dict | None:
    """tensor name -> (safetensors dtype, shape, file) of DIR's checkpoint, from its headers only;
    None without one (a config.json alone)."""
    from infc.compiler.contract.safetensors_io import Checkpoint     # numpy: only when a directory is given
    d = Path(model_dir)
    if not (d / "model.safetensors.index.json").exists() and not any(d.glob("*.safetensors")):
        return None
    ckpt = Checkpoint(d)
    try:
        out = {}
        for name, f in ckpt.where.items():
            dtype, shape = f.info(name)
            out[name] = (dtype, tuple(shape), str(f.path))
        return out
    finally:
        ckpt.close()


def check_tensors(plan: dict, spec, tensors: dict, where: str, ignore=(), quant=None) -> None:
    """tensors: checkpoint name -> (dtype, shape, file). Raises SpecError on the first problem."""
    Checker(plan, spec, tensors, where, ignore, quant).run()


def _natural(name: str):
    """model.layers.2 before model.layers.10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _fmt(shape) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _fits(shape, want) -> bool:
    """shape matches want, whose None dimensions match anything."""
    return len(shape) == len(want) and all(w is None or w == d for d, w in zip(shape, want))


def _pattern_regex(pattern: str):
    """A tensor name pattern as a regex: {i} and {e} become groups i and e."""
    out, seen = [], set()
    for p in re.split(r"(\{i\}|\{e\})", pattern):
        if p in ("{i}", "{e}"):
            out.append(f"(?P={p[1]})" if p in seen else f"(?P<{p[1]}>\\d+)")
            seen.add(p)
        else:
            out.append(re.escape(p))
    return re.compile("".join(out) + r"\Z")


def _quant_leaf(src: dict) -> str | None:
    """The recipe kind of a quantized tensor's recipe (compiler/quant/leaves.py), else None."""
    return next((k for k in src if k in LEAVES and isinstance(src[k], str)), None)


def recipe_names(src: dict, subs: dict):
    """Every checkpoint tensor name a recipe reads (no checks): for did-you-mean suggestions, and
    for the build's choice among a weight's `or:` layouts (compiler/lower.py)."""
    leaf = _quant_leaf(src)
    if "tensor" in src:
        yield Checker.subst(src["tensor"], subs)
    elif leaf:
        yield Checker.subst(src[leaf], subs)
    elif "stack" in src:
        for e in range(int(src.get("count", 0))):
            if isinstance(src["stack"], dict):
                yield from recipe_names(src["stack"], dict(subs, e=e))
            else:
                yield Checker.subst(src["stack"], dict(subs, e=e))
    elif "tied" not in src and not is_derived(src):     # (derived: the load program's, no tensor)
        for v in src.values():
            for x in (v if isinstance(v, list) else [v]):
                if isinstance(x, dict):
                    yield from recipe_names(x, subs)


class Checker:
    def __init__(self, plan, spec, tensors, where, ignore=(), quant=None):
        self.plan, self.spec, self.tensors, self.where = plan, spec, tensors, where
        self.ignore = list(ignore)
        self.quant = quant
        self.env = plan.get("config", {})
        self.used: set = set()
        self.slicing = None                     # (axis, start, stop) while inside a slice recipe
        self.decls = []                         # (decl, kind or None)
        for d in spec.weights.values():
            self.decls += [(x, None) for x in (d, *d.alternatives)]
        for d in spec.layer_weights.values():
            self.decls += [(x, None) for x in (d, *d.alternatives)]
        for kind in (getattr(spec, "layer_kinds", None) or {}).values():
            for d in kind.weights.values():
                self.decls += [(x, kind) for x in (d, *d.alternatives)]
        self.by_pattern: dict = {}
        for d, kind in self.decls:
            self.by_pattern.setdefault(self.pattern(d), []).append((d, kind))

    # ---------------------------------------------------------------- where errors point

    def decl_for(self, pattern: str, weight: str):
        """The declaration of a tensor name pattern; the one keyed `weight` when several share it."""
        cands = self.by_pattern.get(pattern, [])
        for d, kind in cands:
            if d.key == weight:
                return d, kind
        if len(cands) > 1 and self.slicing is not None:
            # Several weights slice one fused tensor (qkv_proj): the one with these bounds.
            axis, start, stop = self.slicing
            field = {0: "rows", 1: "cols"}.get(axis)
            for d, kind in cands:
                bounds = getattr(d, "transforms", {}).get(field)
                try:
                    if bounds and [evaluate(b, self.env) for b in bounds] == [start, stop]:
                        return d, kind
                except (Unknown, EvalError, TypeError):
                    pass
        return cands[0] if cands else (None, None)

    def decl_by_key(self, key: str):
        for d, kind in self.decls:
            if d.key == key:
                return d, kind
        return None, None

    def fail(self, msg: str, decl=None, line=None):
        raise SpecError(msg, self.spec.path, decl.line if decl is not None else line)

    def who(self, decl, weight: str) -> str:
        key = decl.key if decl is not None else weight
        return f"weight '{key}'" + (f" (fused into '{weight}')" if key != weight else "")

    # ---------------------------------------------------------------- the walk

    def run(self):
        read = {n for w in self.plan["weights"].values() for layer in self.layers(w)
                for n in recipe_names(w["source"], {"i": layer})}
        # what a misspelling may be (not a format's bookkeeping, which nothing reads: weight_shape)
        self.unread = [n for n in self.tensors if n not in read and not any(fnmatchcase(n, p) for p in self.ignore)]
        for wname, w in self.plan["weights"].items():
            for layer in self.layers(w):
                self.shape_of(w["source"], tuple(w["shape"]), {"i": layer}, wname, w)
        self.unused()

    def layers(self, w) -> list:
        if "layers" in w:
            return [None] if w["layers"] is None else list(w["layers"])
        if w.get("per_layer"):
            return list(range(int(self.env.get("L", 1))))
        return [None]

    def pattern(self, decl) -> str:
        """A declaration's name pattern as the plan's recipes hold it: config fields filled in."""
        try:
            return weight_name(decl.name, self.env)
        except SpecError:
            return decl.name

    @staticmethod
    def subst(pattern: str, subs: dict) -> str:
        for k, v in subs.items():
            if v is not None:
                pattern = pattern.replace("{" + k + "}", str(v))
        return pattern

    def shape_of(self, src: dict, want, subs: dict, wname: str, w: dict):
        """The shape `src` builds from the checkpoint, checked against `want` (a tuple with None
        for dimensions not known here, or None when nothing is known)."""
        if "tensor" in src:             # an i32 weight (an index table) reads integer storage
            return self.leaf(src["tensor"], want, subs, wname,
                             dtypes=INDEX_DTYPES if w.get("dtype") == "i32" else READABLE_DTYPES)
        if "dequantized" in src:       # W by its format's definition: the codes' logical shape
            parts = src["dequantized"]
            for c, sub in parts.items():
                if c != "codes":
                    self.shape_of(sub, None, subs, wname, w)
            return self.shape_of(parts["codes"], want, subs, wname, w)
        kind = _quant_leaf(src)
        if kind:
            dtypes, canonical = LEAVES[kind]
            stored = self.leaf(src[kind], None, subs, wname, dtypes=dtypes)
            got = canonical(src, stored)
            name, decl = self.leaf_name({"tensor": src[kind]}, subs, wname)
            if isinstance(got, str):
                self.fail(f"{self.who(decl, wname)}: checkpoint tensor '{name}' {got}", decl)
            if want is not None and not _fits(got, want):
                self.fail(f"{self.who(decl, wname)}: checkpoint tensor '{name}' (shape {_fmt(stored)}) "
                          f"holds a {_fmt(got)} quantized weight, the spec expects {_fmt(want)}", decl)
            return got
        if "rows" in src:               # a per-tensor scale, one element, read for every row
            return self.per_tensor(src, subs, wname, w)
        if is_derived(src):             # written by the load program: no checkpoint tensor
            return tuple(src["derived"]["shape"])
        if "tied" in src:
            self.tied(wname, w, want, subs)
            target = self.plan["weights"].get(src["tied"])
            return tuple(target["shape"]) if target else None
        if "stack" in src:
            count = int(src["count"])
            inner = None if want is None else want[1:]
            shapes = []
            for e in range(count):
                part = dict(subs, e=e)
                if isinstance(src["stack"], dict):
                    s = self.shape_of(src["stack"], inner, part, wname, w)
                else:
                    s = self.leaf(src["stack"], inner, part, wname)
                if shapes and s is not None and shapes[0] is not None and s != shapes[0]:
                    pattern = src["stack"] if isinstance(src["stack"], str) else wname
                    decl, _ = self.decl_for(pattern, wname)
                    self.fail(f"{self.who(decl, wname)}: expert {e}'s tensor "
                              f"'{self.subst(str(pattern), part)}' has shape {_fmt(s)}, expert 0's "
                              f"{_fmt(shapes[0])} (experts are stacked, so they must agree) in "
                              f"{self.where}", decl)
                shapes.append(s)
            return None if shapes[0] is None else (count, *shapes[0])
        if "concat" in src:
            return self.concat(src, want, subs, wname, w)
        if "reshape" in src:
            s = self.shape_of(src["reshape"], tuple(src["from"]), subs, wname, w)
            return None if s is None else tuple(src["to"])
        if "slice" in src:
            axis, start, stop = int(src["axis"]), int(src["start"]), int(src["stop"])
            groups = int(src.get("groups", 1))
            inner_want = None
            if want is not None:
                inner_want = tuple(None if k == axis else d for k, d in enumerate(want))
            outer, self.slicing = self.slicing, (axis, start, stop)
            try:
                if "tensor" in src["slice"]:
                    s = self.leaf(src["slice"]["tensor"], inner_want, subs, wname, {axis: stop * groups})
                else:
                    s = self.shape_of(src["slice"], inner_want, subs, wname, w)
                name, decl = self.leaf_name(src["slice"], subs, wname)
            finally:
                self.slicing = outer
            if s is None:
                return None
            if axis >= len(s) or s[axis] % groups or s[axis] // groups < stop:
                what = "rows" if axis == 0 else "columns" if axis == 1 else f"axis {axis}"
                have = s[axis] if axis < len(s) else "no"
                each = f" of each of {groups} equal row groups" if groups > 1 else ""
                self.fail(f"{self.who(decl, wname)}: the spec takes {what} [{start}, {stop}){each} of "
                          f"checkpoint tensor '{name}', but it has {have} {what} (shape {_fmt(s)}) "
                          f"in {self.where}", decl)
            n = len(range(start, stop, int(src.get("step", 1))))
            out = tuple(groups * n if k == axis else d for k, d in enumerate(s))
            if want is not None and not _fits(out, want):      # the spec contradicts itself
                self.fail(f"{self.who(decl, wname)}: the slice [{start}, {stop}) of '{name}' gives "
                          f"shape {_fmt(out)}, but the declared shape is {_fmt(want)}", decl)
            return out
        if "transpose" in src:
            def flip(t):               # 2-D: reversed; 3-D (per head): the last two swapped
                return (t[0], t[2], t[1]) if src.get("per_head") and len(t) == 3 else tuple(reversed(t))
            inner = None if want is None else flip(want)
            s = self.shape_of(src["transpose"], inner, subs, wname, w)
            return None if s is None else flip(s)
        for op in ("exp", "scale", "offset"):
            if op in src:
                return self.shape_of(src[op], want, subs, wname, w)
        if "zeros" in src:
            return tuple(src["zeros"])
        # A recipe this check does not know: still count the tensors it reads as used.
        for v in src.values():
            for s in (v if isinstance(v, list) else [v]):
                if isinstance(s, dict):
                    self.shape_of(s, None, subs, wname, w)
        return None

    def per_tensor(self, src, subs, wname, w):
        """{"rows": src, "count": n}: the stored scale must hold one element (the load recipe
        refuses any other; here it fails the build, from the headers)."""
        s = self.shape_of(src["rows"], None, subs, wname, w)
        if s is not None and any(d != 1 for d in s):
            name, decl = self.leaf_name(src["rows"], subs, wname)
            self.fail(f"{self.who(decl, wname)}: checkpoint tensor '{name}' has shape {_fmt(s)}: a "
                      f"per-tensor scale has one element ({self.where})", decl)
        return int(src["count"]), 1

    def leaf_name(self, src, subs, wname):
        """(first checkpoint tensor name under src, its declaration) for messages."""
        while isinstance(src, dict):
            if "tensor" in src or _quant_leaf(src):         # a quantized tensor names itself too
                pattern = src["tensor"] if "tensor" in src else src[_quant_leaf(src)]
                break
            if "stack" in src and isinstance(src["stack"], str):
                pattern = src["stack"]
                break
            inner = [v for v in src.values() if isinstance(v, (dict, list))]
            if not inner:
                return wname, None
            src = inner[0][0] if isinstance(inner[0], list) else inner[0]
        else:
            return wname, None
        return self.subst(pattern, subs), self.decl_for(pattern, wname)[0]

    def leaf(self, pattern: str, want, subs: dict, wname: str, at_least=None, dtypes=READABLE_DTYPES):
        name = self.subst(pattern, subs)
        decl, _ = self.decl_for(pattern, wname)
        if name not in self.tensors:
            layer = f" (layer {subs['i']})" if subs.get("i") is not None else ""
            main, _ = self.decl_by_key(decl.key) if decl is not None else (None, None)
            others = [a for a in getattr(main, "alternatives", ()) if a is not decl]
            also = ("; nor is its other layout whole (" + ", ".join(f"'{a.name}'" for a in others) + ")"
                    if others else "")
            # a quantized checkpoint: the scheme that expected it (or none, where the config leaves
            # the module unquantized and the checkpoint stores it quantized: no misspelling then)
            note, suggest = (self.quant.missing_note(name) if self.quant is not None else None) or ("", True)
            self.fail(f"{self.who(decl, wname)}: checkpoint tensor '{name}'{layer} is missing from "
                      f"{self.where}{': ' + note if note else ''}"
                      f"{did_you_mean(name, self.unread) if suggest else ''}{also}", decl)
        dtype, shape, file = self.tensors[name]
        self.used.add(name)
        if dtype not in dtypes:
            self.fail(f"{self.who(decl, wname)}: checkpoint tensor '{name}' has dtype {dtype}; infc "
                      f"reads {', '.join(dtypes)} {'checkpoints' if dtypes == READABLE_DTYPES else 'here'} "
                      f"({file})", decl)
        if want is not None and not _fits(shape, want):
            # A fused part's rows are unknown here ([?, H]); its own declaration knows them
            # when the tensor is read as declared (no slice or transpose in between).
            declared = self.declared_shape(decl) if decl is not None and not getattr(decl, "transforms", None) else None
            shown = declared if declared is not None and _fits(declared, want) else want
            text = _fmt(shown)
            if at_least:         # a sliced tensor: at least `stop` along the sliced axis
                text = "[" + ", ".join(f">={at_least[k]}" if d is None and k in at_least
                                       else "?" if d is None else str(d)
                                       for k, d in enumerate(shown)) + "]"
            self.fail(f"{self.who(decl, wname)}: checkpoint tensor '{name}' has shape {_fmt(shape)}, "
                      f"the spec expects {text} ({file})", decl)
        return shape

    def concat(self, src, want, subs, wname, w):
        axis = int(src["axis"])
        part_want = None if want is None else tuple(None if k == axis else d for k, d in enumerate(want))
        shapes = [self.shape_of(p, part_want, subs, wname, w) for p in src["concat"]]
        if want is None or any(s is None for s in shapes):
            return None
        total = sum(s[axis] for s in shapes)
        if total == want[axis]:
            return tuple(total if k == axis else d for k, d in enumerate(shapes[0]))
        # The parts do not add up: blame the part whose size differs from its declaration's.
        for p, s in zip(src["concat"], shapes):
            name, decl = self.leaf_name(p, subs, wname)
            declared = self.declared_shape(decl)
            if declared is not None and len(declared) == len(s) and declared[axis] != s[axis]:
                self.fail(f"{self.who(decl, wname)}: checkpoint tensor '{name}' gives shape "
                          f"{_fmt(s)}, the spec expects {_fmt(declared)} in {self.where}", decl)
        parts = ", ".join(f"'{self.leaf_name(p, subs, wname)[0]}' {_fmt(s)}"
                          for p, s in zip(src["concat"], shapes))
        name, decl = self.leaf_name(src["concat"][0], subs, wname)
        self.fail(f"weight '{wname}': checkpoint tensors {parts} add up to {total} along axis "
                  f"{axis}, the spec expects {want[axis]} in {self.where}", decl)

    def declared_shape(self, decl):
        """A declaration's shape evaluated with the plan's config (None when it cannot be: a
        layer kind may override symbols)."""
        if decl is None:
            return None
        _, kind = self.decl_by_key(decl.key)
        if kind is not None and kind.symbols:
            return None
        try:
            dims = tuple(evaluate(e, self.env) for e in decl.shape)
            if decl.experts is not None:
                dims = (self.env[decl.experts], *dims)
        except (Unknown, EvalError, KeyError, TypeError):
            return None
        return dims

    def tied(self, wname, w, want, subs):
        """A tied weight's own declared tensor: accounted for when present (see the docstring)."""
        decl, _ = self.decl_by_key(wname)
        if decl is None:
            return
        name = self.subst(self.pattern(decl), subs)
        if name not in self.tensors:
            return
        self.used.add(name)
        dtype, shape, file = self.tensors[name]
        if want is not None and tuple(shape) != tuple(want):
            self.fail(f"weight '{wname}' (tied to '{w['source']['tied']}'): the checkpoint also stores "
                      f"'{name}' with shape {_fmt(shape)}, the spec declares {_fmt(want)} ({file})", decl)

    # ---------------------------------------------------------------- (c) unused tensors

    def unused(self):
        # config fields fill in as in weight names: "model.layers.{L}.*" (an MTP layer past the
        # model's own, as published), "{prefix}vision_tower.*"
        patterns = [weight_name(p, self.env, self.spec.path) for p in self.spec.ignore or []] + self.ignore
        # the MTP layer's tensors: read by speculation's own plan (Spec.mtp_section), not this one
        patterns += [weight_name(p, self.env) for p in getattr(self.spec, "mtp_ignore", None) or []]
        # KV cache scales (k_scale / v_scale) are read by --kv-cache-dtype fp8 (compiler/kv_scales.py)
        # and, as vLLM does, left unread otherwise
        left = sorted((n for n in self.tensors if n not in self.used and not is_kv_scale(n)
                       and not any(fnmatchcase(n, p) for p in patterns)), key=_natural)
        if not left:
            return
        name = left[0]
        file = self.tensors[name][2]
        more = ""
        if len(left) > 1:
            more = "; also unread: " + ", ".join(f"'{n}'" for n in left[1:4])
            more += f" and {len(left) - 4} more" if len(left) > 4 else ""
        L = self.env.get("L")
        for d, _ in self.decls:
            m = _pattern_regex(self.pattern(d)).match(name)
            if not m:
                continue
            if d.when and not self.env.get(d.when):
                why = f"its 'when: {d.when}' is false for this config"
            elif "i" in m.groupdict() and isinstance(L, int) and int(m.group("i")) >= L:
                why = f"layer {m.group('i')} is past the config's {L} layers"
            else:
                why = "not at this layer or expert index"
            self.fail(f"checkpoint tensor '{name}' ({file}) matches weight '{d.key}', which this "
                      f"configuration does not load ({why}){more}: the checkpoint and config.json "
                      f"disagree (if the model does not need it, list it under the spec's top-level "
                      f"'ignore:')", d)
        raw = getattr(self.spec, "raw", None)
        lines = getattr(raw, "key_lines", {}) or {}
        line = lines.get("ignore") or lines.get("weights")
        self.fail(f"checkpoint tensor '{name}' ({file}) is used by no weight of this spec and "
                  f"matches no 'ignore' pattern{more}. Declare a weight that reads it or, if the "
                  f"model does not need it, add a glob pattern for it to the spec's top-level "
                  f"'ignore:' list", line=line)
