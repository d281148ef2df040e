"""Quantized MoE experts (issue 42): a tiny qwen3_moe whose experts and attention projections
tools/quantize_model.py writes as each format publishes them (per expert, the routers and
lm_head left bf16 by the checkpoint's ignore list). The reference executor's logits equal an
independent float32 computation of the format's definition: HF's Qwen3MoeForCausalLM with every
quantized weight dequantized HERE from the stored tensors (torch, compressed-tensors' own
decompressor, transformers' MXFP4 converter: tests/test_quant_formats.py's WEIGHT), the fused
expert stacks included, and the activations entering each quantized projection quantized as
the format says (tests/gpu/hf_quant.py's expert forward).

Hidden 64, moe_intermediate_size 128: fp8's 128 x 128 blocks hold whole gate / up rows (the
stacked gate|up scales need it) and a ragged 64-column group; int4 groups of 32 and MXFP4's
32-element blocks divide every K.
"""
import copy
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

sys.path.append(str(Path(__file__).resolve().parent / "gpu"))
from quantize_model import quantize_model  # noqa: E402

import hf_quant  # noqa: E402
from exhaustive import EXHAUSTIVE  # noqa: E402
from infc.compiler.build import compile_model  # noqa: E402
from infc.compiler.contract.errors import ModelDirError  # noqa: E402
from infc.compiler.contract.safetensors_io import Checkpoint  # noqa: E402
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk  # noqa: E402
from infc.runtime.weights.load import load_weights  # noqa: E402
from test_quant_formats import WEIGHT, _acts, infc_logits  # noqa: E402

# (test_quant_formats' prompt puts, on this model, one fp8 activation within float32 noise of an
# e4m3 rounding boundary at its token 300: the two float32 computations then pick neighbouring
# codes, 1e-2 apart in the logits, as any two implementations of the definition may)
PROMPT = [11, 200, 3, 77, 150, 9, 31, 260, 4, 99]
ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")

# id -> (writer, options): Qwen3-30B-A3B-FP8's blocks with dynamic group-128 activations,
# Kimi-K2's routed experts' INT4 (symmetric, group 32), GPT-OSS's MXFP4; then smaller fp8
# blocks (several a projection), asymmetric int4 and llm-compressor's FP8 per channel with
# dynamic per-token activations
CASES = {
    "fp8-block-128": ("fp8-block", {}),
    "ct-w4a16-g32-sym": ("ct-int", dict(bits=4, group=32, sym=True)),
    "mxfp4": ("mxfp4", {}),
    "fp8-block-32x64": ("fp8-block", dict(block=(32, 64))),
    "ct-w4a16-g32-asym": ("ct-int", dict(bits=4, group=32, sym=False)),
    "ct-fp8-channel-token": ("ct-fp8", dict(strategy="channel", act="dynamic")),
}
SLOW = {"fp8-block-32x64", "ct-w4a16-g32-asym", "ct-fp8-channel-token"}


@pytest.fixture(scope="module")
def moe(tiny_model):
    """(model dir, HF float32 model, its logits)."""
    d, model = tiny_model("qwen3_moe", moe_intermediate_size=128)
    with torch.no_grad():
        return d, model, model(torch.tensor([PROMPT])).logits[0, -1].numpy()


def _quantizer(writer, o, cfg, t, module):
    """The activation quantizer of a module's input (None: weight-only); fp8 blocks' groups
    through hf_quant's, which takes the ragged last group of K = 64 < 128."""
    if writer == "fp8-block":
        return lambda x: hf_quant.quantize_groups(x, cfg["weight_block_size"][1])
    return _acts(writer, o, cfg, t, module)


# the tensor that marks a module the checkpoint stores quantized, per writer
MARK = {"fp8-block": ".weight_scale_inv", "ct-int": ".weight_scale", "ct-fp8": ".weight_scale",
        "mxfp4": ".weight_scales"}


def definition_logits(model, qdir: Path, writer: str, o: dict, prompt=None) -> np.ndarray:
    """HF's model computing the format's definition from qdir's stored tensors: every module the
    checkpoint quantizes gets its dequantized weight (an nn.Linear its weight and an input hook,
    an expert its rows of the fused stacks) and its input quantized."""
    cfg = json.loads((qdir / "config.json").read_text())["quantization_config"]
    t = load_file(str(qdir / "model.safetensors"))
    m = copy.deepcopy(model)
    experts, quantize, linears = {}, None, 0
    for name in t:
        if not name.endswith(MARK[writer]):
            continue
        module = name[:-len(MARK[writer])]
        w = WEIGHT[writer](t, module, cfg).to(torch.float32).contiguous()
        act = _quantizer(writer, o, cfg, t, module)
        if ".experts." in module:
            experts[module], quantize = w.numpy(), act
            continue
        m.get_submodule(module).weight.data = w
        if act is not None:
            m.get_submodule(module).register_forward_pre_hook(lambda _, a, f=act: (f(a[0]),))
        linears += 1
    assert linears and len(hf_quant.set_experts(m, experts, quantize or (lambda x: x), torch.float32)) == len(experts) > 0
    with torch.no_grad():
        return m(torch.tensor([prompt or PROMPT])).logits[0, -1].numpy()


@pytest.mark.parametrize("case", [pytest.param(c, marks=[EXHAUSTIVE] if c in SLOW else []) for c in CASES])
def test_quantized_experts_equal_the_format_definition(case, moe, tmp_path):
    writer, o = CASES[case]
    src, model, bf = moe
    quantize_model(src, tmp_path, writer, **o)
    got, plan = infc_logits(tmp_path, PROMPT)
    w = plan["weights"]
    codes = {"fp8-block": "f8e4m3", "ct-fp8": "f8e4m3", "ct-int": "u4", "mxfp4": "e2m1"}[writer]
    assert w["we_gate_up"]["dtype"] == w["we_down"]["dtype"] == codes
    assert w["we_gate_up_qscale"]["shape"][0] == w["we_down_qscale"]["shape"][0] == 8       # per expert
    assert "mlp.gate" not in json.dumps([v["source"] for v in w.values() if v["dtype"] == codes])  # routers bf16
    quantized = [launch for launch in json.dumps(plan["programs"]).split('"op": ')
                 if launch.startswith('"moe_') and '"quant"' in launch]
    assert quantized, "no quantized expert launch"
    want = definition_logits(model, tmp_path, writer, o)
    assert np.abs(want - bf).max() > 1e-3, f"{case}: the quantization changes nothing: the test could not fail"
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0, err_msg=case)


# (case, upcast) run by default; the rest with --exhaustive (fp8's stacks are never upcast:
# compiler/passes/upcast_experts.py `upcasts`, checked below)
FAST_KERNEL_CASES = {("fp8-block-128", False), ("ct-w4a16-g32-sym", True)}


@pytest.mark.parametrize("case,upcast", [pytest.param(c, u, marks=[] if (c, u) in FAST_KERNEL_CASES else [EXHAUSTIVE],
                                               id=f"{c}{'-upcast' if u else ''}")
                                  for c in ("fp8-block-128", "ct-w4a16-g32-sym", "mxfp4") for u in (False, True)])
def test_quantized_moe_through_kernels(case, upcast, moe, tmp_path, monkeypatch):
    """The quantized plan through its generated kernels (interpreted: tests/interp_executor.py)
    against the reference executor: a prefill (the grouped expert GEMMs), decode steps of two
    sequences (the expert GEMVs) and a wide one (the grouped GEMMs again). With upcast, at one
    token an expert (compiler/passes/upcast_experts.py): the prefills read the 4-bit stacks
    dequantized once (their rows at least the threshold; fp8's stay codes), the decode steps the
    codes. fp8 quantizes the
    experts alone here: the kernels quantize bf16 activations where the reference quantizes
    float32 ones, which moves an e4m3 code by a step now and then; through the attention's fp8
    projections that alone takes this model 3e-2 from the reference (measured: experts alone
    1.2e-2, as the bf16 model), past what would show an expert kernel's error."""
    from infc.compiler.build import build
    from infc.runtime.engine.step import Chunk
    from interp_executor import InterpExecutor
    writer, o = CASES[case]
    if writer == "fp8-block":
        o = {**o, "keep": [a.split(".")[1] for a in ATTENTION]}
    if upcast:
        import infc.config
        monkeypatch.setattr(infc.config, "UPCAST_EXPERTS", True)
        monkeypatch.setattr(infc.config, "UPCAST_TOKENS_PER_EXPERT", 1)
    quantize_model(moe[0], tmp_path / "q", writer, **o)
    out = build(model_dir=str(tmp_path / "q"), out=tmp_path / "art", compile=False, log=None, page_size=16)
    plan = json.loads((out / "plan.json").read_text())
    plan["_dir"] = str(out)
    weights = load_weights(plan, Checkpoint(tmp_path / "q"))
    ref, run = ReferenceExecutor(plan, weights), InterpExecutor(plan, weights, page_size=16)
    rng = np.random.default_rng(3)
    a, b = [int(t) for t in rng.integers(0, 320, 37)], [int(t) for t in rng.integers(0, 320, 20)]
    plan["short_tokens"] = 16                    # both prefills on the prefill program (grouped GEMMs)
    # the decode and wide programs at 2+ sequences: the narrow one (decode steps of up to 8 tokens)
    # has its own tests (tests/test_interp_models.py, tests/test_merge_prologues.py)
    plan["narrow_tokens"] = min(plan.get("narrow_tokens", 0), 1)
    for seq, toks in ((0, a), (1, b)):
        got, want = run.step([Chunk(seq, toks, 0)]), ref.step([SeqChunk(seq, toks, 0)])
        assert run.program == "prefill" and rel(got, want) < 2e-2
        assert any(op == "expert_upcast" for op, _ in run.templates) == (upcast and writer != "fp8-block")
    lens, toks = [len(a), len(b)], [5, 9]
    for i in range(3):
        if i == 2:
            plan["wide_tokens"] = 2
        got = run.step([Chunk(0, [toks[0]], lens[0]), Chunk(1, [toks[1]], lens[1])])
        want = ref.step([SeqChunk(0, [toks[0]], lens[0]), SeqChunk(1, [toks[1]], lens[1])])
        experts = {t for op, t in run.templates if op.startswith("moe_") and op != "moe_route"}
        assert experts >= ({"moe_gate_up_grouped", "moe_down_grouped"} if i == 2 else {"moe_gate_up", "moe_down"})
        assert rel(got, want) < 2e-2 and (np.argmax(got, -1) == np.argmax(want, -1)).all()
        lens, toks = [n + 1 for n in lens], [int(t) for t in np.argmax(want, -1)]


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_experts_the_pass_cannot_stack_fail_naming_them(tiny_model, tmp_path):
    """Act-order experts (gate's and up's group indices differ) and fp8 blocks that cut a gate row
    range (F = 40 rows in blocks of 32: the stacked scales would misname up's rows) fail the build
    naming the expert stack and the reason, instead of reading wrong scales."""
    src, _ = tiny_model("qwen3_moe")
    quantize_model(src, tmp_path / "gptq", "gptq", bits=4, group=32, desc_act=True)
    with pytest.raises(ModelDirError, match=r"weight 'we_gate_up'.*act-order group indices"):
        compile_model(model_dir=tmp_path / "gptq")
    quantize_model(src, tmp_path / "fp8", "fp8-block", block=(32, 32))
    with pytest.raises(ModelDirError, match=r"weight 'we_gate_up'.*40 rows each, not whole scale blocks of 32"):
        compile_model(model_dir=tmp_path / "fp8")


def test_expert_parallel_ranks_read_their_experts_codes_and_scales(moe, tmp_path):
    """--enable-expert-parallel, alone or with tensor parallelism: each rank's stacks are its
    slice of the experts, the codes and every companion sliced alike (loaded, they equal the
    single-GPU plan's rows of those experts); tensor parallelism without it (each expert split
    across ranks) is still refused, naming the flag."""
    from infc.compiler.build import compile_ranks
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.compiler.parallel import settings
    from infc.runtime.weights.load import load_weights
    quantize_model(moe[0], tmp_path, "ct-int", bits=4, group=32, sym=False)
    _, whole = compile_model(model_dir=tmp_path)
    full = load_weights(whole, Checkpoint(tmp_path))
    names = ("we_gate_up", "we_gate_up_qscale", "we_gate_up_qzero", "we_down", "we_down_qscale", "we_down_qzero")
    for par in (settings(expert_parallel_only=2), settings(tensor_parallel_size=2, enable_expert_parallel=True)):
        for rank, (_, plan) in enumerate(compile_ranks(par, model_dir=tmp_path)):
            assert plan["weights"]["we_down"]["dtype"] == "u4"
            got = load_weights(plan, Checkpoint(tmp_path))
            for n in names:
                assert plan["weights"][n]["shape"][0] == 4, n
                np.testing.assert_array_equal(np.asarray(got[n][0]), np.asarray(full[n][0])[4 * rank:4 * rank + 4], n)
    with pytest.raises(ModelDirError, match="tensor-parallel-size > 1.*--enable-expert-parallel"):
        compile_model(model_dir=tmp_path, parallel={**settings(tensor_parallel_size=2), "rank": 0})


def test_inspect_shows_quantized_expert_launches_and_their_bytes(moe, tmp_path):
    """`infc inspect`: each quantized expert launch with its scheme, one expert's codes and scale
    bytes (the stack's shape counted here) and the experts a token reads (top-3 of 8); the step's
    totals count that share of the stacks, beside the attention's whole weights."""
    import re
    from infc.compiler.inspect import inspect
    quantize_model(moe[0], tmp_path, "ct-int", bits=4, group=32, sym=False)
    _, plan = compile_model(model_dir=tmp_path)
    w = plan["weights"]
    out = inspect(model_dir=str(tmp_path), phases=["decode"])
    notes = {}
    for line in out.splitlines():
        m = re.search(r"^\s+moe_(gate_up|down)\s.*\((?:.*, )?(we_\w+), expert_rows.*"
                      r"\[quant (u4 \[1x32\] zero, activations none): (.*)\]$", line)
        if m:
            notes[m.group(2)] = m.group(4)
    assert sorted(notes) == ["we_down", "we_gate_up"]
    for name, note in notes.items():
        e, n, k = w[name]["shape"]
        scales = 2 * 4 * n * -(-k // 32)                 # f32 scales and zero points, per expert
        assert note == f"8 experts of {n * k // 2} B codes + {scales} B scales each, 3 a token", name
    gu, dn = (w[x]["shape"] for x in ("we_gate_up", "we_down"))
    codes = 3 * 3 * (gu[1] * gu[2] + dn[1] * dn[2]) // 2     # 3 layers x 3 experts, u4 codes
    attn = 3 * sum(x["shape"][0] * x["shape"][1] // 2 for name, x in w.items()        # q|k|v and o, whole
                   if x["dtype"] == "u4" and not name.startswith("we_"))
    assert re.search(rf"decode: quantized launches read {codes + attn} B codes \+ \d+ B scales a step "
                     rf"\(experts: a batch-1 step's share\)", out), out[-2000:]


@pytest.mark.parametrize("writer,o", [("fp8-block", {}), ("ct-int", dict(bits=4, group=32, sym=False))])
def test_device_weights_of_quantized_experts(writer, o, moe, tmp_path, monkeypatch):
    """The GPU loader without a GPU (tests/fake_cuda.py): every expert stack's device bytes equal
    to_storage(the numpy loader's value); fp8 down stacks stream from the file expert by expert
    (gate|up, concatenated along the rows of each expert, is built on the host), int4 codes and
    zero points are built and packed."""
    from fake_cuda import FakeContext
    from infc.runtime.cuda import weights as dw
    from test_device_quant_weights import device_equals_numpy
    quantize_model(moe[0], tmp_path, writer, **o)
    _, plan = compile_model(model_dir=str(tmp_path))
    built = []
    real = dw._built
    monkeypatch.setattr(dw, "_built", lambda w, a: built.append((w["dtype"], tuple(w["shape"]))) or real(w, a))
    ctx = FakeContext()
    w = dw.DeviceWeights(ctx, plan, tmp_path, progress=False, threads=2)
    assert device_equals_numpy(ctx, w, plan, Checkpoint(tmp_path)) == w.bytes
    down = tuple(plan["weights"]["we_down"]["shape"])
    assert ((plan["weights"]["we_down"]["dtype"], down) in built) == (writer != "fp8-block")


def test_deepseek_shared_experts_stay_linears_of_a_quantized_checkpoint(tmp_path):
    """DeepSeek-V2 with INT4 routed and shared experts (Kimi-K2's scheme on its architecture;
    attention kept bf16 by the ignore list): fold_shared_experts leaves the shared experts plain
    linears (a stack would mix them into the routed experts' codes), quantize_weights reads them
    and the routed stacks quantized, the routers bf16 (present in the sparse layers only), and
    the reference equals the definition computed in HF's DeepseekV2ForCausalLM."""
    from test_deepseek_v2 import make
    model = make("plain", tmp_path / "bf16", moe_intermediate_size=32)
    keep = ["self_attn.q_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.o_proj"]
    quantize_model(tmp_path / "bf16", tmp_path / "q", "ct-int", bits=4, group=16, keep=keep)
    got, plan = infc_logits(tmp_path / "q", PROMPT)
    w = plan["weights"]
    assert w["we_gate_up"]["dtype"] == w["we_down"]["dtype"] == "u4" and w["we_gate_up"]["shape"][0] == 8
    shared = [n for n, x in w.items() if x["dtype"] == "u4" and "shared_experts" in json.dumps(x["source"])]
    assert shared and not any(n.startswith("wes") for n in w)          # not folded into the stacks
    from infc.compiler.contract.program import launches
    routes = [l for l, _ in launches(plan["programs"]["decode"]) if l["op"].startswith("moe_route")]
    assert routes and not any(l["attrs"].get("shared") for l in routes)
    want = definition_logits(model, tmp_path / "q", "ct-int", {})
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_llm_on_cpu_serves_a_quantized_moe_checkpoint(moe, tmp_path):
    """LLM(device="cpu") (what `infc serve --device cpu` runs) on the fp8 qwen3_moe, with no flag
    about its format: its greedy tokens are the reference executor's."""
    from infc import LLM, SamplingParams
    quantize_model(moe[0], tmp_path, "fp8-block")
    _, plan = compile_model(model_dir=tmp_path)
    ex = ReferenceExecutor(plan, load_weights(plan, Checkpoint(tmp_path)))
    want = [int(np.argmax(ex.step([SeqChunk(0, PROMPT, 0)])[0]))]
    while len(want) < 4:
        want.append(int(np.argmax(ex.step([SeqChunk(0, want[-1:], len(PROMPT) + len(want) - 1)])[0])))
    out = LLM(tmp_path, device="cpu").generate([PROMPT], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert list(out[0].token_ids) == want


def test_experts_read_codes_made_once_and_the_logits_do_not_move(moe, tmp_path):
    """The act_codes pass on the experts (Qwen3-30B-A3B-FP8's format): moe_gate_up reads the codes
    the mlp norm's add_rms_norm_quant writes (the router beside it keeps the bf16 h), moe_down the
    codes of one quantize_act over act, in every program; the reference's logits are the same bits
    as the plan built without the pass (code * scale is the quantizer's output)."""
    from infc.compiler.contract.program import unrolled
    from infc.compiler.plan import dumps
    quantize_model(moe[0], tmp_path, "fp8-block")
    plan, plain = (json.loads(dumps(compile_model(model_dir=str(tmp_path), skip=skip, log=None)[1]))
                   for skip in ((), ("act_codes",)))
    for program in ("prefill", "decode", "narrow"):
        launches = [launch for launch, _ in unrolled(plan["programs"][program])]
        made = {launch["outputs"][i]: launch["op"] for launch in launches
                for i in ((2, 3) if launch["op"] == "add_rms_norm_quant" else (0, 1) if launch["op"] == "quantize_act" else ())}
        experts = {launch["op"]: launch for launch in launches if launch["op"] in ("moe_gate_up", "moe_down")}
        assert set(experts) == {"moe_gate_up", "moe_down"}, program
        for op, producer in (("moe_gate_up", "add_rms_norm_quant"), ("moe_down", "quantize_act")):
            ins = experts[op]["inputs"]
            # (8-bit codes keep no bf16 stack: compiler/passes/upcast_experts.py `upcasts`)
            assert not experts[op]["attrs"].get("has_w_upcast")
            a_scale = ins[-1]
            assert experts[op]["attrs"].get("has_a_scale") and made.get(ins[0]) == made.get(a_scale) == producer, (program, op)
            assert plan["buffers"][ins[0]]["dtype"] == "f8e4m3"
    assert not any(launch["attrs"].get("has_a_scale") for launch, _ in unrolled(plain["programs"]["decode"])
                   if launch["op"].startswith("moe_"))
    weights = load_weights(plan, Checkpoint(tmp_path))
    got = ReferenceExecutor(plan, weights).step([SeqChunk(0, PROMPT, 0)])
    want = ReferenceExecutor(plain, weights).step([SeqChunk(0, PROMPT, 0)])
    assert np.isfinite(got).all() and np.array_equal(got, want)
