"""latent_prologue(q_lat[T, H, Dc], q_pe[T, H, Dr], kv_a[T, Dc + Dr], kv_norm[Dc]) -> (q[T, H, Dc + Dr],
kv[T, Dc + Dr]): DeepSeek MLA's absorbed query and latent row, built in one launch.

Made by fuse_latent_prologue from the five launches a spec's MLA block writes before
latent_attention (rope of q_pe, rope of k_pe, rms_norm of c_kv, the two concats): for each token t
at position p,
    q[t, h]  = [q_lat[t, h] | rope(q_pe[t, h], p)]
    kv[t]    = [rms_norm(c_kv_t, kv_norm) | rope(k_pe_t, p)]      c_kv_t, k_pe_t = kv_a[t, :Dc], kv_a[t, Dc:]
rope as in ops/rope.py (the q and k ropes share their attributes), rms_norm as in ops/rms_norm.py.
Its reference is the composition of those ops' references, so the fusion is right exactly when the
logits do not move.
"""
import numpy as np

from .base import REQUIRED, expect, op, tt
from .rms_norm import rms
from .rope import check as check_rope
from .rope import rotate


def infer(types, attrs):
    q_lat, q_pe, kv_a, w = types
    expect(len(q_lat.shape) == 3 and len(q_pe.shape) == 3 and q_lat.shape[:2] == q_pe.shape[:2],
           f"latent_prologue: q_lat {q_lat} and q_pe {q_pe} must be [T, H, *] alike")
    dc, dr = q_lat.shape[2], q_pe.shape[2]
    expect(len(kv_a.shape) == 2 and kv_a.shape[0] == q_lat.shape[0] and kv_a.shape[1] == dc + dr,
           f"latent_prologue: kv_a {kv_a} must be [T, Dc + Dr = {dc + dr}]")
    expect(len(w.shape) == 1 and w.shape[0] == dc, f"latent_prologue: kv_norm {w} must be [Dc = {dc}]")
    expect(q_lat.dtype == q_pe.dtype == kv_a.dtype, "latent_prologue: q_lat, q_pe and kv_a share a dtype")
    check_rope(dr, attrs)
    return [tt(q_lat.shape[:2] + (dc + dr,), q_lat.dtype), tt((kv_a.shape[0], dc + dr), kv_a.dtype)]


def reference(ctx, q_lat, q_pe, kv_a, w, eps, theta, scaling=None, rotary_dim=None, interleaved=None):
    dc = q_lat.shape[2]
    rot = lambda x: rotate(x, ctx.positions, theta, scaling, rotary_dim, interleaved)
    q = np.concatenate([np.asarray(q_lat, np.float32), rot(q_pe)], axis=-1)
    kv_a = np.asarray(kv_a, np.float32)
    kv = np.concatenate([rms(kv_a[:, :dc], w, eps), rot(kv_a[:, None, dc:])[:, 0]], axis=-1)
    return q, kv


op(name="latent_prologue", tensors=["q_lat", "q_pe", "kv_a", "kv_norm"], internal=True, n_outputs=2,
   attrs={"eps": REQUIRED, "theta": REQUIRED, "scaling": None, "rotary_dim": None, "interleaved": None},
   infer=infer, reference=reference, templates={"triton": "latent_prologue"}, strided=True,
   doc="MLA's [q_lat | rope(q_pe)] and [rms_norm(c_kv) | rope(k_pe)] in one launch")
