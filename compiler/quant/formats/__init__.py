"""Published quantization formats, read from config.json's `quantization_config`.

Each format module registers a parser for its `quant_method`; a parser checks the config (an
unknown or inconsistent key fails naming it) and returns a QuantFormat, which answers, for a
checkpoint module (its weight's name without `.weight`):

    scheme_for(module)             the QuantScheme its weight is stored in, or None where the
                                   checkpoint leaves it unquantized (its ignore lists)
    expert_scheme_for(module)      the same for a routed MoE expert's projection (fp8's
                                   expert_dtype: fp4 experts beside fp8 linears)
    sources(module, scheme, n, k)  where each canonical tensor comes from: {"codes": recipe,
                                   "w_scale": recipe, ...} (runtime/weights/quant_recipes.py
                                   turns the stored tensors into the canonical form,
                                   compiler/quant/scheme.py)
    tensors(module)                the checkpoint tensors it stores for a quantized module, with
                                   their expected dtypes (checkpoint honesty)

Where the build reads a checkpoint, the format sees its headers first (see_checkpoint): what a
config leaves to the tensors (fp8's scale spelling, the modules a checkpoint keeps bf16 without
listing them) is read from them.
"""
from ...contract.errors import ModelDirError
from ..format_base import FORMATS, QuantFormat  # noqa: F401  (the registry the modules fill)
from . import awq, compressed_tensors, fp8_block, gptq, mxfp4  # noqa: F401


def parse_quantization(config: dict, where: str, nested=()) -> QuantFormat | None:
    """The checkpoint's format (None: not quantized). where: the config.json path, for errors;
    nested: the spec's nested_config objects, where a wrapper's text model may keep its
    quantization_config (Kimi-K2.5's is under text_config)."""
    q = config.get("quantization_config")
    for n in nested:
        if q is None and isinstance(config.get(n), dict):
            q = config[n].get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ModelDirError(f"{where}: quantization_config must be an object, got {type(q).__name__}")
    method = q.get("quant_method")
    top = config.get("expert_dtype")
    if top is not None and method == "fp8":
        # DeepSeek-V4 ships its experts' format beside the quantization_config, not in it (V4.1
        # moves it in; transformers' DeepseekV4Config folds it in alike): one key, read where it is
        if q.get("expert_dtype", top) != top:
            raise ModelDirError(f"{where}: expert_dtype {top!r} and quantization_config.expert_dtype "
                                f"{q['expert_dtype']!r} disagree")
        if top not in ("fp8", "fp4"):
            raise ModelDirError(f"{where}: expert_dtype {top!r}: must be one of 'fp8', 'fp4'")
        q = {**q, "expert_dtype": top}
    if method not in FORMATS:
        raise ModelDirError(f"{where}: quantization_config.quant_method {method!r} is not a format "
                            f"infc reads (it reads: {', '.join(sorted(FORMATS))})")
    return FORMATS[method](q, where)

