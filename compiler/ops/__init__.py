"""The op vocabulary. Importing this package registers every op; each file is one op's home."""
from . import attention, elementwise, embedding, fused, last, linear, moe, rms_norm, rope, view  # noqa: F401
from .base import REGISTRY, REQUIRED, OpDef, ShapeError  # noqa: F401
