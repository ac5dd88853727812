"""Planaria engine core: model execution, paged KV cache, scheduler, offline API."""

from planaria.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name: str):  # lazy: importing engine must not import torch
    if name in ("LLM", "RequestOutput"):
        from planaria.engine import llm

        return getattr(llm, name)
    raise AttributeError(name)
