"""n-gram speculative decoding on copy-heavy prompts: the acceptance rate and the speedup against
plain decoding, with the outputs checked identical (greedy).

    python -m infc.bench.speculative [--model-path DIR] [--device cpu] [--k 4] [--max-tokens 64]

Each prompt runs alone (batch 1, the case speculation is for), first without speculation, then
with it; the report gives per prompt and in all the output tokens, the seconds each way, the
drafts' acceptance (accepted / drafted tokens, vLLM's spec_decode counters) and the mean tokens a
step. Default model: the real SmolLM2-135M (tools/smollm2_from_gguf.py). CPU numbers measure the
engine's path on the numpy reference, where a verify step of k + 1 rows costs more than one
decode row (its matmuls are not weight-read bound as the GPU's are); the GPU's come from the lead.

Measured 2026-12-02 (SmolLM2-135M, cpu, k 4, lookup 2..5, 64 tokens, the shared 2-core dev
machine under other jobs' load): outputs identical on all 20; 822 draft tokens, 518 accepted (63 %,
2.47 a draft; 518 of the 1,222 tokens came free); speedup 1.01x and 1.08x on two runs. The CPU
gain is small because a verify step costs ~3.1x a one-row decode step on the reference: numpy's
`x @ w.T` (OpenBLAS sgemm, transposed B) takes ~8x longer at 2 rows than at 1, where
`(w @ x.T).T` takes ~3x (compiler/ops/linear.py's reference; not changed here).
"""
import argparse
import json
import time

# Copy-heavy tasks (edit this text, quote in a summary, refactor code): most of each answer is
# already in its prompt, which is what prompt lookup drafts from.
_STORY = ("The old lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the "
          "wick, polished the great lens, and watched the ships pass along the rocky coast. ")
_CODE = ("def total_price(items):\n    total = 0\n    for item in items:\n        total = total + "
         "item.price * item.quantity\n    return total\n")
PROMPTS = [
    f"Text: {_STORY}\nRewrite the text, replacing 'lighthouse keeper' with 'sailor':\n",
    f"Text: {_STORY}\nRepeat the text exactly:\n",
    f"Text: {_STORY}\nCorrect the text (it has no errors, so copy it unchanged):\n",
    "Quote: \"We choose to go to the Moon in this decade and do the other things, not because they "
    "are easy, but because they are hard.\"\nSummary with the quote: Kennedy said \"We choose",
    "The meeting notes: Alice will send the budget on Monday. Bob will review the budget on "
    "Tuesday. Carol will present the budget on Wednesday.\nThe same notes as a list:\n- Alice",
    f"{_CODE}\n# The same function with a docstring:\n",
    f"{_CODE}\n# The same function, renamed to compute_total:\n",
    f"{_CODE}\n# Refactored to use sum():\ndef total_price(items):\n",
    "SELECT name, email FROM users WHERE active = 1 ORDER BY name;\n-- The same query for the "
    "customers table:\nSELECT name, email FROM",
    "Original: The quick brown fox jumps over the lazy dog. The quick brown fox jumps again.\n"
    "Edited (fox -> cat): The quick brown",
    "Dear team,\nThe server will be down for maintenance on Saturday from 2 am to 6 am. Please save "
    "your work before then.\nThanks,\nOps\n\nThe same email for next week:\nDear team,\n",
    "Ingredients: 2 cups flour, 1 cup sugar, 3 eggs, 1 cup milk, 1 teaspoon vanilla.\nDouble "
    "check the list and write it again:\nIngredients: 2 cups flour,",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "# The same class with a z coordinate:\nclass Point3:\n    def __init__(self, x, y, z):\n",
    "1. Open the box.\n2. Remove the device.\n3. Charge the device for two hours.\n4. Press the "
    "power button.\nThe steps again:\n1. Open the box.\n",
    "\"To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer the "
    "slings and arrows of outrageous fortune\" - the famous line begins \"To be, or not to be,",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in range(10):\n",
    "Name: John Smith\nAge: 42\nCity: Boston\n\nName: Jane Smith\nAge: 40\nCity: Boston\n\nName:",
    "<ul>\n  <li>Home</li>\n  <li>About</li>\n  <li>Contact</li>\n</ul>\nThe same list with a "
    "Blog item:\n<ul>\n  <li>Home</li>\n",
    "The report says: \"Sales rose 12 percent in the first quarter, driven by strong demand in "
    "Europe.\" In short, the report says that \"Sales rose",
    "import os\nimport sys\nimport json\n\ndef load(path):\n    with open(path) as f:\n        "
    "return json.load(f)\n\n# Same module, load renamed to read_json:\nimport os\nimport sys\n",
]


def _timed(llm, prompt, params):
    t0 = time.perf_counter()
    ids = llm.generate(prompt, params)[0].token_ids
    return ids, time.perf_counter() - t0


def measure(model_path, device: str = "cpu", k: int = 4, max_tokens: int = 64, prompts=PROMPTS,
            lookup=(2, 5)) -> dict:
    """Both engines loaded and warmed up, then each prompt alone on the plain one and on the
    speculating one in turn (so a noisy machine slows both alike); one BLAS thread on the CPU."""
    from threadpoolctl import threadpool_limits

    from infc import LLM, SamplingParams
    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lookup[0],
            "prompt_lookup_max": lookup[1]}
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    with threadpool_limits(1 if device == "cpu" else None, user_api="blas"), \
            LLM(model_path, device=device) as plain, \
            LLM(model_path, device=device, speculative_config=spec) as llm:
        for x in (plain, llm):
            x.generate(prompts[0], SamplingParams(max_tokens=2, temperature=0))
        before = dict(vars(llm.engine.metrics))
        rows = []
        for i, p in enumerate(prompts):
            (want, b), (got, f) = _timed(plain, p, params), _timed(llm, p, params)
            rows.append(dict(prompt=i, tokens=len(want), identical=want == got, plain_s=round(b, 3),
                             spec_s=round(f, 3)))
        m = llm.engine.metrics
    drafts = m.spec_decode_num_drafts_total - before["spec_decode_num_drafts_total"]
    drafted = m.spec_decode_num_draft_tokens_total - before["spec_decode_num_draft_tokens_total"]
    accepted = m.spec_decode_num_accepted_tokens_total - before["spec_decode_num_accepted_tokens_total"]
    base, fast = sum(r["plain_s"] for r in rows), sum(r["spec_s"] for r in rows)
    return dict(model=str(model_path), device=device, k=k, max_tokens=max_tokens,
                prompt_lookup=list(lookup), prompts=len(prompts),
                output_tokens=sum(r["tokens"] for r in rows),
                identical=all(r["identical"] for r in rows), drafts=drafts, drafted_tokens=drafted,
                accepted_tokens=accepted, acceptance_rate=accepted / drafted if drafted else None,
                mean_accepted_per_draft=accepted / drafts if drafts else None,
                plain_s=round(base, 3), spec_s=round(fast, 3), speedup=base / fast, per_prompt=rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="default: the real SmolLM2-135M (converted from its GGUF)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-lookup", type=int, nargs=2, default=(2, 5), metavar=("MIN", "MAX"))
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="the first N prompts")
    ap.add_argument("--out", help="write the JSON report here")
    a = ap.parse_args(argv)
    path = a.model_path
    if path is None:
        import sys
        from pathlib import Path
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
        from smollm2_from_gguf import ensure_smollm2
        path = ensure_smollm2()
    res = measure(path, a.device, a.k, a.max_tokens, PROMPTS[:a.prompts], tuple(a.prompt_lookup))
    text = json.dumps(res, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    print(text)
    return res


if __name__ == "__main__":
    main()
