"""A quantized weight as the compiler, the kernels and the numpy reference see it: one canonical
form that every published format (compiler/quant/formats/) is read into at load time.

A linear's weight W [N, K] is stored as codes (the plan weight keeps W's logical shape, with the
code dtype) plus companions, each a plan weight:

    codes     W's elements: f8e4m3 (fp8, 1 byte), e2m1 (fp4, two a byte), u4 (two a byte, low
              nibble first along K), u8 (1 byte)
    w_scale   f32 [ceil(N / block_n), groups]: scale of each block of block_n rows x one group
    w_zero    f32, same shape (an integer zero point per block; asymmetric integer formats only)
    w_gidx    i32 [K]: the group of column k (GPTQ act-order); without it group(k) = k // block_k
    x_scale   f32 [1]: the static per-tensor activation scale (act == "static")

and the value of W is, exactly (the oracle every kernel is tested against):

    W[n, k] = (value(codes[n, k]) - zero[n // block_n, g(k)]) * scale[n // block_n, g(k)]

value() of a float code is the float it encodes; of an integer code, the unsigned integer. A
symmetric integer format has no w_zero and its implied zero point is 2^(bits - 1) (int4: 8,
int8: 128; signed checkpoints are stored with that offset). Per-tensor and per-channel formats
are blocks too: per-channel is block_n = 1, block_k = K; per-tensor scales are stored per row
(block_n = 1), so that fused q|k|v or gate|up weights keep each part's own scale.

The activations entering the linear are quantized as the format defines (fp8 formats):
    none            kept in bf16 (weight-only: W4A16, W8A16)
    dynamic_group   per token and per act_group columns: s = amax / 448, x' = e4m3(x / s) * s
    dynamic_token   the same with one group per token (the whole row)
    static          one scale for the tensor, from the checkpoint (x_scale)
"""
from dataclasses import asdict, dataclass

from ..contract.safetensors_io import MX_BLOCK  # noqa: F401  (the MX block, for the formats)

# code dtype -> (bits, float or integer); fp8 is e4m3 (OCP, max 448), fp4 is e2m1 (OCP MX)
CODES = {"f8e4m3": (8, "float"), "e2m1": (4, "float"), "u4": (4, "int"), "u8": (8, "int")}
ACTS = ("none", "dynamic_group", "dynamic_token", "static")
FP8_MAX = 448.0
# the plan's optional quantization inputs of a linear, in this order after the bias
COMPANIONS = ("w_scale", "w_zero", "w_gidx", "x_scale")


@dataclass(frozen=True)
class QuantScheme:
    codes: str                 # one of CODES
    block_n: int               # rows that share a scale (1: per row)
    block_k: int | None        # columns that share a scale (a group); None: the whole row (K)
    zeros: bool = False        # an f32 zero point per block (asymmetric integers)
    g_idx: bool = False        # groups named per column (w_gidx), not k // block_k
    act: str = "none"          # activation quantization (ACTS)
    act_group: int | None = None   # dynamic_group's columns

    def __post_init__(self):
        assert self.codes in CODES, self.codes
        assert self.act in ACTS, self.act
        assert (self.act == "dynamic_group") == (self.act_group is not None), (self.act, self.act_group)
        assert not (self.zeros and CODES[self.codes][1] == "float"), "float codes take no zero point"

    @property
    def bits(self) -> int:
        return CODES[self.codes][0]

    def groups(self, k: int) -> int:
        """Scale columns for a K-column weight (a g_idx format names its groups: ceil(K / block_k)
        of them, as GPTQ writes them)."""
        return 1 if self.block_k is None else -(-k // self.block_k)

    def scale_shape(self, n: int, k: int) -> tuple:
        return (-(-n // self.block_n), self.groups(k))

    def companions(self) -> list[str]:
        """The companion inputs this scheme has, in COMPANIONS order."""
        return ["w_scale"] + (["w_zero"] if self.zeros else []) + (["w_gidx"] if self.g_idx else []) \
            + (["x_scale"] if self.act == "static" else [])

    def attrs(self) -> dict:
        """The node attribute (plan JSON) that carries the scheme."""
        return asdict(self)

    @staticmethod
    def from_attrs(d: dict) -> "QuantScheme":
        return QuantScheme(**d)

    def implied_zero(self) -> float:
        """The zero point of a symmetric integer format (float formats: 0)."""
        return float(1 << (self.bits - 1)) if CODES[self.codes][1] == "int" and not self.zeros else 0.0

    def __str__(self):
        blk = f"{self.block_n}x{self.block_k or 'K'}"
        extra = (" zero" if self.zeros else "") + (" g_idx" if self.g_idx else "")
        act = self.act if self.act != "dynamic_group" else f"group {self.act_group}"
        return f"{self.codes} [{blk}]{extra}, activations {act}"
