import sys
sys.path.insert(0, "tests/gpu")
import prepare as P
if __name__ == "__main__":
    from infc.backend import SERVED_ARTIFACTS
    d = str(P.quant_config("qwen3-4b-fp8"))
    for tag, kw in (("", {}), ("-park", {"tuning_overlay": {t: {"default": {"PARK": "store"}} for t in ("gemv", "gemv_gated")}})):
        P._both_tunings(f"qwen3-4b-fp8{tag}", SERVED_ARTIFACTS / f"qwen3-4b-fp8{tag}", model_dir=d, check_checkpoint=False, **kw)
