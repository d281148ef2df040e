"""The load recipes that read a quantized checkpoint tensor (runtime/weights/quant_recipes.py),
as checkpoint honesty (compiler/checkpoint_check.py) checks them from the headers alone:

    LEAVES[kind] = (stored dtypes, canonical(src, stored shape) -> the shape the recipe builds)

src[kind] is the tensor's name pattern; canonical() says how a packed format's stored shape
becomes the weight's logical one (the check then compares it with the plan's), or returns a
message when the stored shape cannot be the format's.
"""


def _same(src, shape):
    return tuple(shape)


LEAVES = {
    "fp8": (("F8_E4M3",), _same),
}
