"""A random-weight EAGLE-3 head for a target model directory: config.json (LlamaForCausalLMEagle3,
the target's hidden size and vocabulary) and model.safetensors with the tensor names published
EAGLE-3 checkpoints use (fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d; no
embed_tokens: the head shares the target's). Float32, seeded.

    python tools/make_eagle3_head.py TARGET_DIR OUT_DIR [--draft-vocab N] [--layers 2,4,5] [--seed S]

The draft vocabulary is N target ids chosen at random (sorted): d2t[j] = id_j - j (target id of
draft id j is j + d2t[j], as the checkpoints store it), t2d the [V] mask of the chosen ids."""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from safetensors_write import write_raw  # noqa: E402


def head_tensors(H: int, Ht: int, Hq: int, Hkv: int, D: int, F: int, V: int, Vd: int,
                 rng: np.random.Generator, scale: float = 0.05) -> dict:
    """name -> float32 array (norms near 1, so a misplaced norm shows), plus d2t / t2d."""
    def w(*shape):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    def norm():
        return (1 + 0.2 * rng.standard_normal(H)).astype(np.float32)

    ids = np.sort(rng.choice(V, Vd, replace=False))
    t2d = np.zeros(V, np.bool_)
    t2d[ids] = True
    m = "midlayer."
    return {"fc.weight": w(H, 3 * Ht), "norm.weight": norm(), "lm_head.weight": w(Vd, H),
            m + "input_layernorm.weight": norm(), m + "hidden_norm.weight": norm(),
            m + "post_attention_layernorm.weight": norm(),
            m + "self_attn.q_proj.weight": w(Hq * D, 2 * H), m + "self_attn.k_proj.weight": w(Hkv * D, 2 * H),
            m + "self_attn.v_proj.weight": w(Hkv * D, 2 * H), m + "self_attn.o_proj.weight": w(H, Hq * D),
            m + "mlp.gate_proj.weight": w(F, H), m + "mlp.up_proj.weight": w(F, H),
            m + "mlp.down_proj.weight": w(H, F),
            "d2t": (ids - np.arange(Vd)).astype(np.int64), "t2d": t2d}


def head_config(t: dict, draft_vocab: int | None = None, layers=None, intermediate_size: int | None = None) -> dict:
    """The head's config.json for a target's config `t` (a config-only head: tests/gpu/prepare.py
    eagle3, loaded with --load-format dummy)."""
    H, V = t["hidden_size"], t["vocab_size"]
    Hq = t["num_attention_heads"]
    Hkv = t.get("num_key_value_heads") or Hq
    D = t.get("head_dim") or H // Hq
    F = intermediate_size or t["intermediate_size"]
    Vd = min(draft_vocab or V, V)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "hidden_size": H, "target_hidden_size": H, "intermediate_size": F,
              "num_attention_heads": Hq, "num_key_value_heads": Hkv, "head_dim": D,
              "num_hidden_layers": 1, "vocab_size": V, "draft_vocab_size": Vd,
              "rms_norm_eps": t.get("rms_norm_eps", 1e-6), "hidden_act": "silu",
              "rope_theta": t.get("rope_theta", 10000.0), "rope_scaling": t.get("rope_scaling"),
              "max_position_embeddings": t.get("max_position_embeddings", 2048),
              "tie_word_embeddings": False, "torch_dtype": "float32"}
    if layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [int(x) for x in layers]}
    return config


def write_head(target_dir, out_dir, draft_vocab: int | None = None, layers=None, seed: int = 0,
               intermediate_size: int | None = None, edit=None) -> Path:
    """Writes the head into out_dir (created); returns it. edit(tensors): changes the tensors
    before they are written (tests construct heads of known behaviour this way)."""
    t = json.loads((Path(target_dir) / "config.json").read_text())
    config = head_config(t, draft_vocab, layers, intermediate_size)
    H, V, Vd, F = config["hidden_size"], config["vocab_size"], config["draft_vocab_size"], config["intermediate_size"]
    Hq, Hkv, D = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    rng = np.random.default_rng(seed)
    tensors = head_tensors(H, H, Hq, Hkv, D, F, V, Vd, rng)
    if edit is not None:
        edit(tensors)
    kinds = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64", np.dtype(np.bool_): "BOOL"}
    write_raw(out / "model.safetensors", {n: (kinds[a.dtype], a) for n, a in tensors.items()})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--draft-vocab", type=int, default=None, help="draft vocabulary size (default: the target's)")
    ap.add_argument("--layers", default=None, help="the target layers the head reads, e.g. 2,4,5 "
                                                   "(default: none written; the engine's default applies)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    layers = None if a.layers is None else [int(x) for x in a.layers.split(",")]
    print(write_head(a.target_dir, a.out_dir, a.draft_vocab, layers, a.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
