"""The sampler: logits [N, V] and a step's SamplingMetadata -> one token per row, and the
Logprobs records of the rows that asked. The tensor work is kernels/sampling.py.

Order of operations: penalties (repetition, presence, frequency), the logit controls
(logit bias added, then allowed token ids and bad words masked: engine/logit_controls.py),
min_tokens masking of stop/eos ids, greedy argmax for greedy rows; then for random rows
temperature, min_p, top-k, top-p and the exponential race (argmax of probs / q, q ~ Exp(1)).
A structured-output grammar masked its rows to -inf before the sampler (model_runner.py);
a bias never revives such a token (-inf + 100 = -inf). Logprobs come from the log-softmax
of the logits after penalties and controls, before min_tokens masking and temperature
(the distribution the request samples from at temperature 1). ``sampled_rank`` is 1-based
as in vLLM: the number of tokens whose logprob is at least the sampled token's.

Seeded rows draw q from a generator seeded for this step only (engine/sampling_metadata.py),
so a row's token does not depend on which other rows share the batch; unseeded rows share
one draw from the global RNG.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from planaria.engine.messages import Logprobs
from planaria.engine.sampling_metadata import SamplingMetadata
from planaria.kernels.sampling import (apply_penalties, argmax_rows, compute_logprobs, mask_tokens,
                                       sample_random)


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    logprobs: list[Logprobs | None] | None  # [N], None on rows that did not ask; None if none did
    # (rows [R], no token left [R] bool) for rows an allow-list or bad words restrict; None if none
    no_token: tuple[torch.Tensor, torch.Tensor] | None = None

    def rows_without_token(self) -> list[int]:
        """Rows whose every token was excluded (their sampled token means nothing). Syncs."""
        if self.no_token is None:
            return []
        rows, flags = self.no_token
        return [r for r, f in zip(rows.tolist(), flags.tolist()) if f]


class Sampler:
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        # logits: [N, V] float32
        if md.plain_greedy:
            return SamplerOutput(argmax_rows(logits), None)
        if md.penalties is not None:
            p = md.penalties
            logits = apply_penalties(logits, p.rows, p.repetition, p.presence, p.frequency,
                                     p.prompt_mask, p.output_token_ids)
        if md.controls is not None:
            logits = md.controls.apply(logits)
        lp_logits = logits
        if md.stop_mask_rows is not None:
            logits = mask_tokens(logits, md.stop_mask_rows, md.stop_mask_token_ids)
        no_token = md.controls.no_token_rows(logits) if md.controls is not None else None
        if md.all_greedy:
            sampled = argmax_rows(logits)  # [N]
        else:
            # greedy rows of a mixed batch run at temperature 1, filters off; discarded below
            sampled = sample_random(logits, md.temperature, md.top_k, md.top_p, md.min_p,
                                    md.seeds)  # [N]
            if not md.all_random:
                sampled = torch.where(md.greedy_mask, argmax_rows(logits), sampled)
        logprobs = gather_logprobs(lp_logits, sampled, md) if md.max_num_logprobs is not None else None
        return SamplerOutput(sampled, logprobs, no_token)


def gather_logprobs(logits: torch.Tensor, sampled: torch.Tensor,
                    md: SamplingMetadata) -> list[Logprobs | None]:
    """Per row that asked: the sampled token then the top-n, from log_softmax(logits)."""
    lp = compute_logprobs(logits, sampled, md.logprob_rows, md.max_num_logprobs)
    tok_ids, tok_lps, ranks = lp.token_ids.tolist(), lp.logprobs.tolist(), lp.ranks.tolist()
    top_ids, top_lps = lp.top_token_ids.tolist(), lp.top_logprobs.tolist()
    out: list[Logprobs | None] = [None] * md.num_rows
    for j, (row, n) in enumerate(zip(md.logprob_rows.tolist(), md.num_logprobs)):
        out[row] = Logprobs(token_ids=[tok_ids[j]] + top_ids[j][:n],
                            logprobs=[tok_lps[j]] + top_lps[j][:n],
                            sampled_rank=ranks[j])
    return out
