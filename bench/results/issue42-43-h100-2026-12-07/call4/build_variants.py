import sys
sys.path.insert(0, "tests/gpu")
import prepare as P
if __name__ == "__main__":
    from infc.backend import SERVED_ARTIFACTS
    pre = P.VERIFY_AB["pre"]
    best = {t: dict(e) for t, e in pre.items()}
    best["gemv_gated"][P._VGU] = {**best["gemv_gated"][P._VGU], "SPLIT_K_DOT": 1}
    def var(**per):
        o = {t: dict(e) for t, e in best.items()}
        for key, over in per.items():
            tpl = "gemv_gated" if key == "GU" else "gemv"
            k = {"Q": P._VQ, "O": P._VO, "D": P._VD, "GU": P._VGU}[key]
            o[tpl][k] = {**o[tpl][k], **over}
        return o
    V = {"best": best,
         "park": var(Q={"PARK": "store"}, O={"PARK": "store"}, D={"PARK": "store"}),
         "q32": var(Q={"BLOCK_N_DOT": 32, "SPLIT_K_DOT": 2}),
         "q1": var(Q={"SPLIT_K_DOT": 1}),
         "od32": var(O={"BLOCK_N_DOT": 32, "SPLIT_K_DOT": 2}, D={"BLOCK_N_DOT": 32, "SPLIT_K_DOT": 2})}
    for tag, ov in V.items():
        P._both_tunings(f"qwen3-4b-v5-{tag}", SERVED_ARTIFACTS / f"qwen3-4b-v5-{tag}",
                        model_dir=str(P.served_config("qwen3-4b")), narrow_tokens=5, check_checkpoint=False,
                        tuning_overlay=ov)
    P._both_tunings("qwen3-4b-fp8-park", SERVED_ARTIFACTS / "qwen3-4b-fp8-park", model_dir=str(P.quant_config("qwen3-4b-fp8")),
                    check_checkpoint=False, tuning_overlay={t: {"default": {"PARK": "store"}} for t in ("gemv", "gemv_gated")})
