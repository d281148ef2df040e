import sys, json, shutil, time
sys.path.insert(0, "/work/main/tests/gpu")
KEYS = ["decode|Tx2560;6144x2560;Tx6144", "decode|Tx4096;2560x4096;Tx2560", "decode|Tx9728;2560x9728;Tx2560"]
GKEY = "decode|Tx2560;19456x2560;Tx9728"
VARS = {"t64": {"BLOCK_T": 64}, "t64n128": {"BLOCK_T": 64, "BLOCK_N_DOT": 128, "num_warps": 8}}
def overlay(v):
    return {"gemv": {k: VARS[v] for k in KEYS}, "gemv_gated": {GKEY: VARS[v]}}
if __name__ == "__main__":
    import prepare
    from infc.compiler.build import build, load_tuning
    prepare.stamp_commit()
    cfg = str(prepare.served_config("qwen3-4b"))
    out = prepare.REPO / ".cache" / "artifacts" / "qwen3-4b"
    shutil.rmtree(out, ignore_errors=True)
    tv = prepare.REPO / ".cache" / "tuning-var"
    tv.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    for v in ("t64", "t64n128", None):
        for gpu in ("h100", "h200"):
            build(out=out, gpu=gpu, log=None, model_dir=cfg, tuning_overlay=overlay(v) if v else None)
            t = load_tuning(gpu, overlay(v) if v else None)
            (tv / f"{gpu}-{v or 'base'}.json").write_text(json.dumps(t, indent=1) + "\n")
            print(v, gpu, f"{time.time() - t0:.0f} s", flush=True)
