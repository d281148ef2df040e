"""The serving path never imports torch: build/reuse the artifact and load it as `infc serve` does
(infc.backend), import the server, generate through the async engine, check sys.modules."""
import subprocess
import sys

CODE = """
import sys
sys.path.insert(0, 'tests/gpu')
from models import artifact, model_dir
from driver_loop import Pages, step
from infc.runtime.cuda.runner import CudaRunner
from infc.runtime.engine.step import Chunk
r = CudaRunner(artifact('llama-3.2-1b'), model_dir('llama-3.2-1b'), max_num_seqs=4, num_pages=64)
p = Pages(r.num_pages, r.page_size)
lg = step(r, p, [Chunk(0, [1, 2, 3], 0)])
assert lg.shape[0] == 1
import asyncio
import infc.server.app, infc.server.serve
from infc.backend import load_backend
from infc.runtime.engine.sampling import SamplingParams
b = load_backend(model_dir('llama-3.2-1b'), device='cuda', max_model_len=512, num_gpu_blocks_override=64,
                 max_num_seqs=4, log=None)
async def go():
    out = []
    async for o in b.engine.generate([1, 2, 3], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), 'r'):
        out += o.token_ids
    return out
assert len(asyncio.run(go())) == 4
bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))
print('TORCH_MODULES', bad)
assert not bad
"""


def test_serving_path_imports_no_torch(model_dir):
    model_dir("llama-3.2-1b")           # make it first (the maker may use anything)
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "TORCH_MODULES []" in r.stdout
