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
    method = _method(q, where)
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
    fmt = FORMATS[method](q, where)
    fmt.where = where
    return fmt


def _method(q: dict, where: str) -> str:
    """quantization_config.quant_method, one of FORMATS (a list or an object is no format name:
    it would not even look up)."""
    method = q.get("quant_method")
    key = f"{where}: quantization_config.quant_method"
    if method is None:
        raise ModelDirError(f"{key}: missing (it names the format: {', '.join(sorted(FORMATS))})")
    if not isinstance(method, str):
        raise ModelDirError(f"{key}: {type(method).__name__}: must be a string, one of "
                            f"{', '.join(sorted(FORMATS))}")
    if method not in FORMATS:
        # the published configs spell it in lowercase, and so do transformers' quantizers
        hint = f"; did you mean {method.lower()!r}?" if method.lower() in FORMATS else ""
        raise ModelDirError(f"{key} {method!r} is not a format infc reads (it reads: "
                            f"{', '.join(sorted(FORMATS))}){hint}")
    return method
