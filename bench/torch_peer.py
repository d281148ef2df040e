"""A stronger PyTorch peer for `infc bench latency`: the gpt-fast recipe. A decoder written out in
torch over an HF model's own layers (its linears, norms and MLPs, so the weights and their
rounding are HF's), with a static KV cache of the run's full length, whose one-token decode step
is compiled with `torch.compile(mode="reduce-overhead", fullgraph=True)`: one graph, replayed as a
CUDA graph, no Python per layer and no cache growth between steps. Prefill runs eager (gpt-fast
compiles it too, by prompt length; a 32-token prefill is launch-bound either way).

Llama-shaped decoders only (llama, mistral without a window, qwen2 without a window, qwen3: RMSNorm,
RoPE, GQA attention, a gated MLP; qwen3's per-head q/k norms): `check_supported` says why any other
model has no peer. torch is imported by the caller (this file is a benchmark, never the runtime).
"""
import time

import numpy as np

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


class PeerUnsupported(ValueError):
    """The model is not one the hand-written decoder reproduces."""


def check_supported(config):
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED:
        raise PeerUnsupported(f"model_type {kind!r}: the torch.compile peer runs {', '.join(SUPPORTED)}")
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", kind == "mistral"):
        raise PeerUnsupported(f"{kind} with a sliding window")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) in ("dynamic", "longrope"):
        raise PeerUnsupported(f"rope_type {rope.get('rope_type')!r} changes with the length")


def _decoder_class():
    import torch
    import torch.nn.functional as F

    class StaticDecoder(torch.nn.Module):
        """The HF model's layers in a gpt-fast loop: caches [L, 1, Hkv, max_len, D] as buffers
        (cudagraph-safe: updated in place by index_copy_), attention over the whole cache with
        positions past the current one masked."""

        def __init__(self, hf, max_len: int):
            super().__init__()
            check_supported(hf.config)
            base = hf.model
            self.embed, self.layers, self.norm, self.lm_head = base.embed_tokens, base.layers, base.norm, hf.lm_head
            cfg = hf.config
            self.hq = cfg.num_attention_heads
            self.hkv = cfg.num_key_value_heads
            self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.hq
            w = self.embed.weight
            shape = (len(self.layers), 1, self.hkv, max_len, self.head_dim)
            self.register_buffer("k_cache", torch.zeros(shape, dtype=w.dtype, device=w.device), persistent=False)
            self.register_buffer("v_cache", torch.zeros(shape, dtype=w.dtype, device=w.device), persistent=False)
            rot = base.rotary_emb
            self.register_buffer("inv_freq", rot.inv_freq.float().clone(), persistent=False)
            self.rope_scale = float(getattr(rot, "attention_scaling", 1.0))
            self.max_len = max_len

        def rope(self, pos):
            """cos, sin [T, D] as HF's rotary embedding computes them (fp32, then the model dtype)."""
            freqs = pos[:, None].float() * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            dt = self.embed.weight.dtype
            return (emb.cos() * self.rope_scale).to(dt), (emb.sin() * self.rope_scale).to(dt)

        @staticmethod
        def rotate(x, cos, sin):
            half = x.shape[-1] // 2
            return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

        def forward(self, tokens, pos):
            """tokens [1, T], pos [T] (int64): the logits of the last position, [1, V]."""
            x = self.embed(tokens)
            cos, sin = self.rope(pos)
            cos, sin = cos[None, None], sin[None, None]            # [1, 1, T, D]
            # key j is visible to the token at position p when j <= p (the cache past p is stale)
            mask = torch.arange(self.max_len, device=pos.device)[None, :] <= pos[:, None]
            for i, layer in enumerate(self.layers):
                att = layer.self_attn
                h = layer.input_layernorm(x)
                T = h.shape[1]
                q = att.q_proj(h).view(1, T, self.hq, self.head_dim)
                k = att.k_proj(h).view(1, T, self.hkv, self.head_dim)
                v = att.v_proj(h).view(1, T, self.hkv, self.head_dim).transpose(1, 2)
                if hasattr(att, "q_norm"):                         # qwen3: RMSNorm per head
                    q, k = att.q_norm(q), att.k_norm(k)
                q = self.rotate(q.transpose(1, 2), cos, sin)
                k = self.rotate(k.transpose(1, 2), cos, sin)
                self.k_cache[i].index_copy_(2, pos, k)
                self.v_cache[i].index_copy_(2, pos, v)
                a = F.scaled_dot_product_attention(q, self.k_cache[i], self.v_cache[i], attn_mask=mask,
                                                   scale=att.scaling, enable_gqa=self.hq != self.hkv)
                x = x + att.o_proj(a.transpose(1, 2).reshape(1, T, self.hq * self.head_dim))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            return self.lm_head(self.norm(x[:, -1:, :]))[:, 0, :]

    return StaticDecoder


class Peer:
    """Greedy generation through a StaticDecoder: `prefill` eager, `decode` one token per call,
    compiled (reduce-overhead, fullgraph) or eager (`compile=False`)."""

    def __init__(self, hf, max_len: int, compile: bool = True, compiler=None):
        """compiler: how to compile the decode step (default: reduce-overhead, fullgraph; the
        tests trace it with torch.compile's eager backend, fullgraph, on the CPU)."""
        import torch
        self.torch = torch
        self.model = _decoder_class()(hf, max_len).eval()
        step = self._decode_step
        if compile:
            step = (compiler or (lambda f: torch.compile(f, mode="reduce-overhead", fullgraph=True)))(step)
        self.decode_step = step
        self.device = self.model.embed.weight.device

    def _decode_step(self, token, pos):
        return self.model(token, pos).argmax(-1, keepdim=True)

    def prefill(self, ids):
        """ids [1, n] on the device: the first generated token [1, 1]."""
        pos = self.torch.arange(ids.shape[1], device=self.device)
        return self.model(ids, pos).argmax(-1, keepdim=True)

    def decode(self, token, start: int, steps: int) -> list:
        """`steps` greedy tokens after `token` (at position `start`); device tensors, [1, 1] each."""
        out = []
        for i in range(steps):
            pos = self.torch.tensor([start + i], device=self.device)
            # the graph's output buffer is reused by the next replay: keep a copy
            token = self.decode_step(token, pos).clone()
            out.append(token)
        return out

    def generate(self, ids, new_tokens: int) -> list[int]:
        with self.torch.no_grad():
            first = self.prefill(ids)
            rest = self.decode(first, ids.shape[1], new_tokens - 1)
        return [int(t) for t in [first, *rest]]


def time_peer(hf, prompts, out_len: int, seed: int = 0, reps: int = 3) -> dict:
    """The peer's TTFT (eager prefill + first token) and TPOT (compiled decode steps) per prompt
    length, on random prompts of the same lengths as infc's and HF's; compile and CUDA-graph
    capture are excluded by two warm-up runs per length."""
    import torch
    peer = Peer(hf, max(prompts) + out_len + 1, compile=True)
    rng = np.random.default_rng(seed)
    out = {"torch_compile_ttft_ms": {}, "torch_compile_tpot_ms_by_prompt": {}}

    def synced(fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = fn()
        torch.cuda.synchronize()
        return r, (time.perf_counter() - t0) * 1e3

    with torch.no_grad():                                        # as gpt-fast runs it
        for n in prompts:
            ids = torch.from_numpy(rng.integers(0, hf.config.vocab_size, (1, n))).to(peer.device)
            for _ in range(2):                                   # compile, capture, warm up
                peer.decode(peer.prefill(ids), n, out_len)
            ttfts, tpots = [], []
            for _ in range(reps):
                first, t1 = synced(lambda: peer.prefill(ids))
                _, tn = synced(lambda: peer.decode(first, n, out_len))
                ttfts.append(t1)
                tpots.append(tn / out_len)
            out["torch_compile_ttft_ms"][str(n)] = float(np.median(ttfts))
            out["torch_compile_tpot_ms_by_prompt"][str(n)] = float(np.median(tpots))
            print(f"torch.compile prompt {n}: TTFT {np.median(ttfts):.2f} ms, TPOT {np.median(tpots):.3f} ms")
    out["torch_compile_tpot_ms"] = out["torch_compile_tpot_ms_by_prompt"][str(prompts[0])]
    return out
