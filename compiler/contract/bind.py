"""Turning a kernel's META into launch arguments and a grid, for any launcher.

Pure Python, no torch, no CUDA: the CUDA runner, the GPU sampler, the tuner, the interpreter
test executor and the kernel test harness all resolve parameters through one `Resolver`, each
with its own way of producing pointers (device addresses, torch tensors).
"""
from .safe_eval import compile_int
from .schema import CACHE_MARKER


def step_dims(plan: dict, T: int, B: int) -> dict:
    """The dims a step's launches resolve: T tokens, B sequences, and for a data-parallel plan G,
    every rank's rows (world * T: the ranks' steps are padded to the same T)."""
    par = plan.get("parallel") or {}
    if par.get("dp", 1) > 1:
        return {"T": T, "B": B, "G": par["world"] * T}
    return {"T": T, "B": B}


def eval_int(expr, dims: dict) -> int:
    """Evaluate a grid/scratch expression such as "cdiv(T * 2560, 1024)" over dims: plan data,
    so only integer arithmetic over the dims (compiler/contract/safe_eval.py, compiled once per text)."""
    return compile_int(expr)(dims)


def grid(meta: dict, dims: dict) -> tuple[int, int, int]:
    g = [eval_int(e, dims) for e in meta["grid"]]
    return tuple(g + [1] * (3 - len(g)))


def scratch_sizes(meta: dict, dims: dict) -> dict[str, int]:
    return {name: eval_int(expr, dims) for name, expr in meta.get("scratch", {}).items()}


# Parameter sources (plan contract 5): in:N / out:N (the launch's N-th input / output), dim:T /
# dim:B, meta:NAME (a step_metadata key, or max_pages), cache:NAME (this layer's storage of cache
# NAME), scratch:NAME (the kernel's scratch, sized by META), const:INT, arg:NAME (a scalar the
# launcher passes by name: the weight fill's seed, scale and offset, which are no dim),
# scale:NAME (this layer's per-tensor scale of cache NAME, a float: an FP8 KV cache's).
# layer: (the launch's global layer index, -1 outside the layer loop: a kernel whose work
# depends on the layer, e.g. capture_hidden's).
SOURCES = ("in", "out", "dim", "meta", "cache", "scratch", "const", "arg", "scale", "layer")
# CACHE_MARKER (schema.py), the value a launch lists among its inputs/outputs to order cache
# writes before reads, has no buffer, so no parameter may bind it.

# A narrow LoRA site's sync words (codegen_templates/triton/gemv.py.j2 LORA_SETS, whose LNSETS is
# LORA_SET_COUNT): scratch LORA_SETS holds LORA_SET_COUNT sets of LORA_SET_WORDS i32, a launch's set
# (layer + 1) % LORA_SET_COUNT; a launch leaves its own set non-zero and every other zero
# (compiler/codegen/lora_sets.py says where that holds). Every launcher starts them zero.
LORA_SETS = "lora_sets"
LORA_SET_COUNT = 64
LORA_SET_WORDS = 4


def split_source(source: str) -> tuple[str, str]:
    kind, _, what = source.partition(":")
    if kind not in SOURCES:
        raise ValueError(f"unknown parameter source '{source}'")
    return kind, what


def param_types(meta: dict) -> list[str]:
    return [ty for _, ty, _ in meta["params"]]


def dim_slots(meta: dict) -> list[tuple[int, str]]:
    """(parameter index, dim name) of every dim: parameter: what a launcher rewrites per step."""
    return [(i, src[4:]) for i, (_, _, src) in enumerate(meta["params"]) if src.startswith("dim:")]


def _missing(what):
    def fail(*a):
        raise ValueError(f"this launcher has no {what} to bind (arguments {a})")
    return fail


class Resolver:
    """A kernel's META params -> argument values, from what a launcher supplies:
        tensor(name, layer)    a buffer or weight (layer: global index; None outside the layers)
        cache(name, layer)     that layer's storage of cache NAME
        meta(name)             step metadata NAME (one of meta_names, or "max_pages")
        scratch(kernel, name)  the kernel's scratch NAME (kernel: what the caller passes)
        dim(name)              T or B (a launcher that rewrites dims per step returns 0 here)
        arg(name)              a named scalar (arg:NAME)
        scale(name, layer)     that layer's scale of cache NAME (caches.scale of its declaration)
    A launcher leaves out what its kernels never take: asking for it anyway fails loud, as does
    a meta name the plan does not declare or a parameter bound to the cache marker."""

    def __init__(self, tensor=None, cache=None, meta=None, scratch=None, dim=None, meta_names=None, arg=None,
                 scale=None):
        self.tensor = tensor or _missing("tensors")
        self.cache = cache or _missing("caches")
        self.meta = meta or _missing("step metadata")
        self.scratch = scratch or _missing("scratch")
        self.dim = dim or _missing("dims")
        self.arg = arg or _missing("named arguments")
        self.scale = scale or _missing("cache scales")
        self.meta_names = None if meta_names is None else set(meta_names) | {"max_pages"}

    def values(self, kmeta: dict, inputs=(), outputs=(), layer=None, kernel=None) -> list:
        out = []
        for pname, ty, source in kmeta["params"]:
            kind, what = split_source(source)
            where = f"kernel {kernel or kmeta.get('entry')}: parameter {pname} ({source})"
            if kind in ("in", "out"):
                names = inputs if kind == "in" else outputs
                i = int(what)
                if i >= len(names):
                    raise ValueError(f"{where}: the launch has only {len(names)} {kind}puts")
                if names[i] == CACHE_MARKER:
                    raise ValueError(f"{where} binds the cache marker: address a cache as cache:NAME")
                out.append(self.tensor(names[i], layer))
            elif kind == "cache":
                out.append(self.cache(what, layer))
            elif kind == "meta":
                if self.meta_names is not None and what not in self.meta_names:
                    raise ValueError(f"{where}: '{what}' is not step metadata of this plan "
                                     f"({sorted(self.meta_names)})")
                out.append(self.meta(what))
            elif kind == "scratch":
                out.append(self.scratch(kernel, what))
            elif kind == "dim":
                out.append(self.dim(what))
            elif kind == "arg":
                out.append(self.arg(what))
            elif kind == "scale":
                out.append(float(self.scale(what, layer)))
            elif kind == "layer":
                out.append(-1 if layer is None else int(layer))
            else:                                    # const
                out.append(int(what))
        return out


class KernelInfo:
    """A compiled kernel's launch shape, from its META and the build's <id>.json (no driver):
    block, dynamic shared memory, and the hidden trailing pointer arguments recent Triton adds
    (global and profile scratch) that every launcher must pass."""

    def __init__(self, kid: str, meta: dict, info: dict):
        self.id, self.meta, self.info = kid, meta, info
        self.block = tuple(info.get("block") or meta.get("block") or [info["num_warps"] * 32, 1, 1])
        # dynamic shared memory to launch with: Triton reports it as `shared`; the nvcc-built
        # backends report static `shared` and `dynamic_shared` apart
        self.shared = int(info["dynamic_shared"] if "dynamic_shared" in info else info.get("shared", 0))
        self.hidden_args = int(info.get("hidden_args", 0))
        # bytes of Triton's global scratch per program (e.g. TMA descriptors made on the device)
        self.global_scratch = int(info.get("global_scratch_size", 0))

    def global_scratch_bytes(self, dims: dict) -> int:
        """The global scratch a launch at these step dims needs: one slot per program (0 if none).
        Allocate it for the largest dims: no grid grows as T and B shrink."""
        if not self.global_scratch:
            return 0
        gx, gy, gz = grid(self.meta, dims)
        return self.global_scratch * gx * gy * gz

    def arg_lists(self, values: list, global_scratch: int = 0) -> tuple[list, list]:
        """(values, types) to pack: the META params', then the hidden pointers: the global scratch
        (Triton's first hidden argument; a device address from global_scratch_bytes), the rest
        null."""
        if self.global_scratch and not global_scratch:
            raise RuntimeError(f"kernel {self.id} needs its Triton global scratch "
                               f"({self.global_scratch} bytes a program): pass global_scratch")
        hidden = ([global_scratch] + [0] * (self.hidden_args - 1)) if self.hidden_args else []
        return (list(values) + hidden, param_types(self.meta) + ["*i8"] * self.hidden_args)
