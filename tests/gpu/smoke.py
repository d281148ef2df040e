"""First light on a GPU: copy bandwidth, load an artifact, prefill + decode with CUDA Graphs,
logits against HF bf16 on a few prompts, batch-1 TPOT. Prints a short table."""
import sys
import time

import numpy as np

sys.path.insert(0, "tests/gpu")
from driver_loop import Pages, step  # noqa: E402
from models import artifact, model_dir  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "qwen3-4b"
t0 = time.time()
d = model_dir(name)
print(f"model dir ready in {time.time() - t0:.1f} s", flush=True)
from infc.runtime.cuda.runner import CudaRunner  # noqa: E402
from infc.runtime.engine.step import Chunk  # noqa: E402
from infc.bench.common import copy_bandwidth  # noqa: E402

t0 = time.time()
r = CudaRunner(artifact(name), d, max_num_batched_tokens=2048, max_num_seqs=8, buckets=[1, 2, 4, 8], num_pages=512)
print(f"runner ready in {time.time() - t0:.1f} s on {r.ctx.name}; weights {r.weights.bytes / 1e9:.2f} GB", flush=True)
bw = copy_bandwidth(r.ctx)
print(f"copy bandwidth {bw / 1e12:.2f} TB/s; floor {r.weights.bytes / bw * 1e3:.3f} ms", flush=True)
rng = np.random.default_rng(0)
prompt = [int(t) for t in rng.integers(0, r.vocab_size, 32)]
pages = Pages(r.num_pages, r.page_size)
lg = step(r, pages, [Chunk(0, prompt, 0)])
toks = [int(lg[0].argmax())]
logits = [lg[0]]
t0 = time.perf_counter()
for i in range(64):
    lg = step(r, pages, [Chunk(0, [toks[-1]], 32 + i)])
    toks.append(int(lg[0].argmax()))
    logits.append(lg[0])
dt = (time.perf_counter() - t0) / 64 * 1e3
print(f"decode TPOT (host loop, logits to host) {dt:.3f} ms", flush=True)
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
with torch.no_grad():
    ref = hf(torch.tensor([prompt + toks[:-1]], device="cuda")).logits[0, 31:].float().cpu().numpy()
ours = np.stack(logits)
def lp(x):
    x = x.astype(np.float64); m = x.max(-1, keepdims=True); return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))
a, b = lp(ours), lp(ref)
regret = (b.max(-1) - np.take_along_axis(b, a.argmax(-1)[:, None], -1)[:, 0]).max()
top = np.argsort(-a, -1)[:, :8]
dd = np.abs(np.take_along_axis(a, top, -1) - np.take_along_axis(b, top, -1))
print(f"vs HF bf16: argmax agree {(a.argmax(-1) == b.argmax(-1)).mean():.3f}, regret {regret:.3f}, "
      f"top8 |dlogprob| mean {dd.mean():.4f} p99 {np.quantile(dd, 0.99):.3f}", flush=True)
