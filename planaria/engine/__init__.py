"""Planaria engine core: model execution, paged KV cache, scheduler, offline API."""

from planaria.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name: str):
    if name in ("LLM", "RequestOutput"):
        # deferred: llm imports torch; importing the engine package must not
        from planaria.engine import llm

        return getattr(llm, name)
    raise AttributeError(name)
