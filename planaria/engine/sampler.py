"""The sampler: logits [N, V] and a step's SamplingMetadata -> one token per row, and the
Logprobs records of the rows that asked. The tensor work is kernels/sampling.py.

Order of operations as in vLLM v1: penalties (repetition, presence, frequency), min_tokens
masking of stop/eos ids, greedy argmax for greedy rows; then for random rows temperature,
min_p, top-k, top-p and the exponential race (argmax of probs / q, q ~ Exp(1)). Logprobs
come from the log-softmax of the post-penalty, pre-temperature logits (before min_tokens
masking). ``sampled_rank`` is 1-based as in vLLM: the number of tokens whose logprob is at
least the sampled token's.

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


class Sampler:
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        # logits: [N, V] float32
        if md.plain_greedy:
            return SamplerOutput(argmax_rows(logits), None)
        if md.penalties is not None:
            p = md.penalties
            logits = apply_penalties(logits, p.rows, p.repetition, p.presence, p.frequency,
                                     p.prompt_mask, p.output_token_ids)
        lp_logits = logits
        if md.stop_mask_rows is not None:
            logits = mask_tokens(logits, md.stop_mask_rows, md.stop_mask_token_ids)
        if md.all_greedy:
            sampled = argmax_rows(logits)  # [N]
        else:
            # greedy rows of a mixed batch run at temperature 1, filters off; discarded below
            sampled = sample_random(logits, md.temperature, md.top_k, md.top_p, md.min_p,
                                    md.seeds)  # [N]
            if not md.all_random:
                sampled = torch.where(md.greedy_mask, argmax_rows(logits), sampled)
        logprobs = gather_logprobs(lp_logits, sampled, md) if md.max_num_logprobs is not None else None
        return SamplerOutput(sampled, logprobs)


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
