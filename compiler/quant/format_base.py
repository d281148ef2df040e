"""What a quantization format module provides (compiler/quant/formats/): a parser registered for
its quant_method, returning a QuantFormat."""
import re
from fnmatch import fnmatchcase

from ..contract.errors import ModelDirError
from .config_keys import not_converted

FORMATS: dict = {}          # quant_method -> parser(config: dict, where: str) -> QuantFormat
_INDEX = re.compile(r"\.(?:\d+|\{[ie]\})(?=\.)")
_FLOATS = ("BF16", "F16", "F32", "F64")          # a plain tensor's dtypes (not codes)


def any_layer(name: str) -> str:
    """A tensor name (or a {i} / {e} pattern) with each layer and expert index made `#`."""
    return _INDEX.sub(".#", name)


def scale_tensor(name: str) -> dict:
    """The recipe of a float scale tensor of a quantized weight (its w_scale, a static x_scale):
    read as any tensor, and refused at load where it holds NaN or infinity, as NaN e4m3 codes are
    (runtime/weights/quant_recipes.py check_finite); the formats' sources() read scales so."""
    return {"tensor": name, "finite": True}


def format_parser(*methods: str):
    def register(fn):
        for m in methods:
            FORMATS[m] = fn
        return fn
    return register


class QuantFormat:
    method: str = ""
    where: str = "config.json"          # the config's path, for errors (parse_quantization sets it)
    # glob patterns of tensors the format stores but infc does not read (bookkeeping such as
    # compressed-tensors' weight_shape): checkpoint honesty does not count them as unread
    unread: tuple = ()
    # checkpoint tensor name -> safetensors dtype, where the build read the checkpoint's headers
    # (see_checkpoint); None for a config alone (a variant, --load-format dummy)
    stored: dict | None = None
    _patterns: frozenset = frozenset()
    # transformers' quantizers (fp8, AWQ, GPTQ, MXFP4) never convert the output head, whatever the
    # config lists (get_keys_to_not_convert: the output embeddings), so a checkpoint made through
    # them stores it in bf16 even where its config names no ignore list (DeepSeek-V3, Kimi-K2);
    # compressed-tensors quantizes by its own targets and ignore list (False)
    keeps_output_head: bool = True

    def see_checkpoint(self, stored: dict):
        """The checkpoint's headers, for what its config leaves to the tensors (a format may read
        a spelling or an unquantized module from them)."""
        self.stored = dict(stored)
        self._patterns = frozenset(any_layer(n) for n in stored)

    def stored_patterns(self) -> frozenset:
        """The checkpoint's tensor names with layer and expert indices made `#` (any_layer)."""
        return self._patterns

    def scheme_for(self, module: str):
        raise NotImplementedError

    def missing_note(self, tensor: str) -> tuple[str, bool] | None:
        """For checkpoint honesty's message of a missing checkpoint tensor: which scheme expected it,
        as (text, whether a did-you-mean suggestion still helps), else None. A quantized module's
        tensor is its scheme's; a module's plain `weight` is expected where the config quantizes
        the module with no scheme, which says why where the checkpoint stores the module
        quantized after all (its other tensors are then no misspelling of the weight)."""
        module, _, leaf = tensor.rpartition(".")
        if not module:
            return None
        # (a routed expert's projection, `...experts.3.w1`, may be stored apart: expert_scheme_for)
        s = self.expert_scheme_for(module) if ".experts." in module else self.scheme_for(module)
        if s is not None:
            if tensor not in self.tensors(module, s):
                return None
            return f"{self.scheme_name(module, s)} reads it", True
        if leaf != "weight" or self.stored is None:
            return None
        # the module's codes: a tensor of its in an integer or fp8 dtype (a bias is float)
        codes = sorted(n for n, dt in self.stored.items() if n.startswith(module + ".") and dt not in _FLOATS
                       and not any(fnmatchcase(n, p) for p in self.unread))
        if not codes:
            return None
        return (f"quantization_config quantizes '{module}' with no scheme ({self.unquantized_why(module)}), "
                f"so its weight is read unquantized, but the checkpoint stores it quantized: "
                f"{', '.join(f'{n!r} ({self.stored[n]})' for n in codes[:3])}", False)

    def scheme_name(self, module: str, scheme) -> str:
        """The scheme a module's tensors are read in, as the config names it (for messages)."""
        return f"quantization_config's {self.method} scheme ({scheme})"

    def unquantized_why(self, module: str) -> str:
        """Why the config quantizes `module` with no scheme (for messages)."""
        if not_converted(module, getattr(self, "skip", ())):
            return "its modules_to_not_convert / ignore list names it"
        return "the config leaves it unquantized"

    def act_group_error(self, scheme, why: str):
        """The error naming the config key that sets `scheme`'s activation group, which the GPU
        kernels refuse (`why`: compiler/quant/kernel_limits.py)."""
        return ModelDirError(f"{self.where}: quantization_config: activations quantized in groups of "
                             f"{scheme.act_group} columns ({scheme}): {why}")

    def expert_scheme_for(self, module: str):
        """The scheme of a routed MoE expert's projection (module: one expert's, `...experts.3.w1`):
        a format may store the routed experts apart from the other linears (fp8's expert_dtype)."""
        return self.scheme_for(module)

    def sources(self, module: str, scheme, n: int, k: int) -> dict:
        raise NotImplementedError

    def param_sources(self, param: str, scheme) -> dict:
        """The canonical tensors' recipes of one [E, K, N] expert parameter `param` (transformers
        5's fused expert layout), each [E, N, ...] as the format stores it; formats that publish no
        such layout leave this unimplemented."""
        raise NotImplementedError

    def tensors(self, module: str, scheme) -> dict:
        """checkpoint tensor name -> (allowed safetensors dtypes) for a quantized module: what its
        sources' recipes read (compiler/quant/leaves.py; plain tensors are float). The names do not
        depend on the weight's shape, so the sources of a nominal 1 x 1 weight name them."""
        from ..checkpoint_check import READABLE_DTYPES
        from .leaves import LEAVES
        out = {}

        def walk(src):
            for key, v in src.items():
                if isinstance(v, str) and (key == "tensor" or key in LEAVES):
                    out[v] = READABLE_DTYPES if key == "tensor" else LEAVES[key][0]
                elif isinstance(v, dict):
                    walk(v)
        for src in self.sources(module, scheme, 1, 1).values():
            walk(src)
        return out
