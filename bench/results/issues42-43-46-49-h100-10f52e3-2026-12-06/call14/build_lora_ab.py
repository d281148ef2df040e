import json, sys
sys.path.insert(0, 'tests/gpu')
from infc.compiler.build import build
from infc.config import lora_build
from prepare import served_config
lora = lora_build(8, 16)
keys = {"gemv": ["narrow|Tx2560;6144x2560;Tx6144|lora3x16", "narrow|Tx4096;2560x4096;Tx2560|lora1x16",
                 "narrow|Tx9728;2560x9728;Tx2560|lora1x16"],
        "gemv_gated": ["narrow|Tx2560;19456x2560;Tx9728|lora2x16"]}
for name, ov in (("la-base", None), ("la-early", {t: {k: {"LORA_EARLY": 1} for k in ks} for t, ks in keys.items()})):
    build(out=f".cache/artifacts/{name}", gpu="h200", log=None, model_dir=str(served_config("qwen3-4b")),
          lora=lora, check_checkpoint=False, tuning_overlay=ov)
    print("built", name, flush=True)
