"""The op vocabulary. Importing this package registers every op; each file is one op's home."""
from . import activation, attention, copy, elementwise, embedding, fused, last, layer_norm, linear, moe, rms_norm, rope, scalar, view  # noqa: F401
from . import gated, lm_head  # noqa: F401
from . import qk_norm_rope_cache  # noqa: F401
from . import pos_embedding  # noqa: F401
from . import collectives  # noqa: F401
from . import linear_attention  # noqa: F401
from . import latent_attention  # noqa: F401
from . import concat  # noqa: F401
from . import latent_prologue  # noqa: F401
from . import lora  # noqa: F401
from . import normalize  # noqa: F401
from . import moe_table  # noqa: F401
from . import capture_hidden  # noqa: F401
from . import compressed_attention  # noqa: F401
from . import quantize_act  # noqa: F401
from . import hyper_connection  # noqa: F401
from . import pos_scale  # noqa: F401
from . import expert_upcast  # noqa: F401
from .base import REGISTRY, REQUIRED, OpDef, ShapeError  # noqa: F401
