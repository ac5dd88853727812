"""Structured outputs: grammar-constrained decoding backed by llguidance.

    add_request --(spec)--> submit(): compile on a thread pool; the request waits in the
        scheduler as WAITING_FOR_GRAMMAR
    step start  --> take_ready(): compiled ones join the waiting queue
        (scheduler.grammar_ready), failed ones end with an error output
    execute     --> start_bitmask(reqs) before the forward (masks fill on a thread while
        the model runs), GrammarBitmask.apply(logits) before sampling
    update      --> accept(req, token): advance the matcher; a grammar that can take no
        more tokens ends the request ("stop")

A spec is ``{"type": "json_object" | "json_schema" | "regex" | "choice" | "grammar",
"value": ...}`` (what frontend/params.py builds): json_schema's value is a schema (a dict
or its JSON text), regex's a pattern, choice's a list of strings, grammar's a Lark or
GBNF text. JSON is generated compact (no whitespace) unless the spec says
``"whitespace_flexible": true``: a model may otherwise pad forever.

Replay: ``EngineCoreRequest.structured_output_prefix_tokens`` are tokens already
generated under this grammar (the tail of the prompt); the matcher consumes them before
the first new token. Requests without a spec cost one attribute test per row.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import structlog
import torch

from planaria.engine.errors import GrammarError, InvalidRequestError
from planaria.engine.messages import OutputErrorCode
from planaria.engine.request import Request, RequestStatus

log = structlog.get_logger("planaria.engine.structured_output")

SPEC_TYPES = ("json_object", "json_schema", "regex", "choice", "grammar")
# Nesting levels (objects and arrays) a json_schema may have. Real schemas stay far below;
# llguidance's schema compiler recurses natively and crashes the whole process (SIGSEGV,
# measured at a few thousand levels), so a deeper one is refused up front.
MAX_SCHEMA_DEPTH = 256
_SHIFTS = torch.arange(32, dtype=torch.int32)
_CACHE_SIZE = 64


def grammar_source(spec: dict) -> str:
    """The llguidance grammar text for ``spec``; InvalidRequestError for a malformed spec,
    one nested too deeply included (a schema or regex that does not compile fails later,
    in compile)."""
    if not isinstance(spec, dict) or spec.get("type") not in SPEC_TYPES:
        raise InvalidRequestError(
            f"structured_output must be a dict with type one of {', '.join(SPEC_TYPES)}; got {spec!r:.200}")
    kind, value = spec["type"], spec.get("value")
    compact = {"whitespace_flexible": bool(spec.get("whitespace_flexible", False))}
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=compact)
        if kind == "json_schema":
            if isinstance(value, str):
                value = json.loads(value)
            if not isinstance(value, dict):
                raise InvalidRequestError("json_schema value must be a JSON object (a schema)")
            if json_depth(value, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
                raise InvalidRequestError(f"structured_output json_schema is nested deeper than "
                                          f"{MAX_SCHEMA_DEPTH} levels")
            return llguidance.LLMatcher.grammar_from_json_schema(value, overrides=compact)
        if kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                raise InvalidRequestError("choice value must be a non-empty list of strings")
            return llguidance.grammar_from("choice", json.dumps(value))
        if not isinstance(value, str) or not value:
            raise InvalidRequestError(f"{kind} value must be a non-empty string")
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(value)
        return llguidance.grammar_from("grammar", value)
    except ValueError as exc:  # json.JSONDecodeError included
        raise InvalidRequestError(f"structured_output {kind}: {exc}") from exc
    except RecursionError as exc:  # json.loads of a JSON text nested past the recursion limit
        raise InvalidRequestError(f"structured_output {kind} is nested too deeply") from exc


def json_depth(value, limit: int) -> int:
    """Nesting depth of dicts and lists in ``value`` (a scalar is 0), counted without
    recursion; stops early once past ``limit`` (returns limit + 1)."""
    depth, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        depth = max(depth, level)
        if depth > limit:
            return limit + 1
        stack.extend((child, level + 1) for child in children)
    return depth


class RequestGrammar:
    """One request's grammar state (``Request.structured``)."""

    __slots__ = ("source", "prefix_tokens", "matcher", "error", "error_code", "dead_end")

    def __init__(self, source: str, prefix_tokens: list[int]) -> None:
        self.source = source
        self.prefix_tokens = prefix_tokens
        self.matcher = None  # llguidance.LLMatcher once compiled
        self.error: str | None = None
        self.error_code = OutputErrorCode.INVALID_REQUEST  # with error: whose fault it is
        # the last mask allowed no token at all: the grammar needs bytes no token of this
        # vocabulary produces (e.g. a choice in a script the tokenizer never saw)
        self.dead_end = False

    @property
    def done(self) -> bool:
        """The grammar can take no more tokens: the request must stop."""
        return self.matcher is not None and self.matcher.is_stopped()


class GrammarBitmask:
    """One step's allowed-token masks, filled on a thread while the model runs."""

    def __init__(self, future: Future, rows: list[int], bitmask: torch.Tensor) -> None:
        self._future = future
        self.rows = rows
        self.bitmask = bitmask  # [R, ceil(V/32)] int32, one row per grammar request

    def apply(self, logits: torch.Tensor, reqs: list[Request]) -> None:
        """Disallowed tokens of the grammar rows of ``logits`` [N, V] become -inf; a row
        whose mask allows nothing marks its request (``reqs[row]``) as at a dead end."""
        self._future.result()
        vocab = logits.shape[1]
        mask = self.bitmask.to(logits.device, non_blocking=True)
        shifts = _SHIFTS.to(logits.device)
        allowed = ((mask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]  # [R, V]
        rows = torch.tensor(self.rows, dtype=torch.long, device=logits.device)
        sub = logits.index_select(0, rows)
        sub.masked_fill_(~allowed, float("-inf"))
        logits.index_copy_(0, rows, sub)
        for j in (~allowed.any(dim=1)).nonzero().flatten().tolist():
            reqs[self.rows[j]].structured.dead_end = True


class StructuredOutputManager:
    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_token_id: int | None = None,
                 max_workers: int = 2) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._compile_pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._executor = None  # llguidance.LLExecutor, fills many masks in parallel
        self._templates: OrderedDict[str, object] = OrderedDict()  # source -> compiled matcher
        self._pending: list[tuple[Request, Future]] = []

    # -- compile ---------------------------------------------------------------------------
    def submit(self, req: Request, spec: dict, prefix_tokens: list[int] | None = None) -> None:
        """Validate the spec, start compiling; the request waits for its grammar."""
        prefix = list(prefix_tokens or [])
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prefix):
            raise InvalidRequestError("structured_output_prefix_tokens must be a list of integers")
        if prefix and req.prompt_token_ids[-len(prefix):] != prefix:
            raise InvalidRequestError("structured_output_prefix_tokens must be the tail of the prompt")
        req.structured = RequestGrammar(grammar_source(spec), prefix)
        req.status = RequestStatus.WAITING_FOR_GRAMMAR
        self._pending.append((req, self._compile_pool.submit(self._compile, req.structured)))

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def take_ready(self) -> tuple[list[Request], list[Request]]:
        """(compiled, failed) among the pending requests; a failed one's grammar.error says why."""
        if not self._pending:
            return [], []
        ready, failed, still = [], [], []
        for req, fut in self._pending:
            if not fut.done():
                still.append((req, fut))
            elif req.structured.error is None:
                ready.append(req)
            else:
                failed.append(req)
        self._pending = still
        return ready, failed

    def _compile(self, grammar: RequestGrammar) -> None:
        try:
            matcher = self._matcher(grammar.source)
            if grammar.prefix_tokens and not matcher.consume_tokens(grammar.prefix_tokens):
                raise GrammarError("structured_output_prefix_tokens do not match the grammar: "
                                   f"{matcher.get_error()}")
            grammar.matcher = matcher
        except GrammarError as exc:  # the request's grammar: INVALID_REQUEST
            grammar.error = str(exc)
        except RecursionError as exc:  # the grammar text is nested too deeply to process
            grammar.error = f"grammar nested too deeply: {exc}"
        except Exception as exc:  # llguidance/tokenizer failures: this request's error only
            log.exception("grammar compile failed")
            grammar.error = f"grammar compile failed: {type(exc).__name__}: {exc}"
            grammar.error_code = OutputErrorCode.INTERNAL

    def _matcher(self, source: str):
        tokenizer = self._tokenizer()
        with self._lock:
            template = self._templates.get(source)
            if template is not None:
                self._templates.move_to_end(source)
                return template.deep_copy()
        template = llguidance.LLMatcher(tokenizer, source, log_level=0)
        if template.is_error():
            raise GrammarError(f"invalid grammar: {template.get_error()}")
        with self._lock:
            self._templates[source] = template
            while len(self._templates) > _CACHE_SIZE:
                self._templates.popitem(last=False)
        return template.deep_copy()

    def _tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                # deferred: llguidance.hf and transformers are heavy (seconds); only grammars need them
                import llguidance.hf
                from transformers import AutoTokenizer

                hf = AutoTokenizer.from_pretrained(self.tokenizer_dir)
                eos = self.eos_token_id if self.eos_token_id is not None else hf.eos_token_id
                self._ll_tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos)
                self._executor = llguidance.LLExecutor()
            return self._ll_tokenizer

    # -- per step --------------------------------------------------------------------------
    def start_bitmask(self, reqs: list[Request]) -> GrammarBitmask | None:
        """Start filling masks for the grammar rows of a batch (row i is reqs[i]); None
        (no work at all) when no request has a grammar."""
        rows = [i for i, r in enumerate(reqs) if r.structured is not None]
        if not rows:
            return None
        bitmask = torch.full((len(rows), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)
        matchers = [(reqs[i].structured.matcher, j) for j, i in enumerate(rows)]
        return GrammarBitmask(self._mask_pool.submit(self._fill, matchers, bitmask), rows, bitmask)

    def _fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        import llguidance.torch as lltorch  # deferred: it imports torch._dynamo (seconds)

        if len(matchers) == 1:
            lltorch.fill_next_token_bitmask(matchers[0][0], bitmask, matchers[0][1])
        else:
            lltorch.fill_next_token_bitmask_par(self._executor, matchers, bitmask)

    def accept(self, req: Request, token: int) -> str | None:
        """Advance ``req``'s matcher by its sampled token. Returns "stop" when the grammar is
        complete, an error text when the token broke it (``req.structured.dead_end``: no
        token could have kept it), else None."""
        matcher = req.structured.matcher
        if not matcher.consume_token(token):
            if req.structured.dead_end:
                return ("structured output cannot continue: no token of this model's vocabulary matches "
                        f"what the grammar requires next ({matcher.get_error()})")
            return f"structured output: sampled token {token} violates the grammar: {matcher.get_error()}"
        return "stop" if matcher.is_stopped() else None

    def shutdown(self) -> None:
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._mask_pool.shutdown(wait=False, cancel_futures=True)
