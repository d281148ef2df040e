"""`infc serve --device cpu` on a quantized checkpoint, end to end: a tiny qwen3 written as
compressed-tensors W4A16 (group 32, asymmetric) by tools/quantize_model.py, served with no flag
about its format; one greedy request through the OpenAI SDK answers the tokens the reference
executor computes from the same checkpoint."""
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from conftest import _tiny
from test_server_support import _smollm2, request, serve_process

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from quantize_model import quantize_model  # noqa: E402

PROMPT = [9707, 11, 1879, 0, 576, 3460, 374, 264, 1273, 13, 3555, 30]     # 12 token ids of SmolLM2's
GENERATE = 4


def _greedy(qdir: Path) -> list[int]:
    """GENERATE greedy tokens after PROMPT, by the reference executor."""
    from infc.compiler.build import compile_model
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
    from infc.runtime.weights.load import load_weights
    _, plan = compile_model(model_dir=qdir)
    ex = ReferenceExecutor(plan, load_weights(plan, Checkpoint(qdir)))
    out = [int(np.argmax(ex.step([SeqChunk(0, PROMPT, 0)])[0]))]
    while len(out) < GENERATE:
        out.append(int(np.argmax(ex.step([SeqChunk(0, out[-1:], len(PROMPT) + len(out) - 1)])[0])))
    return out


def test_serve_quantized_checkpoint_on_cpu(tmp_path):
    from openai import OpenAI
    src, q = tmp_path / "bf", tmp_path / "q"
    torch.manual_seed(7)
    _tiny("qwen3", vocab_size=49152, num_hidden_layers=2).float().eval().save_pretrained(src)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):   # SmolLM2's (49152 ids)
        shutil.copy(_smollm2() / f, src / f)
    quantize_model(src, q, "ct-int", bits=4, group=32, sym=False)
    want = _greedy(q)
    with serve_process(q, "--device", "cpu", "--max-model-len", "64", "--kv-cache-memory-bytes", str(8 << 20),
                       "--served-model-name", "w4a16", "--uvicorn-log-level", "warning") as (port, out):
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        r = client.completions.create(model="w4a16", prompt=PROMPT, max_tokens=GENERATE, temperature=0,
                                       extra_body={"ignore_eos": True})
        status, _, body = request(port, "POST", "/detokenize", {"model": "w4a16", "tokens": want})
    assert r.usage.completion_tokens == GENERATE and r.usage.prompt_tokens == len(PROMPT)
    assert status == 200
    assert r.choices[0].text == json.loads(body)["prompt"], (r.choices[0].text, want)
