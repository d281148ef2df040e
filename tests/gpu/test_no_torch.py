"""The serving path never imports torch: load an artifact, generate, check sys.modules."""
import subprocess
import sys

CODE = """
import sys
sys.path.insert(0, 'tests/gpu')
from models import artifact, model_dir
from driver_loop import Pages, step
from infc.runtime.cuda.runner import CudaRunner
from infc.runtime.step import Chunk
r = CudaRunner(artifact('llama-3.2-1b'), model_dir('llama-3.2-1b'), max_num_seqs=4, num_pages=64)
p = Pages(r.num_pages, r.page_size)
lg = step(r, p, [Chunk(0, [1, 2, 3], 0)])
assert lg.shape[0] == 1
bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))
print('TORCH_MODULES', bad)
assert not bad
"""


def test_serving_path_imports_no_torch(model_dir):
    model_dir("llama-3.2-1b")           # make it first (the maker may use anything)
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "TORCH_MODULES []" in r.stdout
