"""Offline API in the convention users know::

    from planaria.engine import LLM, SamplingParams
    llm = LLM(model="path/to/hf-dir", max_num_seqs=32)
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=32, temperature=0))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason

A bad prompt or bad parameters fail that request only: its output has
``finish_reason == "error"`` and ``.error`` says why; the other requests complete.

``SamplingParams(n=4)``: the prompt runs as 4 engine requests that share one prefill
(``group_id``, engine/prefix_groups.py), sibling j seeded ``seed + j``; ``out.outputs``
holds the 4 completions (``out`` itself is the first, as with n = 1).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import msgspec

from planaria.engine.config import EngineConfig
from planaria.engine.core import create_engine_core
from planaria.engine.detokenizer import IncrementalDetokenizer
from planaria.engine.errors import InvalidRequestError
from planaria.engine.messages import EngineCoreRequest, Logprobs
from planaria.engine.sampling_params import SamplingParams, sibling_params


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[Logprobs] | None = None
    # SamplingParams.prompt_logprobs, one per prompt token as in vLLM: None for the first,
    # then Logprobs whose token_ids[0] is that prompt token
    prompt_logprobs: list[Logprobs | None] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    siblings: list["RequestOutput"] = field(default_factory=list)  # n > 1: completions 1..n-1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def outputs(self) -> list["RequestOutput"]:  # vLLM's `out.outputs[0].text` shape
        return [self, *self.siblings]


def load_tokenizer(model_dir: str):
    # deferred: transformers is heavy (seconds); importing the engine must not pay it
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def stop_token_ids_for(model_dir: str, tokenizer) -> tuple[int | None, list[int]]:
    """(eos id, extra ids that also end generation) from generation_config.json / tokenizer."""
    # deferred: transformers is heavy (seconds); importing the engine must not pay it
    from transformers import GenerationConfig

    extra: list[int] = []
    eos = tokenizer.eos_token_id
    try:
        gen = GenerationConfig.from_pretrained(model_dir)
        ids = gen.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        if eos is None and ids:
            eos = ids[0]
        extra = [i for i in ids if i != eos]
    except OSError:
        pass
    return eos, extra


class LLM:
    def __init__(self, model: str, tokenizer: str | None = None, **engine_args) -> None:
        self.config = EngineConfig(model=model, **engine_args)
        self.core = create_engine_core(self.config)
        self.tokenizer = load_tokenizer(tokenizer or model)
        self.eos_token_id, self.extra_stop_ids = stop_token_ids_for(model, self.tokenizer)
        self._ids = itertools.count()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 priority: list[int] | None = None,
                 structured_output: dict | list[dict | None] | None = None) -> list[RequestOutput]:
        """``structured_output``: one spec for every prompt, or one (or None) per prompt
        (see engine/structured_output.py)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequestError("sampling_params list must be as long as prompts")
        specs = structured_output if isinstance(structured_output, list) else [structured_output] * len(prompts)
        if len(specs) != len(prompts):
            raise InvalidRequestError("structured_output list must be as long as prompts")
        outputs: dict[str, RequestOutput] = {}
        detoks: dict[str, IncrementalDetokenizer] = {}
        order = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            rid = f"llm-{next(self._ids)}"
            order.append(rid)
            text = prompt if isinstance(prompt, str) else None
            try:
                ids = self._tokenize(prompt)
                self.core.check_prompt(ids)
            except InvalidRequestError as exc:
                outputs[rid] = RequestOutput(rid, text, [], finish_reason="error", error=str(exc))
                continue
            outputs[rid] = RequestOutput(rid, text, ids)
            if not isinstance(params, SamplingParams):
                outputs[rid].finish_reason, outputs[rid].error = (
                    "error", f"sampling_params must be SamplingParams, got {type(params).__name__}")
                continue
            engine_params = params
            if self.extra_stop_ids and not params.ignore_eos:
                engine_params = msgspec.structs.replace(
                    params, stop_token_ids=list(params.stop_token_ids) + self.extra_stop_ids)
            n = params.n if isinstance(params.n, int) and not isinstance(params.n, bool) and 1 < params.n <= 256 \
                else 1  # a bad n is the engine's to refuse
            if n > 1:
                engine_params = msgspec.structs.replace(engine_params, n=1)
            for j in range(n):
                crid = rid if j == 0 else f"{rid}.{j}"
                if j:
                    outputs[crid] = RequestOutput(crid, text, ids)
                    outputs[rid].siblings.append(outputs[crid])
                try:
                    detoks[crid] = IncrementalDetokenizer(self.tokenizer, ids, params)
                except Exception as exc:  # a detokenizer failure is this request's error only
                    outputs[crid].finish_reason, outputs[crid].error = "error", f"detokenizer: {exc}"
                    continue
                self.core.add_request(EngineCoreRequest(
                    request_id=crid, prompt_token_ids=ids, eos_token_id=self.eos_token_id,
                    sampling_params=sibling_params(engine_params, j),
                    priority=priority[i] if priority else 0, structured_output=specs[i],
                    group_id=rid if n > 1 else None))
        while self.core.has_unfinished_requests():
            outs, _ = self.core.step()
            for o in outs:
                ro = outputs[o.request_id]
                if ro.finished:
                    continue
                det = detoks.get(o.request_id)
                ro.token_ids.extend(o.new_token_ids)
                ro.num_cached_tokens = o.num_cached_tokens
                if o.new_logprobs:
                    ro.logprobs = (ro.logprobs or []) + list(o.new_logprobs)
                if o.prompt_logprobs is not None:
                    ro.prompt_logprobs = [None, *o.prompt_logprobs]
                stop_str = det.update(o.new_token_ids) if det is not None and o.new_token_ids else None
                if stop_str is not None:
                    ro.finish_reason, ro.stop_reason = "stop", stop_str
                    self.core.abort_requests([o.request_id])
                elif o.finish_reason is not None:
                    ro.finish_reason, ro.stop_reason, ro.error = o.finish_reason, o.stop_reason, o.error
                if ro.finished and det is not None:
                    det.flush()
                    ro.text = det.output_text
        # outputs of requests aborted for a stop string arrive as "abort": keep "stop".
        return [outputs[rid] for rid in order]

    def embed(self, texts, truncate: bool = True) -> list[list[float]]:
        """Embeddings of a pooling model (runner_type "pooling"), one vector per text (or
        list of token ids). ``truncate`` cuts inputs to max_model_len, as
        sentence-transformers does; else a too-long input raises InvalidRequestError."""
        if not self.core.is_pooling:
            raise InvalidRequestError("embed() needs a pooling model (runner_type='pooling')")
        if isinstance(texts, str) or (isinstance(texts, list) and texts and isinstance(texts[0], int)):
            texts = [texts]
        limit = self.core.max_model_len
        rids = []
        for item in texts:
            ids = (self.tokenizer.encode(item, add_special_tokens=True, truncation=truncate, max_length=limit)
                   if isinstance(item, str) else list(item))
            self.core.check_prompt(ids)
            rids.append(f"embed-{next(self._ids)}")
            self.core.add_request(EngineCoreRequest(request_id=rids[-1], prompt_token_ids=ids,
                                                    sampling_params=SamplingParams(max_tokens=1)))
        vectors: dict[str, list[float]] = {}
        while self.core.has_unfinished_requests():
            for o in self.core.step()[0]:
                if o.finish_reason == "error":
                    raise InvalidRequestError(o.error or "embedding failed")
                vectors[o.request_id] = o.pooled
        return [vectors[r] for r in rids]

    def _tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
        if isinstance(prompt, list):
            return prompt  # validated by the engine core
        raise InvalidRequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
