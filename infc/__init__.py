"""infc: an inference compiler for large language models.

    from infc import LLM, SamplingParams
    LLM("path/to/hf-model", device="cpu").generate(["Hello"], SamplingParams(max_tokens=8))
"""
from infc.runtime.engine.sampling import SamplingParams


def __getattr__(name):
    # LLM pulls in the compiler and the executor: import it only when asked for.
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from infc import llm
        return getattr(llm, name)
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams"]
