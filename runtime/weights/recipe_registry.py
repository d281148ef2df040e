"""The weight recipe registry (runtime/weights/recipes.py documents the kinds): recipe kind ->
builder, and the reader the builders read a checkpoint through."""
import numpy as np

from infc.compiler.contract.errors import ModelDirError

RECIPES: dict = {}


class CheckpointReader:
    """read(name) -> float32 for every recipe; raw(name) (as stored) and dtype(name) (safetensors
    dtype) for the recipes of quantized tensors."""

    def __init__(self, ckpt):
        self.ckpt = ckpt

    def __call__(self, name: str) -> np.ndarray:
        return self.ckpt.float32(name)

    def raw(self, name: str) -> np.ndarray:
        return self.ckpt.raw(name)

    def dtype(self, name: str) -> str:
        return self.ckpt.dtype(name)

    def shape(self, name: str) -> tuple:
        return tuple(self.ckpt.shape(name))


def stored(read, name: str, dtypes: tuple, where: str) -> str:
    """The tensor's safetensors dtype, which must be one of `dtypes` (the format's)."""
    if not hasattr(read, "dtype"):
        raise ModelDirError(f"{where}: tensor '{name}' is quantized; read it through a CheckpointReader")
    dt = read.dtype(name)
    if dt not in dtypes:
        raise ModelDirError(f"{where}: tensor '{name}' is {dt}, the quantization format stores it as "
                            f"{' or '.join(dtypes)}")
    return dt


def recipe(kind: str):
    def register(fn):
        RECIPES[kind] = fn
        return fn
    return register


def kind_of(src: dict) -> str:
    kinds = [k for k in src if k in RECIPES]
    if len(kinds) != 1:
        raise ValueError(f"weight source {src}: expected exactly one recipe of {sorted(RECIPES)}")
    return kinds[0]


def name_at(pattern: str, layer, expert=None) -> str:
    """A checkpoint tensor name with {i} (layer) and {e} (expert) substituted."""
    name = pattern if layer is None else pattern.replace("{i}", str(layer))
    return name if expert is None else name.replace("{e}", str(expert))


def build(src: dict, layer, read, where: str = "checkpoint") -> tuple[np.ndarray, str]:
    return RECIPES[kind_of(src)](src, layer, read, where)
