import sys
sys.path.insert(0, "tests/gpu")
import prepare as P
if __name__ == "__main__":
    from infc.backend import SERVED_ARTIFACTS
    pre = P.VERIFY_AB["pre"]
    def var(tpl, key, **over):
        o = {t: dict(e) for t, e in pre.items()}
        o[tpl][key] = {**o[tpl][key], **over}
        return o
    V = {"gu-s1": var("gemv_gated", P._VGU, SPLIT_K_DOT=1),
         "gu-s4": var("gemv_gated", P._VGU, SPLIT_K_DOT=4),
         "gu-k64": var("gemv_gated", P._VGU, BLOCK_K=64, num_stages=4),
         "gu-lanes": var("gemv_gated", P._VGU, FMA_T=5, ROW_SUMS="lanes", DOT_PRE=0),
         "q-s8": var("gemv", P._VQ, SPLIT_K_DOT=8),
         "q-k64": var("gemv", P._VQ, BLOCK_K=64, num_stages=4),
         "o-s4": var("gemv", P._VO, SPLIT_K_DOT=4),
         "d-s4": var("gemv", P._VD, SPLIT_K_DOT=4, BLOCK_K=128, num_stages=3)}
    for tag, ov in V.items():
        P._both_tunings(f"qwen3-4b-v5-{tag}", SERVED_ARTIFACTS / f"qwen3-4b-v5-{tag}",
                        model_dir=str(P.served_config("qwen3-4b")), narrow_tokens=5, check_checkpoint=False,
                        tuning_overlay=ov)
