"""What a quantization format module provides (compiler/quant/formats/): a parser registered for
its quant_method, returning a QuantFormat."""
import re

FORMATS: dict = {}          # quant_method -> parser(config: dict, where: str) -> QuantFormat
_INDEX = re.compile(r"\.(?:\d+|\{[ie]\})(?=\.)")


def any_layer(name: str) -> str:
    """A tensor name (or a {i} / {e} pattern) with each layer and expert index made `#`."""
    return _INDEX.sub(".#", name)


def format_parser(*methods: str):
    def register(fn):
        for m in methods:
            FORMATS[m] = fn
        return fn
    return register


class QuantFormat:
    method: str = ""
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
