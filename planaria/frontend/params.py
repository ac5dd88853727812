"""Request struct -> what the engine gets: SamplingParams, structured output, priority.

Pure: no tokenizer, no sockets. ``sampling_params(req, vocab_size=, max_logprobs=)`` rejects
what this server does not support (``suffix``, audio ...) and every bad value with a
``RequestError`` naming the field; ``fit_max_tokens`` applies the context limit once the
prompt length is known (vLLM's rule: a prompt that leaves no room for one generated token
is an error, otherwise max_tokens is capped to the room left).
The sizes of ``stop``, ``stop_token_ids``, ``logit_bias`` and ``bad_words`` are bounded by
``limits.RequestLimits``.

``logit_bias`` is OpenAI's map of token id (a JSON string key) to bias; biases are clamped
to [-100, 100] as OpenAI and vLLM do, keys must be decimal token ids inside the
vocabulary. ``bad_words`` are checked here (``check_bad_words``) and tokenized by the
caller (``prompts.tokenize_bad_words``, it has the tokenizer), whose token sequences
``sampling_params`` takes as ``bad_words_token_ids``.

``n`` and ``best_of`` (``num_choices``): each prompt runs as ``best_of`` (default ``n``)
engine requests of n = 1 that share one prefill (a ``group_id``, engine/prefix_groups.py);
with a ``seed``, sibling j samples with ``seed + j`` (as vLLM seeds its child requests), so
every choice is reproducible and differs from its siblings. ``best_of > n`` returns the n
with the highest cumulative logprob (not with ``stream``, as in vLLM).
"""

from __future__ import annotations

import json
import math
import re

import msgspec

from planaria.engine.errors import InvalidRequestError
from planaria.engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from planaria.frontend.errors import RequestError
from planaria.frontend.limits import RequestLimits
from planaria.frontend.protocol import ChatCompletionRequest, CompletionRequest, _CommonRequest

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat top_logprobs

_FIELD_RE = re.compile(r"^(?:stop token id|prompt token id)|^([a-z_]+) ")


def _or(value, default):
    return default if value is None else value


def _reject_unsupported(req: _CommonRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options can only be set when stream is true", param="stream_options")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise RequestError("suffix is not supported by this server", param="suffix")
    if isinstance(req, ChatCompletionRequest):
        if req.modalities and any(m != "text" for m in req.modalities):
            raise RequestError("only the text modality is supported", param="modalities")
        if req.audio is not None:
            raise RequestError("audio output is not supported", param="audio")


def _chat_logprobs(req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise RequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}",
                               param="top_logprobs")
    return _or(req.top_logprobs, 0) if req.logprobs else None


def _prompt_logprobs(req: _CommonRequest, logprobs: int | None, max_logprobs: int) -> int | None:
    """The engine's ``prompt_logprobs``: vLLM's field of that name (a non-streamed
    response's ``prompt_logprobs``; refused with ``stream`` as vLLM does), and for a
    completion with ``echo`` and ``logprobs`` at least ``logprobs`` (the echoed prompt's
    tokens carry logprobs too). Each view trims the engine's top-n to its own."""
    n = req.prompt_logprobs
    if n is not None:
        if not 0 <= n <= max_logprobs:
            raise RequestError(f"prompt_logprobs must be an integer in [0, {max_logprobs}], got {n}",
                               param="prompt_logprobs")
        if req.stream and n > 0:
            raise RequestError("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
        if req.stream:
            n = None  # 0 with a stream: nothing to show (vLLM accepts it too)
    if isinstance(req, CompletionRequest) and req.echo and logprobs is not None:
        n = max(n or 0, logprobs)  # a bad logprobs is named by validate(), which checks it first
    return n


def check_prompt_logprobs_size(num_top: int | None, prompt_lens: list[int], copies: int,
                               limits: RequestLimits) -> None:
    """Prompt logprobs cost (prompt tokens - 1) x (top-n + 1) numbers per prompt, in the
    engine's output message, the frontend's memory and the body; ``copies``: the engine
    requests per prompt that each compute them (an echo with logprobs and n > 1)."""
    if num_top is None:
        return
    values = copies * (num_top + 1) * sum(max(0, n - 1) for n in prompt_lens)
    if values > limits.max_prompt_logprob_values:
        raise RequestError(
            f"prompt_logprobs of {sum(prompt_lens)} prompt tokens with top {num_top}"
            + (f" for {copies} choices each" if copies > 1 else "")
            + f" would return {values} values; the limit is {limits.max_prompt_logprob_values}: "
            "ask for fewer top logprobs, fewer choices or a shorter prompt", param="prompt_logprobs")


def _check_sizes(stop: list[str], stop_token_ids: list[int], limits: RequestLimits) -> None:
    if len(stop) > limits.max_stop:
        raise RequestError(f"stop holds at most {limits.max_stop} strings, got {len(stop)}", param="stop")
    for s in stop:
        if len(s) > limits.max_stop_chars:
            raise RequestError(f"each stop string has at most {limits.max_stop_chars} characters, got "
                               f"{len(s)}", param="stop")
    if len(stop_token_ids) > limits.max_stop_token_ids:
        raise RequestError(f"stop_token_ids holds at most {limits.max_stop_token_ids} ids, got "
                           f"{len(stop_token_ids)}", param="stop_token_ids")


_MAX_KEY_DIGITS = 20  # longer than any token id (and than int() should be asked to parse)


def logit_bias(raw: dict[str, float] | None, limits: RequestLimits = RequestLimits()) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` as {token id: bias in [-100, 100]}; None when empty. The ids'
    range is checked against the vocabulary in ``SamplingParams.validate``."""
    if not raw:
        return None
    if len(raw) > limits.max_logit_bias:
        raise RequestError(f"logit_bias holds at most {limits.max_logit_bias} entries, got {len(raw)}",
                           param="logit_bias")
    out: dict[int, float] = {}
    for key, value in raw.items():
        if not (key.isascii() and key.isdigit() and len(key) <= _MAX_KEY_DIGITS):
            raise RequestError(f"logit_bias keys must be token ids (decimal integers), got {key[:40]!r}",
                               param="logit_bias")
        if not math.isfinite(value):
            raise RequestError(f"logit_bias of token {key} must be a finite number, got {value}",
                               param="logit_bias")
        out[int(key)] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(value)))
    return out


def num_choices(req: _CommonRequest, num_prompts: int = 1,
                limits: RequestLimits = RequestLimits()) -> tuple[int, int]:
    """(n, best_of) for ``req``: choices returned and generated per prompt."""
    n = _or(req.n, 1)
    if not 1 <= n <= limits.max_n:
        raise RequestError(f"n must be an integer in [1, {limits.max_n}], got {n}", param="n")
    best_of = _or(getattr(req, "best_of", None), n)
    if not n <= best_of <= limits.max_n:
        raise RequestError(f"best_of must be an integer in [n, {limits.max_n}] (n = {n}), got {best_of}",
                           param="best_of")
    if best_of > n and req.stream:
        raise RequestError("best_of greater than n is not supported with stream (the best are known at "
                           "the end)", param="best_of")
    if num_prompts * best_of > limits.max_choices:
        raise RequestError(f"{num_prompts} prompt(s) x {best_of} choices is more than the {limits.max_choices} "
                           "sequences one request may generate", param="best_of" if best_of > n else "n")
    return n, best_of


def check_bad_words(words: list[str] | None, limits: RequestLimits = RequestLimits()) -> list[str]:
    """The request's ``bad_words`` (empty when none), sizes and contents checked."""
    if not words:
        return []
    if len(words) > limits.max_bad_words:
        raise RequestError(f"bad_words holds at most {limits.max_bad_words} words, got {len(words)}",
                           param="bad_words")
    for w in words:
        if len(w) > limits.max_bad_word_chars:
            raise RequestError(f"each bad word has at most {limits.max_bad_word_chars} characters, got "
                               f"{len(w)}", param="bad_words")
        if not w.strip():
            raise RequestError("bad_words must not hold empty or blank words", param="bad_words")
    return list(words)


def sampling_params(req: _CommonRequest, *, vocab_size: int | None = None, max_logprobs: int = 20,
                    limits: RequestLimits = RequestLimits(),
                    bad_words_token_ids: list[list[int]] | None = None) -> SamplingParams:
    """The engine's SamplingParams for ``req``, validated; RequestError names the bad field.
    ``bad_words_token_ids``: ``req.bad_words`` tokenized (``prompts.tokenize_bad_words``)."""
    _reject_unsupported(req)
    if check_bad_words(req.bad_words, limits) and bad_words_token_ids is None:
        raise ValueError("sampling_params: bad_words must be tokenized by the caller (bad_words_token_ids)")
    if req.allowed_token_ids is not None and vocab_size is not None and len(req.allowed_token_ids) > vocab_size:
        raise RequestError(f"allowed_token_ids holds at most {vocab_size} ids (the vocabulary), got "
                           f"{len(req.allowed_token_ids)}", param="allowed_token_ids")
    if isinstance(req, ChatCompletionRequest):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        logprobs = _chat_logprobs(req)
    else:
        max_tokens = _or(req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS)
        max_tokens_param = "max_tokens"
        logprobs = req.logprobs
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    _check_sizes(stop, req.stop_token_ids or [], limits)
    params = SamplingParams(
        n=1, max_tokens=max_tokens, min_tokens=_or(req.min_tokens, 0),  # n > 1: a request per choice
        temperature=_or(req.temperature, 1.0), top_p=_or(req.top_p, 1.0), top_k=_or(req.top_k, 0),
        min_p=_or(req.min_p, 0.0), seed=req.seed, stop=stop, stop_token_ids=frozenset(req.stop_token_ids or ()),
        ignore_eos=bool(req.ignore_eos), logprobs=logprobs,
        prompt_logprobs=_prompt_logprobs(req, logprobs, max_logprobs),
        repetition_penalty=_or(req.repetition_penalty, 1.0),
        presence_penalty=_or(req.presence_penalty, 0.0), frequency_penalty=_or(req.frequency_penalty, 0.0),
        skip_special_tokens=_or(req.skip_special_tokens, True),
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        logit_bias=logit_bias(req.logit_bias, limits),
        allowed_token_ids=None if req.allowed_token_ids is None else list(req.allowed_token_ids),
        bad_words_token_ids=bad_words_token_ids or None,
    )
    try:
        params.validate(vocab_size, max_logprobs)
    except InvalidRequestError as exc:
        msg = str(exc)
        m = _FIELD_RE.match(msg)
        param = None
        if m:
            param = m.group(1) or "stop_token_ids"
            if param == "max_tokens":
                param = max_tokens_param
            elif param == "bad_words_token_ids":
                param = "bad_words"
            elif param == "logprobs" and isinstance(req, ChatCompletionRequest):
                param = "top_logprobs"
        raise RequestError(msg, param=param) from exc
    return params


def structured_output(req: _CommonRequest) -> dict | None:
    """The engine's structured-output spec, from response_format or vLLM's guided_* fields.

    ``{"type": "json_schema" | "json_object" | "regex" | "choice" | "grammar", "value": ...}``;
    the engine decides whether it can honour it.
    """
    specs = []
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema") if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise RequestError("response_format json_schema needs json_schema.schema (an object)",
                                   param="response_format")
            specs.append({"type": "json_schema", "value": json.dumps(schema)})
        elif kind == "json_object":
            specs.append({"type": "json_object", "value": None})
        elif kind != "text":
            raise RequestError(f"response_format type must be 'text', 'json_object' or 'json_schema', "
                               f"got {kind!r}", param="response_format")
    if req.guided_json is not None:
        value = req.guided_json if isinstance(req.guided_json, str) else json.dumps(req.guided_json)
        specs.append({"type": "json_schema", "value": value})
    if req.guided_regex is not None:
        specs.append({"type": "regex", "value": req.guided_regex})
    if req.guided_choice is not None:
        if not req.guided_choice:
            raise RequestError("guided_choice must not be empty", param="guided_choice")
        specs.append({"type": "choice", "value": list(req.guided_choice)})
    if req.guided_grammar is not None:
        specs.append({"type": "grammar", "value": req.guided_grammar})
    if len(specs) > 1:
        raise RequestError("set at most one of response_format (non-text), guided_json, guided_regex, "
                           "guided_choice, guided_grammar", param="response_format")
    return specs[0] if specs else None


def fit_max_tokens(params: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
    """A copy of ``params`` whose max_tokens fits the context; RequestError if the prompt does not."""
    if num_prompt_tokens == 0:
        raise RequestError("the prompt is empty", param="prompt")
    if num_prompt_tokens >= max_model_len:
        raise RequestError(
            f"this model's maximum context length is {max_model_len} tokens, and the prompt has "
            f"{num_prompt_tokens} tokens (leaving no room for a generated token); shorten the prompt",
            param="prompt", code="context_length_exceeded")
    room = max_model_len - num_prompt_tokens
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    return msgspec.structs.replace(params, max_tokens=max_tokens,
                                   min_tokens=min(params.min_tokens, max_tokens))
