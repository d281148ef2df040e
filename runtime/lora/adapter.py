"""An adapter in the form the tables take it: per checkpoint module (its concrete name, layer
index substituted: model.layers.3.self_attn.q_proj), the float32 A [r, K] and B [N, r] and the
scale PEFT multiplies B A x by (lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA)."""
from dataclasses import dataclass, field

import numpy as np


@dataclass
class ModuleDelta:
    a: np.ndarray           # [r, K] float32
    b: np.ndarray           # [N, r] float32
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass
class Adapter:
    name: str
    path: str
    modules: dict[str, ModuleDelta] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def nbytes(self) -> int:
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())
