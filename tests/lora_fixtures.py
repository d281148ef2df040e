"""Random LoRA adapters for the tiny test models, and the oracle they are checked against: the
base model with each adapter merged into its weights (W + scale * B A), as PEFT's merge does."""
import numpy as np

from infc.runtime.lora.adapter import Adapter, ModuleDelta


def module_shapes(hf_model) -> dict[str, tuple]:
    """checkpoint module -> (N, K) of every linear inside the layers."""
    return {n[:-len(".weight")]: tuple(p.shape) for n, p in hf_model.state_dict().items()
            if ".layers." in n and n.endswith("_proj.weight") and p.ndim == 2}


def random_adapter(hf_model, name: str, rank: int, leaves, seed: int, scale=None, ranks=None) -> Adapter:
    """An adapter over the modules whose last name is in `leaves`, random non-zero A and B
    (ranks: leaf -> its own rank, as PEFT's rank_pattern). B A is of the base weights' order
    (std ~0.04 at rank 16), as a trained adapter's is: bf16 kernels then see realistic activations."""
    gen = np.random.default_rng(seed)
    out = Adapter(name, f"<random {name}>")
    for m, (n, k) in sorted(module_shapes(hf_model).items()):
        leaf = m.rsplit(".", 1)[-1]
        if leaf not in leaves:
            continue
        r = (ranks or {}).get(leaf, rank)
        out.modules[m] = ModuleDelta(gen.standard_normal((r, k)).astype(np.float32) * 0.1,
                                     gen.standard_normal((n, r)).astype(np.float32) * 0.1,
                                     float(scale if scale is not None else gen.uniform(0.5, 2.0)))
    return out


def merged_state_dict(hf_model, adapter: Adapter | None) -> dict:
    """The HF model's tensors with the adapter merged in (float32 numpy)."""
    sd = {n: p.detach().float().numpy().copy() for n, p in hf_model.state_dict().items()}
    for m, d in (adapter.modules.items() if adapter else ()):
        sd[m + ".weight"] += d.scale * (d.b @ d.a)
    return sd
