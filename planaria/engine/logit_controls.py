"""Logit bias, allowed token ids and bad words: one step's tensors, and applying them.

Per request the constant part is built once and cached on the request
(``Request.extra[CONTROLS_KEY]``): the bias as two tensors (token ids, values), the
allow-list as a [V] bool mask, the bad words split into single tokens (always forbidden)
and longer sequences (their last token is forbidden while the tokens before it are the
last tokens generated, as vLLM's ``bad_words``). Per step, ``build_logit_controls`` gathers
the rows that have any into one ``LogitControls``; only multi-token bad words look at the
request's output, its last few tokens, output folded into a replayed prompt included (a
replay forbids what the uninterrupted run would have).

The sampler (engine/sampler.py) applies them after the penalties and before min_tokens
masking and temperature: bias (added, so a grammar's -inf stays -inf under any bias),
then the allow-list and bad words (-inf). A row they restrict may be left with no token
at all (an allow-list of only bad words, or of only eos under min_tokens);
``no_token_rows`` finds those, and the runner ends them as their own error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from planaria.engine.request import Request
from planaria.kernels.sampling import add_logit_bias, keep_tokens, mask_tokens

CONTROLS_KEY = "_logit_controls"


class _RowControls:
    """One request's controls as tensors on one device (cached on the request)."""

    __slots__ = ("key", "bias_token_ids", "bias_values", "allowed", "banned_ids", "sequences",
                 "max_prefix_len")

    def __init__(self, req: Request, vocab_size: int, device: torch.device | str) -> None:
        p = req.sampling_params
        self.key = (str(device), vocab_size)
        self.bias_token_ids: torch.Tensor | None = None  # [B] int64
        self.bias_values: torch.Tensor | None = None  # [B] float32
        if p.logit_bias:
            items = [(t, b) for t, b in p.logit_bias.items() if 0 <= t < vocab_size]
            self.bias_token_ids = torch.tensor([t for t, _ in items], dtype=torch.int64, device=device)
            self.bias_values = torch.tensor([float(b) for _, b in items], dtype=torch.float32, device=device)
        self.allowed: torch.Tensor | None = None  # [V] bool
        if p.allowed_token_ids is not None:
            ids = torch.tensor([t for t in p.allowed_token_ids if 0 <= t < vocab_size], dtype=torch.int64,
                               device=device)
            self.allowed = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.allowed[ids] = True
        words = [w for w in p.bad_words_token_ids or () if all(0 <= t < vocab_size for t in w)]
        self.banned_ids = tuple(dict.fromkeys(w[0] for w in words if len(w) == 1))
        # (prefix, last token) of each longer sequence
        self.sequences = tuple((tuple(w[:-1]), w[-1]) for w in words if len(w) > 1)
        self.max_prefix_len = max((len(pre) for pre, _ in self.sequences), default=0)

    @property
    def restricts(self) -> bool:
        """Some token may be excluded (not only biased)."""
        return self.allowed is not None or bool(self.banned_ids) or bool(self.sequences)

    def banned_now(self, tail: list[int]) -> list[int]:
        """Tokens forbidden at this step, given the output's last tokens ``tail``."""
        banned = list(self.banned_ids)
        for prefix, last in self.sequences:
            if len(prefix) <= len(tail) and tuple(tail[len(tail) - len(prefix):]) == prefix:
                banned.append(last)
        return banned


def _row_controls(req: Request, vocab_size: int, device) -> _RowControls:
    row = req.extra.get(CONTROLS_KEY)
    if row is None or row.key != (str(device), vocab_size):
        row = req.extra[CONTROLS_KEY] = _RowControls(req, vocab_size, device)
    return row


def _output_tail(req: Request, num_prior: int, n: int) -> list[int]:
    """The last ``n`` (or fewer) tokens of the output, ``num_prior`` tokens of prior output
    at the end of the prompt counted as output."""
    tail = req.output_token_ids[-n:] if n else []
    short = n - len(tail)
    if short > 0 and num_prior:
        prompt = req.prompt_token_ids
        prior = prompt[len(prompt) - num_prior:]
        tail = prior[-short:] + tail
    return tail


@dataclass(slots=True)
class LogitControls:
    """One step's controls over the rows of the batch that have any."""

    bias_rows: torch.Tensor | None = None  # [B] int64, with bias_token_ids / bias_values
    bias_token_ids: torch.Tensor | None = None  # [B] int64
    bias_values: torch.Tensor | None = None  # [B] float32
    allowed_rows: torch.Tensor | None = None  # [A] int64
    allowed_mask: torch.Tensor | None = None  # [A, V] bool, True: may be sampled
    banned_rows: torch.Tensor | None = None  # [K] int64, with banned_token_ids
    banned_token_ids: torch.Tensor | None = None  # [K] int64
    restricted_rows: torch.Tensor | None = None  # [R] int64, rows an allow-list or bad words restrict

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [N, V] with the bias added and excluded tokens at -inf (out of place)."""
        if self.bias_rows is not None:
            logits = add_logit_bias(logits, self.bias_rows, self.bias_token_ids, self.bias_values)
        if self.allowed_rows is not None:
            logits = keep_tokens(logits, self.allowed_rows, self.allowed_mask)
        if self.banned_rows is not None:
            logits = mask_tokens(logits, self.banned_rows, self.banned_token_ids)
        return logits

    def no_token_rows(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows [R], whether each has no token left [R] bool) over the restricted rows of
        the final ``logits`` [N, V]; None when no row is restricted. No device sync."""
        if self.restricted_rows is None:
            return None
        best = logits.index_select(0, self.restricted_rows).amax(dim=-1)  # [R]
        return self.restricted_rows, best == float("-inf")


def build_logit_controls(rows: list[int], requests: list[Request], num_prior: list[int], vocab_size: int,
                         device: torch.device | str) -> LogitControls:
    """The controls of batch ``rows`` (``requests`` [i] is row ``rows[i]``, ``num_prior`` its
    prior output folded into the prompt)."""
    out = LogitControls()
    bias_rows, bias_counts, bias_ids, bias_values = [], [], [], []
    allowed_rows, allowed = [], []
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    restricted: list[int] = []
    for row, req, prior in zip(rows, requests, num_prior):
        c = _row_controls(req, vocab_size, device)
        if c.bias_token_ids is not None and c.bias_token_ids.numel():
            bias_rows.append(row)
            bias_counts.append(c.bias_token_ids.numel())
            bias_ids.append(c.bias_token_ids)
            bias_values.append(c.bias_values)
        if c.allowed is not None:
            allowed_rows.append(row)
            allowed.append(c.allowed)
        if c.banned_ids or c.sequences:
            ids = c.banned_now(_output_tail(req, prior, c.max_prefix_len) if c.sequences else [])
            banned_rows.extend([row] * len(ids))
            banned_ids.extend(ids)
        if c.restricts:
            restricted.append(row)
    if bias_rows:
        total = sum(bias_counts)
        out.bias_rows = torch.repeat_interleave(torch.tensor(bias_rows, dtype=torch.int64, device=device),
                                                torch.tensor(bias_counts, dtype=torch.int64, device=device),
                                                output_size=total)
        out.bias_token_ids = torch.cat(bias_ids)
        out.bias_values = torch.cat(bias_values)
    if allowed_rows:
        out.allowed_rows = torch.tensor(allowed_rows, dtype=torch.int64, device=device)
        out.allowed_mask = torch.stack(allowed)
    if banned_rows:
        out.banned_rows = torch.tensor(banned_rows, dtype=torch.int64, device=device)
        out.banned_token_ids = torch.tensor(banned_ids, dtype=torch.int64, device=device)
    if restricted:
        out.restricted_rows = torch.tensor(restricted, dtype=torch.int64, device=device)
    return out
