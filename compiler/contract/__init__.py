"""The plan contract: what the compiler writes and the runtime reads, in one package that imports
nothing from the runtime (tests/test_layering.py).

    schema.py          the plan's schema name, the tuning manifest's version, dtype sizes, the
                       step metadata every kernel reads, the cache marker
    program.py         the one walker of a plan's programs (the layer repeat)
    caches.py          cache kinds and the one layout of their storage
    bind.py            a kernel's META -> launch arguments and grid
    safetensors_io.py  the checkpoint reader (numpy, bf16 included)
    errors.py          the errors both sides raise (SpecError, ModelDirError)
"""
