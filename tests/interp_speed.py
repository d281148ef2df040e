"""A faster Triton interpreter for the suite, computing exactly what it computed before.

Under TRITON_INTERPRET=1 a kernel launch patches triton.language for the interpreter (every
builtin of tl, tl.tensor and tl.math wrapped, found by inspect.getmembers) and restores it when
the launch ends. Triton 3.6 also re-patches on every call of a @triton.jit helper inside the
kernel, once per program instance and call (interpreter.InterpretedFunction.__call__): the
language is already patched by the launch, so the re-patch changes nothing, yet it was a third of
an interpreted model run (gemma3's tiny model: 21 s of 56 s in _patch_lang, 14,069 calls).

`install()` patches a helper's language modules once per launch: the launch's own (tl), and the
first helper that sees another (triton's standard library sees tl.core) as before; later calls
that see only modules patched during this launch skip it. The launch's own patch and restore are
untouched. Only the thread whose launch set the patch skips: a launch in another thread (the
rank threads of tests/test_cuda_ranks.py) and its helpers run exactly as before.

It also turns off the interpreter's integer-overflow "sanitizer" where it checks nothing: with
InterpreterOptions.debug False (the default) semantic.binary_op_sanitize_overflow_impl still
recomputes every int32 add, sub and mul in int64 and compares it with the bounds, and then
device_assert drops the assertion (it returns at once unless debug): another third of that run.
"""
import dataclasses
import inspect
import threading


class _Unchanged:
    def restore(self):
        pass


def install():
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_infc_fast_patch", False):
        return
    original = interpreter._patch_lang
    # the thread whose launch is running and the ids of the modules patched during it
    state = {"owner": None, "langs": None}

    def lang_ids(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values()
                         if inspect.ismodule(v) and (v is tl or v is tl.core))

    class _LaunchScope:
        def __init__(self, scope):
            self.scope = scope

        def restore(self):
            state["owner"], state["langs"] = None, None
            self.scope.restore()

    def patch_lang(fn):
        langs, me = lang_ids(fn), threading.get_ident()
        if state["owner"] is not None and state["owner"] != me:
            return original(fn)               # another thread's launch is running: as before
        if state["owner"] == me:
            if langs <= state["langs"]:
                return _Unchanged()          # a helper inside a launch: already patched
            state["langs"] = state["langs"] | langs
            return original(fn)               # as before (a helper's scope is never restored)
        state["owner"], state["langs"] = me, langs
        return _LaunchScope(original(fn))

    interpreter._patch_lang = patch_lang
    builder = interpreter.interpreter_builder
    if not builder.options.debug:
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    interpreter._infc_fast_patch = True
