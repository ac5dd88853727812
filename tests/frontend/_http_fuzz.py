"""The HTTP API fuzz, shared by tests/frontend/test_http_fuzz.py (a few hundred examples)
and bench/http_fuzz.py (10,000 and more): hypothesis strategies for OpenAI request bodies
built from the protocol structs' fields plus hostile values, and the properties every
answer must have.

``cases()`` draws ``Case(path, body: bytes)``: a JSON object whose keys are the route's
fields (and some unknown ones) and whose values are sane for the field or hostile (huge
integers, NaN/Infinity literals, wrong types, deep nesting, long strings, lone
surrogates), or raw junk (empty, bad JSON, invalid UTF-8). ``max_tokens`` is kept small.

``send(base, case)`` posts it and returns an ``Outcome``; ``problems(outcome)`` lists what
is wrong with it: a 5xx, a rejection whose body is not an OpenAI error naming its reason,
an error event inside a 200 stream.
"""

from __future__ import annotations

import http.client
import json
import math
import urllib.parse
from dataclasses import dataclass, field

import msgspec
from hypothesis import strategies as st

from planaria.frontend.embeddings import EmbeddingRequest
from planaria.frontend.protocol import ChatCompletionRequest, CompletionRequest
from planaria.frontend.tokenization import DetokenizeRequest, TokenizeRequest

ROUTES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/v1/embeddings": EmbeddingRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
MAX_TOKENS = 4


@dataclass
class Case:
    path: str
    body: bytes
    headers: dict = field(default_factory=dict)  # extra request headers (values may be bytes)


@dataclass
class Outcome:
    case: Case
    status: int
    body: bytes
    sse_errors: list[dict] = field(default_factory=list)


# -- values ------------------------------------------------------------------------------
class Raw:
    """A JSON fragment written as is (NaN, Infinity, a 10,000-deep nest, a lone surrogate)."""

    def __init__(self, text: str) -> None:
        self.text = text


def _dumps(value) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {_dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_dumps(v) for v in value) + "]"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return json.dumps(value)


huge_ints = st.one_of(st.integers(), st.sampled_from([2**63 - 1, 2**63, 2**64, 2**70, -(2**63) - 1, -(2**70),
                                                       10**100, -1, 0, 2**31, 2**32]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e308, -1e308, 5e-324, 1e-5]))
strings = st.one_of(st.text(max_size=40), st.text(alphabet=st.characters(codec="utf-8"), max_size=20),
                    st.integers(1, 50_000).map(lambda n: "a" * n))
raw_fragments = st.sampled_from([
    Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw('"\\ud800"'), Raw('"\\udfff x"'), Raw("1e400"),
    Raw("-0"), Raw("1" * 400), Raw("[" * 40 + "]" * 40), Raw("[" * 5000 + "]" * 5000),
    Raw('{"a":' * 300 + "1" + "}" * 300), Raw('"\\u0000"'), Raw("[1, 2"), Raw("tru")])
scalars = st.one_of(st.none(), st.booleans(), huge_ints, floats, strings)
json_values = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner,
                                                                                  max_size=4)),
    max_leaves=12)
hostile = st.one_of(json_values, json_values, json_values, raw_fragments)

token_ids = st.lists(st.one_of(st.integers(0, 500), huge_ints), min_size=0, max_size=8)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "user", "system", "assistant", "developer", "tool", "robot"]),
     "content": st.one_of(strings, strings, st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "text", "image_url"]), "text": strings}), max_size=3))},
    optional={"name": strings, "tool_call_id": strings})
prompt_text = st.text(min_size=1, max_size=60)
prompt_ids = st.lists(st.integers(0, 1000), min_size=1, max_size=12)

# sane values per field, where a field wants something particular
SANE = {
    "model": st.sampled_from(["tiny-moe", "nope"]), "max_tokens": st.integers(1, MAX_TOKENS),
    "max_completion_tokens": st.integers(1, MAX_TOKENS), "temperature": st.one_of(st.floats(0, 2),
                            st.sampled_from([1e-5, 1.0001e-5, 1e-300, 1e308, 5e-324])),
    "top_p": st.floats(0.01, 1), "n": st.one_of(st.just(1), st.integers(0, 4), st.sampled_from([17, 2**63 - 1])),
    "best_of": st.one_of(st.integers(0, 5), st.just(17)), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
    "stop": st.one_of(strings, st.lists(strings, max_size=20)), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "seed": huge_ints, "top_k": st.one_of(st.integers(-1, 1000),
                      st.sampled_from([2**31, 2**62, 2**63 - 1])),
    "min_p": st.floats(0, 1), "repetition_penalty": st.one_of(st.floats(0.01, 10),
                                   st.sampled_from([1e-300, 5e-324, 1e308])),
    "stop_token_ids": token_ids, "allowed_token_ids": token_ids, "tokens": token_ids,
    "logit_bias": st.dictionaries(st.one_of(st.integers(0, 500).map(str), strings),
                                  st.one_of(st.floats(-150, 150), floats), max_size=6),
    "bad_words": st.lists(st.one_of(strings, st.sampled_from(["a", " the", "x y"])), max_size=4),
    "logprobs": st.one_of(st.integers(0, 25), st.booleans()),
    "top_logprobs": st.integers(0, 25), "min_tokens": st.one_of(st.integers(0, 5), st.just(2**63 - 1)),
    "priority": huge_ints,
    "prompt": st.one_of(prompt_text, prompt_text, strings, st.lists(prompt_text, min_size=1, max_size=3),
                        prompt_ids, st.lists(prompt_ids, min_size=1, max_size=3), token_ids),
    "input": st.one_of(strings, st.lists(strings, max_size=3), token_ids, st.lists(token_ids, max_size=3)),
    "messages": st.lists(message, min_size=1, max_size=4),
    "response_format": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
                                 st.fixed_dictionaries({"type": st.just("json_schema"),
                                                        "json_schema": st.fixed_dictionaries(
                                                            {"name": st.just("x"), "schema": json_values})})),
    "guided_choice": st.lists(strings, max_size=3), "guided_regex": st.sampled_from(["a+", "[0-9]{1,3}", "(", ""]),
    "chat_template_kwargs": st.dictionaries(
        st.sampled_from(["enable_thinking", "add_generation_prompt", "chat_template", "tokenize"]), json_values,
        max_size=2),
    "encoding_format": st.sampled_from(["float", "base64", "hex"]),
    "tools": st.lists(st.sampled_from([
        {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "now"}}]), max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "now"}}]),
    "parallel_tool_calls": st.booleans(),
}
REQUIRED = {"/v1/completions": "prompt", "/v1/chat/completions": "messages", "/v1/embeddings": "input",
            "/tokenize": "prompt", "/detokenize": "tokens"}


def _fields(struct) -> list[str]:
    return list(struct.__struct_fields__)


@st.composite
def json_case(draw, routes: tuple[str, ...]) -> Case:
    """A JSON object for a route: all sane values (so the engine runs), one hostile value,
    or hostile values anywhere."""
    path = draw(st.sampled_from(routes))
    mode = draw(st.sampled_from(["sane", "sane", "sane", "one_hostile", "hostile"]))
    names = _fields(ROUTES[path])
    if mode != "hostile":
        names = [n for n in names if n in SANE]
    keys = draw(st.lists(st.sampled_from(names + ["unknown_field"]), unique=True, max_size=6))
    required = REQUIRED[path]
    if required not in keys and (mode == "sane" or draw(st.integers(0, 9))):
        keys.append(required)  # usually present: past the decoder is where the work is
    odd = draw(st.sampled_from(keys)) if keys and mode == "one_hostile" else None
    body: dict = {}
    for key in keys:
        sane = SANE.get(key)
        wild = key == odd or sane is None or (mode == "hostile" and draw(st.booleans()))
        body[key] = draw(hostile if mode != "sane" else json_values) if wild else draw(sane)
        if key == "model" and not wild and draw(st.integers(0, 9)):
            body[key] = "tiny-moe"
    if path == "/v1/chat/completions" and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = MAX_TOKENS
    for key in ("max_tokens", "max_completion_tokens"):  # keep generation short
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and MAX_TOKENS < value < 2**63:
            body[key] = MAX_TOKENS
    text = _dumps(body)
    return Case(path, text.encode("utf-8", "surrogatepass"))


junk_bodies = st.one_of(st.just(b""), st.just(b"   "), st.binary(max_size=64),
                        st.sampled_from([b"{", b"[]", b"null", b"{\"prompt\": \"\xff\xfe\"}", b"\xef\xbb\xbf{}",
                                         b'{"prompt": "x", "prompt": 5}', b'{"messages": [' * 50]))


GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions")
TOKEN_ROUTES = ("/tokenize", "/detokenize")
EMBEDDING_ROUTES = ("/v1/embeddings",)


# -- shapes found by the audits (issue 26): each once cost the frontend its event loop ----
@st.composite
def scanner_case(draw, routes: tuple[str, ...]) -> Case:
    """Bodies aimed at the raw-byte pre-scan: an unclosed string of escaped quotes behind
    more than 32 brackets (was quadratic), a trailing lone backslash, brackets inside
    strings, nesting behind strings, a valid body of escaped quotes."""
    path = draw(st.sampled_from(routes))
    n = draw(st.sampled_from([100, 5_000, 100_000, 400_000]))
    depth = draw(st.integers(33, 80))
    shape = draw(st.sampled_from(["unclosed", "backslash", "brackets_in_strings", "nest_behind", "valid"]))
    field_name = REQUIRED[path]
    if shape == "unclosed":
        body = b"[" * depth + b'"' + b'\\"' * n
    elif shape == "backslash":
        body = b"[" * depth + b'"' + b'\\"' * n + b"\\"
    elif shape == "brackets_in_strings":
        body = b'{"%s": "%s", "max_tokens": 1}' % (field_name.encode(), b"[{" * n)
    elif shape == "nest_behind":
        body = (b'{"%s": "%s", "x": %s%s}' % (field_name.encode(), b'\\"[' * min(n, 1000),
                                               b"[" * depth, b"]" * depth))
    else:
        body = b'{"%s": "%s", "max_tokens": 1}' % (field_name.encode(), b'\\"' * min(n, 20_000))
    return Case(path, body)


@st.composite
def id_and_header_case(draw, routes: tuple[str, ...], lead_byte_ids: tuple[int, ...]) -> Case:
    """Huge or control-character request ids, undecodable Authorization headers, and
    generation that never completes a UTF-8 character (one lone lead byte allowed,
    ignore_eos, several choices)."""
    path = draw(st.sampled_from([r for r in routes if r in GENERATION_ROUTES] or list(routes)))
    body: dict = {REQUIRED[path]: "x" if path != "/v1/chat/completions" else [{"role": "user", "content": "x"}],
                  "max_tokens": MAX_TOKENS}
    headers: dict = {}
    kind = draw(st.sampled_from(["request_id", "authorization", "partial_utf8"]))
    if kind == "request_id":
        body["request_id"] = draw(st.one_of(st.integers(300, 200_000).map(lambda n: "r" * n),
                                            st.sampled_from(["a\r\nX-Injected: 1", "\u0000", "é", " ", "a\nb"]),
                                            st.text(max_size=30)))
    elif kind == "authorization":
        headers["Authorization"] = draw(st.sampled_from([b"Bearer \xff\xfe", b"\xc3\x28", b"Bearer \xe9t\xe9",
                                                         b"bearer", b"Basic \x80"]))
    else:
        ids = list(lead_byte_ids) or [draw(st.integers(0, 500))]
        body |= {"allowed_token_ids": [draw(st.sampled_from(ids))], "ignore_eos": True,
                 "n": draw(st.integers(1, 8)), "max_tokens": draw(st.integers(1, 64)),
                 "stream": draw(st.booleans())}
    return Case(path, _dumps(body).encode("utf-8", "surrogatepass"), headers)


def cases(routes: tuple[str, ...] = GENERATION_ROUTES + TOKEN_ROUTES,
          lead_byte_ids: tuple[int, ...] = ()) -> st.SearchStrategy[Case]:
    """Bodies for ``routes`` (/v1/embeddings only where the model is a pooling one).
    ``lead_byte_ids``: token ids that decode to a lone UTF-8 lead byte (the tokenizer's)."""
    junk = st.builds(Case, st.sampled_from(routes), junk_bodies)
    return st.one_of(json_case(routes), json_case(routes), json_case(routes), json_case(routes), junk,
                     scanner_case(routes), id_and_header_case(routes, lead_byte_ids))


# -- sending and judging ------------------------------------------------------------------
def send(base: str, case: Case, headers: dict[str, str] | None = None, timeout_s: float = 120.0) -> Outcome:
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
    try:
        conn.request("POST", case.path, body=case.body,
                     headers={"Content-Type": "application/json", **(headers or {}), **case.headers})
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    out = Outcome(case, resp.status, body)
    if resp.status == 200 and resp.getheader("Content-Type", "").startswith("text/event-stream"):
        for event in body.decode(errors="replace").split("\n\n"):
            data = event.removeprefix("data: ")
            if event.startswith("data: ") and data != "[DONE]":
                obj = json.loads(data)
                if "error" in obj:
                    out.sse_errors.append(obj["error"])
    return out


def problems(out: Outcome) -> list[str]:
    found = []
    if out.status >= 500:
        found.append(f"{out.status}")
    if out.status >= 400:
        try:
            err = msgspec.json.decode(out.body)["error"]
            if not (isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"]):
                found.append("error.message missing or empty")
        except (msgspec.DecodeError, KeyError, TypeError):
            found.append("the rejection's body is not an OpenAI error object")
    found += [f"stream error event {e.get('type')}: {e.get('message')}" for e in out.sse_errors]
    return found


def describe(out: Outcome) -> str:
    return (f"{out.case.path} {out.case.body[:300]!r} -> {out.status} {out.body[:300]!r} "
            f"{problems(out)}")
