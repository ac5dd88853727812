"""Per-step sampling inputs: the batch's SamplingParams turned into tensors, once per step.

``SamplingMetadata.build(requests, vocab_size, device)`` makes one row per request, in the
order given (the row whose logits come from that request's last scheduled token). It must
be cheap: the common batch (all greedy, no penalties, no logprobs, no min_tokens pending,
no logit bias / allowed token ids / bad words) takes a fast path that builds no tensor at
all, and the per-request constants are cached on the request
(``Request.extra[ROW_PARAMS_KEY]``) the first time it is seen.

Seeded rows never carry a generator across steps. Each step draws from a generator seeded
with ``step_seed(seed, step)``, where ``step`` counts the request's output tokens so far, so
a request replayed from any point (prompt + tokens already produced) draws exactly what the
uninterrupted run would have. A replayed request whose earlier output was folded into its
prompt sets ``Request.extra[PRIOR_OUTPUT_TOKENS_KEY]`` to that count; the seed step and the
presence/frequency penalties then treat those prompt-tail tokens as output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from planaria.engine.logit_controls import LogitControls, build_logit_controls
from planaria.engine.request import Request

ROW_PARAMS_KEY = "_sampling_row"
PRIOR_OUTPUT_TOKENS_KEY = "num_prior_output_tokens"

_MASK64 = (1 << 64) - 1


def step_seed(seed: int, step: int) -> int:
    """A 63-bit generator seed from (request seed, output tokens so far): splitmix64."""
    x = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


class _RowParams:
    """The constant part of one request's sampling row (cached on the request)."""

    __slots__ = ("plain_greedy", "greedy", "temperature", "top_k", "top_p", "min_p", "seed",
                 "has_penalties", "has_controls", "num_logprobs", "min_tokens", "stop_token_ids")

    def __init__(self, req: Request) -> None:
        p = req.sampling_params
        self.greedy = p.greedy
        self.temperature = 1.0 if self.greedy else float(p.temperature)
        self.top_k = p.top_k if p.top_k > 0 else 0  # 0: disabled
        self.top_p = float(p.top_p)
        self.min_p = float(p.min_p)
        self.seed = p.seed
        self.has_penalties = p.has_penalties
        self.has_controls = p.has_logit_controls
        self.num_logprobs = p.logprobs
        stop = list(p.stop_token_ids)
        if req.eos_token_id is not None and not p.ignore_eos:
            stop.append(req.eos_token_id)
        self.stop_token_ids = tuple(dict.fromkeys(stop))
        self.min_tokens = p.min_tokens if self.stop_token_ids else 0
        self.plain_greedy = (self.greedy and not self.has_penalties and not self.has_controls
                             and self.num_logprobs is None)


def _row_params(req: Request) -> _RowParams:
    row = req.extra.get(ROW_PARAMS_KEY)
    if row is None:
        row = req.extra[ROW_PARAMS_KEY] = _RowParams(req)
    return row


@dataclass(slots=True)
class PenaltyInputs:
    """Penalties for the P rows that have any; the other rows are left untouched."""

    rows: torch.Tensor  # [P] int64, rows of the batch
    repetition: torch.Tensor  # [P] float32
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    prompt_mask: torch.Tensor  # [P, V] bool, token occurs in the prompt
    output_token_ids: torch.Tensor  # [P, L] int64, right-padded with V (a dropped bin)


@dataclass(slots=True)
class SamplingMetadata:
    num_rows: int
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None = None  # [N] float32, 1.0 on greedy rows; None if all greedy
    greedy_mask: torch.Tensor | None = None  # [N] bool; only for mixed batches
    top_k: torch.Tensor | None = None  # [N] int64, V where disabled; None if no row uses it
    top_p: torch.Tensor | None = None  # [N] float32; None if no row uses it
    min_p: torch.Tensor | None = None  # [N] float32; None if no row uses it
    seeds: tuple[tuple[int, int], ...] = ()  # (row, step_seed) of seeded random rows
    penalties: PenaltyInputs | None = None
    controls: LogitControls | None = None  # logit bias, allowed token ids, bad words
    # rows still short of min_tokens must not sample their stop/eos ids: (row, token) pairs
    stop_mask_rows: torch.Tensor | None = None  # [M] int64
    stop_mask_token_ids: torch.Tensor | None = None  # [M] int64
    logprob_rows: torch.Tensor | None = None  # [R] int64, rows that asked for logprobs
    num_logprobs: tuple[int, ...] = ()  # [R] top-n per logprob row
    max_num_logprobs: int | None = None  # None when no request asked

    @property
    def plain_greedy(self) -> bool:
        """Nothing to do but argmax."""
        return (self.all_greedy and self.penalties is None and self.controls is None
                and self.stop_mask_rows is None and self.max_num_logprobs is None)

    @classmethod
    def build(cls, requests: list[Request], vocab_size: int,
              device: torch.device | str) -> SamplingMetadata:
        n = len(requests)
        for req in requests:
            row = req.extra.get(ROW_PARAMS_KEY) or _row_params(req)
            if not row.plain_greedy or (row.min_tokens and len(req.output_token_ids) < row.min_tokens):
                break
        else:
            return cls(n, all_greedy=True, all_random=False)
        return _build_general(cls, requests, vocab_size, device)


def _build_general(cls, requests: list[Request], vocab_size: int, device) -> SamplingMetadata:
    rows = [_row_params(r) for r in requests]
    n = len(rows)
    greedy = [r.greedy for r in rows]
    num_greedy = sum(greedy)
    md = cls(n, all_greedy=num_greedy == n, all_random=num_greedy == 0)

    if not md.all_greedy:
        md.temperature = torch.tensor([min(r.temperature, _MAX_FACTOR) for r in rows], dtype=torch.float32,
                                      device=device)
        if not md.all_random:
            md.greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=device)
        top_k = [min(r.top_k, vocab_size) if r.top_k and not r.greedy else vocab_size for r in rows]
        if any(k < vocab_size for k in top_k):
            md.top_k = torch.tensor(top_k, dtype=torch.int64, device=device)
        top_p = [1.0 if r.greedy else r.top_p for r in rows]
        if any(p < 1.0 for p in top_p):
            md.top_p = torch.tensor(top_p, dtype=torch.float32, device=device)
        min_p = [0.0 if r.greedy else r.min_p for r in rows]
        if any(p > 0.0 for p in min_p):
            md.min_p = torch.tensor(min_p, dtype=torch.float32, device=device)
        md.seeds = tuple((i, step_seed(r.seed, _step(req)))
                         for i, (r, req) in enumerate(zip(rows, requests))
                         if r.seed is not None and not r.greedy)

    if any(r.has_penalties for r in rows):
        md.penalties = _build_penalties(rows, requests, vocab_size, device)

    controlled = [i for i, r in enumerate(rows) if r.has_controls]
    if controlled:
        reqs = [requests[i] for i in controlled]
        md.controls = build_logit_controls(controlled, reqs,
                                           [r.extra.get(PRIOR_OUTPUT_TOKENS_KEY, 0) for r in reqs],
                                           vocab_size, device)

    mask_rows: list[int] = []
    mask_ids: list[int] = []
    for i, (r, req) in enumerate(zip(rows, requests)):
        if req.num_output_tokens < r.min_tokens:
            ids = [t for t in r.stop_token_ids if 0 <= t < vocab_size]
            mask_rows.extend([i] * len(ids))
            mask_ids.extend(ids)
    if mask_rows:
        md.stop_mask_rows = torch.tensor(mask_rows, dtype=torch.int64, device=device)
        md.stop_mask_token_ids = torch.tensor(mask_ids, dtype=torch.int64, device=device)

    lp = [(i, r.num_logprobs) for i, r in enumerate(rows) if r.num_logprobs is not None]
    if lp:
        md.logprob_rows = torch.tensor([i for i, _ in lp], dtype=torch.int64, device=device)
        md.num_logprobs = tuple(min(k, vocab_size) for _, k in lp)
        md.max_num_logprobs = max(md.num_logprobs)
    return md


def _step(req: Request) -> int:
    return req.num_output_tokens + req.extra.get(PRIOR_OUTPUT_TOKENS_KEY, 0)


def _penalty_output_ids(req: Request) -> list[int]:
    prior = req.extra.get(PRIOR_OUTPUT_TOKENS_KEY, 0)
    tail = req.prompt_token_ids[len(req.prompt_token_ids) - prior:] if prior else []
    return tail + req.output_token_ids


_PROMPT_MASK_KEY = "_sampling_prompt_mask"
# Largest temperature or repetition penalty (and inverse of the smallest penalty) put in a
# float32 tensor: logits (|x| < 1e4) scaled by it and by 1 / temperature (<= 1e5, greedy
# below that) stay far below float32's 3.4e38, so softmax never sees inf - inf.
_MAX_FACTOR = 1e20


def _prompt_mask(req: Request, vocab_size: int, device) -> torch.Tensor:
    """[V] bool: tokens of the prompt (cached on the request; the prompt never changes)."""
    key = (str(device), vocab_size)
    cached = req.extra.get(_PROMPT_MASK_KEY)
    if cached is not None and cached[0] == key:
        return cached[1]
    ids = torch.tensor([t for t in req.prompt_token_ids if 0 <= t < vocab_size],
                       dtype=torch.int64, device=device)  # [Lp]
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [V]
    mask[ids] = True
    req.extra[_PROMPT_MASK_KEY] = (key, mask)
    return mask


def _build_penalties(rows: list[_RowParams], requests: list[Request], vocab_size: int,
                     device) -> PenaltyInputs:
    idx = [i for i, r in enumerate(rows) if r.has_penalties]
    reqs = [requests[i] for i in idx]
    params = [r.sampling_params for r in reqs]
    outputs = [_penalty_output_ids(r) for r in reqs]
    width = max(1, max(len(o) for o in outputs))
    padded = [o + [vocab_size] * (width - len(o)) for o in outputs]

    def floats(name: str) -> torch.Tensor:
        return torch.tensor([float(getattr(p, name)) for p in params], dtype=torch.float32, device=device)

    # A penalty of 5e-324 is > 0 as a Python float but 0.0 in float32, and -inf * 0 (a
    # grammar-masked token) is NaN, which argmax then picks; 1e300 is inf, and 0 * inf is
    # NaN too. Clamped to [1e-20, 1e20], every product stays finite (or -inf for -inf).
    repetition = [min(max(float(p.repetition_penalty), 1 / _MAX_FACTOR), _MAX_FACTOR) for p in params]
    return PenaltyInputs(
        rows=torch.tensor(idx, dtype=torch.int64, device=device),
        repetition=torch.tensor(repetition, dtype=torch.float32, device=device),
        presence=floats("presence_penalty"),
        frequency=floats("frequency_penalty"),
        prompt_mask=torch.stack([_prompt_mask(r, vocab_size, device) for r in reqs]),
        output_token_ids=torch.tensor(padded, dtype=torch.int64, device=device),
    )
