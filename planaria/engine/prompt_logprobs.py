"""Prompt logprobs (``SamplingParams.prompt_logprobs``, vLLM's extension; what OpenAI's
``echo`` with ``logprobs`` shows), computed during the prefill, in the step's own forward.

For a request still owed them (``Request.prompt_logprobs`` is a list), every position p of
the step's chunk with p < len(prompt) - 1 has its logits computed too: entry p holds the
logprob and 1-based rank of prompt token p + 1 at p, then the top-n, from a float32
log_softmax of the model's raw logits (no penalty, temperature or grammar, as in vLLM).
A chunked prefill delivers them chunk by chunk; the engine core appends each chunk to the
request (``accept``) and sends the whole list once, with the request's first token
(``take``), so a request that never produces a token sends none.

The model runner plans the rows (``plan_rows``) while it lays out the step and computes
them after the forward (``compute``), ``max_rows`` logit rows at a time, so a long chunk
never holds a [chunk, vocab] tensor at once.

Positions are never skipped: prefix-cache hits are off for such a request
(``KVCacheManager.get_computed_blocks``). A preemption during the prefill recomputes
positions already delivered to the request: ``accept`` skips them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from planaria.engine.messages import Logprobs
from planaria.engine.request import Request
from planaria.engine.scheduler import ScheduledRequest
from planaria.kernels.sampling import token_logprobs

# A request's prompt logprobs travel in one output: (prompt tokens - 1) x (top-n + 1)
# numbers, about 12 bytes each on the wire. Refused past this at admission (the frontend's
# own limit, RequestLimits.max_prompt_logprob_values, is lower): one output stays far below
# a message's limit (wire.DEFAULT_MAX_MESSAGE_BYTES), and proc.py splits a step's outputs.
MAX_VALUES = 4 * 2**20

# slot (index into SchedulerOutput.scheduled) -> (first prompt position, its entries)
StepPromptLogprobs = dict[int, tuple[int, list[Logprobs]]]


@dataclass(slots=True)
class PromptLogprobsPlan:
    """The logit rows of one step that feed prompt logprobs."""

    rows: list[int] = field(default_factory=list)  # flat rows of the step's hidden states
    targets: list[int] = field(default_factory=list)  # per row: the prompt token that follows
    spans: list[tuple[int, int, int, int]] = field(default_factory=list)  # (slot, first position, num rows, top-n)


def plan_rows(scheduled: list[ScheduledRequest], first_rows: list[int]) -> PromptLogprobsPlan | None:
    """The rows to compute: ``first_rows[i]`` is the flat row of ``scheduled[i]``'s first
    token in this step. None when no scheduled request wants prompt logprobs here."""
    plan = PromptLogprobsPlan()
    for i, s in enumerate(scheduled):
        req = s.req
        if req.prompt_logprobs is None:
            continue
        end = min(s.start_pos + s.num_tokens, req.num_prompt_tokens - 1)  # last position's token is sampled
        n = end - s.start_pos
        if n <= 0:
            continue
        plan.rows.extend(range(first_rows[i], first_rows[i] + n))
        plan.targets.extend(req.prompt_token_ids[s.start_pos + 1:end + 1])
        plan.spans.append((i, s.start_pos, n, req.sampling_params.prompt_logprobs or 0))
    return plan if plan.spans else None


def compute(model, hidden: torch.Tensor, plan: PromptLogprobsPlan, max_rows: int) -> StepPromptLogprobs:
    """Each span's entries from ``hidden`` [T, H] (the step's hidden states)."""
    device = hidden.device
    num_top = max(k for *_, k in plan.spans)
    rows = torch.tensor(plan.rows, dtype=torch.long, device=device)  # [R]
    targets = torch.tensor(plan.targets, dtype=torch.long, device=device)  # [R]
    parts = []
    for a in range(0, len(plan.rows), max_rows):
        logits = model.compute_logits(hidden.index_select(0, rows[a:a + max_rows]))  # [r, V]
        parts.append(token_logprobs(logits, targets[a:a + max_rows], num_top))
    tok_lps = torch.cat([p.logprobs for p in parts]).tolist()
    ranks = torch.cat([p.ranks for p in parts]).tolist()
    top_ids = torch.cat([p.top_token_ids for p in parts]).tolist()
    top_lps = torch.cat([p.top_logprobs for p in parts]).tolist()
    out: StepPromptLogprobs = {}
    r = 0
    for slot, start, n, k in plan.spans:
        out[slot] = (start, [Logprobs(token_ids=[plan.targets[j]] + top_ids[j][:k],
                                      logprobs=[tok_lps[j]] + top_lps[j][:k], sampled_rank=ranks[j])
                             for j in range(r, r + n)])
        r += n
    return out


def accept(req: Request, start: int, entries: list[Logprobs]) -> bool:
    """Append a chunk's entries (from prompt position ``start``) to the request's list,
    skipping positions it already has (recomputed after a preemption). False when the
    chunk does not join on (a position would be missing): the caller fails the request."""
    have = req.prompt_logprobs
    if have is None:
        return True  # not asked for, or already sent
    if start > len(have):
        return False
    have.extend(entries[len(have) - start:])
    return True


def take(req: Request) -> list[Logprobs] | None:
    """The request's prompt logprobs, once: the output carrying its first token takes them."""
    lps, req.prompt_logprobs = req.prompt_logprobs, None
    return lps
