"""What each plan weight of a quantized plan is, read from the plan alone, and which fill kernel
makes it for --load-format dummy.

A quantized launch (attrs["quant"]: the scheme, compiler/quant/scheme.py) reads its weight as
codes (the input whose dtype is the scheme's code dtype) and, as its last inputs, the scheme's
companions in the order w_scale, w_zero, w_gidx, x_scale (the pass and the fusions keep them
last, after the bias and any prologue's inputs; only ready activation codes' scales, has_a_scale,
and an expert stack's bf16 copy, has_w_upcast, come after them). The plan's weight names are the fusions' own,
so the launches are the one place that says which weight is a scale of which codes.

The fill kinds (plan["weight_init"] for bf16, plan["weight_init_<kind>"] for the others; the
values: runtime/weights/dummy.py):

    bf16, f32           out = fma(z, scale, offset) in the weight's dtype
    round               f32, floor(fma(z, scale, offset)): integer zero points
    bytes               one random byte an element: u8 codes, and u4 / e2m1 codes (two a byte)
    f8e4m3              one random byte an element, 0x7f / 0xff (NaN) made 0x7e / 0xfe (+-448)
    index               i32, (i % period) // div: w_gidx, a column's group k // block_k
"""
from .program import launches
from .safetensors_io import MX_BLOCK

# the companions of a quantized linear, in the order the launch reads them (its last inputs);
# the same tuple as compiler/quant/scheme.py's COMPANIONS, which the contract may not import
COMPANIONS = ("w_scale", "w_zero", "w_gidx", "x_scale")
# fill kind -> (the kernel's output dtype, what it computes: "float", "round", "bytes", "e4m3",
# "index"). e4m3 codes are random bytes rather than a cast of random floats: the interpreter's
# f32 -> e4m3 cast halves a value whose rounding carries into the exponent (31.7 -> 16), so a
# cast would make the GPU's and the tests' codes differ.
FILL_KINDS = {"bf16": ("bf16", "float"), "f32": ("f32", "float"), "f8e4m3": ("u8", "e4m3"),
              "round": ("f32", "round"), "bytes": ("u8", "bytes"), "index": ("i32", "index")}
BYTE_CODES = ("u8", "u4", "e2m1")


def quant_roles(plan: dict) -> dict:
    """weight name -> (role, scheme dict, codes weight name) for every weight a quantized launch
    reads as codes (role "codes") or as a companion (role: its COMPANIONS name)."""
    out = {}
    for program in plan.get("programs", {}).values():
        for launch, _ in launches(program):
            scheme = launch.get("attrs", {}).get("quant")
            if not scheme:
                continue
            codes = next((i for i in launch["inputs"] if plan["weights"].get(i, {}).get("dtype")
                          == scheme["codes"]), None)
            if codes is None:
                raise ValueError(f"launch {launch['op']} ({', '.join(launch['inputs'])}) is quantized "
                                 f"({scheme['codes']}) but reads no {scheme['codes']} weight")
            names = [c for c in COMPANIONS if launch["attrs"].get("has_" + c)]
            # ready activation codes' scales (has_a_scale), then an expert stack's bf16 copy
            # (has_w_upcast: compiler/passes/upcast_experts.py) come after the companions
            end = len(launch["inputs"]) - sum(1 for a in ("has_a_scale", "has_w_upcast") if launch["attrs"].get(a))
            tail = launch["inputs"][end - len(names):end] if names else []
            out[codes] = ("codes", scheme, codes)
            for role, name in zip(names, tail):
                out[name] = (role, scheme, codes)
    return out


def is_mx_scale(role) -> bool:
    """role (quant_roles' entry, or None) is an OCP MXFP4 scale: e2m1 codes' w_scale with a scale a
    row and MX_BLOCK columns, a power of two (e8m0), which the fp4 experts' kernels read as its
    exponent byte."""
    return role is not None and role[0] == "w_scale" and role[1]["codes"] == "e2m1" \
        and role[1].get("block_k") == MX_BLOCK


def fill_kind(w: dict, role=None) -> str:
    """The fill kernel that makes weight w (role: quant_roles' entry, or None)."""
    dtype = w.get("dtype", "bf16")
    if role is not None and role[0] == "w_zero":
        return "round"
    if role is not None and role[0] == "w_gidx" or dtype == "i32":
        return "index"
    if dtype in BYTE_CODES:
        return "bytes"
    if dtype not in FILL_KINDS:
        raise ValueError(f"no dummy fill for {dtype} weights")
    return dtype


def fill_key(kind: str) -> str:
    """The plan key of a fill kind's kernel id."""
    return "weight_init" if kind == "bf16" else f"weight_init_{kind}"


FILLED = ("bf16", "f32", "i32", "f8e4m3") + BYTE_CODES     # the weight dtypes a fill kernel makes


def is_derived(src: dict) -> bool:
    """Whether a weight source is written by the plan's load program ({"derived": ...}: no
    checkpoint tensor; runtime/weights/recipes.py)."""
    return "derived" in src


def fill_kinds(plan: dict) -> list[str]:
    """The fill kinds a plan's (untied) weights need, bf16 always (older plans have only it); a
    weight of another dtype gets none (the loader refuses it, naming it)."""
    roles = quant_roles(plan)
    kinds = {fill_kind(w, roles.get(n)) for n, w in plan.get("weights", {}).items()
             if "tied" not in w["source"] and not is_derived(w["source"]) and w.get("dtype", "bf16") in FILLED}
    return ["bf16"] + sorted(kinds - {"bf16"})
