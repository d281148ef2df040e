"""Issue 46: where a batch-1 LoRA site's time goes in the model. qwen3-4b with --enable-lora (8 slots,
rank 16) built several ways, each a directory beside prepare.py's qwen3-4b-lora8r16, for
`bench profile --steps decode_b1_graph --loras 8` in one device call:

    first  LORA_FIRST 1 alone (the shrink's programs first in the grid)    } the schedules against
    parts  LORA_PARTS 1 alone (the waiting programs sum the parked ranges) } the template's
    none   neither (the defaults before 2026-12-07's H100 A/B)             } defaults (both 1)
    p1     probe: the GEMV's programs never look at ready nor wait (the delta reads whatever sums are there)
    p2     probe: the whole handshake, no delta
    p3     probe: no shrink, no claims, no departures: only the delta, on stale sums
    departures  LORA_SETS 0 (every program departs, the last zeroes the words: the form before sets)
    relaxed  LORA_SETS 0 with the departures relaxed instead of acq_rel (their fences, not their count)
    nomid  LORA_MID 0 (the look at the tail only: the form before 2026-12-07 #14)

The probes give wrong results by design (timing only). Each is codegen_templates/triton/gemv.py.j2
with a few lines replaced while this process renders (nothing in the tree changes), so the GPU
machine re-renders them through this tool too (tests/gpu/rerender.py refuses them; session.sh's
lora-profile stage calls this tool for them):

    # build machine (after tests/gpu/prepare.py base lora):
    .venv/bin/python tools/experiments/lora_site_probe.py prepare [first parts none p1 p2 p3]
    tests/gpu/carry.sh artifacts/qwen3-4b artifacts/qwen3-4b-lora8r16 artifacts/qwen3-4b-lora8r16-first ... gpu/configs
    # GPU machine (a no-op where the plans are already this GPU's table), then the profiles:
    LORA_PROFILE_ARTS="qwen3-4b-lora8r16 qwen3-4b-lora8r16-first ..." LORA_PROFILE_STEPS=decode_b1_graph \
        STAGES=lora-profile tests/gpu/session.sh OUT
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = "triton/gemv.py.j2"

_NO_WAIT = [("            if _lora_ready(lslot_ptr, lsync_ptr, M).to(tl.int32) == 0:\n", "            if 0 == 1:\n")]
_DEPARTURES = ('tune.get("LORA_SETS", 1)', 'tune.get("LORA_SETS", 0)')
VARIANTS = {
    "first": [('tune.get("LORA_PARTS", 1)', 'tune.get("LORA_PARTS", 0)')],
    "parts": [('tune.get("LORA_FIRST", 1)', 'tune.get("LORA_FIRST", 0)')],
    "none": [('tune.get("LORA_FIRST", 1)', 'tune.get("LORA_FIRST", 0)'),
             ('tune.get("LORA_PARTS", 1)', 'tune.get("LORA_PARTS", 0)')],
    "p1": _NO_WAIT,
    "p2": [("{% if not LORA_EARLY %}\n            # the tables that need no shrink sum", "{% if False %}\n            #"),
           ("{% for r in range(FMA_T) %}\n            out = tl.where(rows[:, None] == {{ r }}, out + _lora_apply(",
            "{% for r in range(0) %}\n            out = tl.where(rows[:, None] == {{ r }}, out + _lora_apply(")],
    "departures": [_DEPARTURES],
    "nomid": [('tune.get("LORA_MID", 1)', 'tune.get("LORA_MID", 0)')],
    "relaxed": [_DEPARTURES, ('tl.atomic_add(lsync_ptr + 3, 1, sem="acq_rel")', 'tl.atomic_add(lsync_ptr + 3, 1, sem="relaxed")')],
    "p3": _NO_WAIT + [
        ("        if pid_t == 0:\n            rr = tl.arange(0, {{ LROWS }})", "        if 0 == 1:\n            rr = tl.arange(0, {{ LROWS }})"),
        ("_lora_leave(lsync_ptr, _lora_depart(lsync_ptr), lsets_ptr, lset)", "pass"),
        ("            done = _lora_depart(lsync_ptr)     # in flight while the delta's sums load\n", "            done = 0\n"),
        ("        else:\n            done = _lora_depart(lsync_ptr)\n", "        else:\n            done = 0\n"),
        ("        _lora_leave(lsync_ptr, done, lsets_ptr, lset)\n", "        pass\n")],
}


def _patched(name: str):
    """Render with gemv.py.j2's lines replaced for variant `name` (each must be found)."""
    import jinja2
    from infc.compiler.codegen import render
    text = (render.TEMPLATES / TEMPLATE).read_text()
    for old, new in VARIANTS[name]:
        if old not in text:
            raise SystemExit(f"{name}: {old.strip()[:60]!r} is not in {TEMPLATE} (the template changed)")
        text = text.replace(old, new)
    render._env_for.cache_clear()
    env = render._env_for(str(render.TEMPLATES))
    env.loader = jinja2.ChoiceLoader([jinja2.DictLoader({TEMPLATE: text}), env.loader])
    return env


def out_dir(name: str) -> Path:
    from infc.backend import SERVED_ARTIFACTS
    return SERVED_ARTIFACTS / f"qwen3-4b-lora8r16-{name}"


def prepare(names):
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    import prepare as gpu_prepare
    from infc.config import lora_build
    for name in names:
        _patched(name)
        gpu_prepare._both_tunings(f"qwen3-4b --enable-lora, {name}", out_dir(name),
                                  model_dir=str(gpu_prepare.served_config("qwen3-4b")),
                                  lora=lora_build(8, 16), check_checkpoint=False)
        (out_dir(name) / "lora_site_probe").write_text(name + "\n")    # rerender.py leaves it to this tool


def rerender(names):
    sys.path.insert(0, str(REPO / "tests" / "gpu"))
    from rerender import rerender as one
    for name in names:
        _patched(name)
        print(f"[lora_site_probe] {one(out_dir(name), patched=True)}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("prepare", "rerender"):
        raise SystemExit(__doc__)
    picked = sys.argv[2:] or list(VARIANTS)
    unknown = [n for n in picked if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    {"prepare": prepare, "rerender": rerender}[sys.argv[1]](picked)
