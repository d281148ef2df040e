"""What a quantization format module provides (compiler/quant/formats/): a parser registered for
its quant_method, returning a QuantFormat."""
FORMATS: dict = {}          # quant_method -> parser(config: dict, where: str) -> QuantFormat


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

    def scheme_for(self, module: str):
        raise NotImplementedError

    def sources(self, module: str, scheme, n: int, k: int) -> dict:
        raise NotImplementedError

    def tensors(self, module: str, scheme) -> dict:
        """checkpoint tensor name -> (allowed safetensors dtypes) for a quantized module."""
        raise NotImplementedError
