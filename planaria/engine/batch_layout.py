"""The flat layout of one scheduled batch: which token sits in which row, where each decode
token's KV goes, which rows are sampled, which feed prompt logprobs.

``layout_batch(sched, block_size)`` is a pure function of the scheduled batch (plain ints
and lists: no model, no tensors), so every batch shape is tested in microseconds
(tests/engine/test_batch_layout.py); ModelRunner.execute turns the layout into tensors
and attention metadata (kernels/attention.py ``build_metadata``), and ``by_slot`` puts
what the sampler returns per logit row back in ``scheduled`` order.

Rows: the decodes (one new token, some context before it) first, in ``scheduled`` order,
then the prefill chunks, in ``scheduled`` order. A decode-only batch keeps row i for
``scheduled[i]``, so its sampled tokens need no reordering. At 64 decoding sequences every
per-request step counts: one pass lays out the decodes, and their cache slots are plain
ints (cheaper than the tensor ops that would derive them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planaria.engine import prompt_logprobs
from planaria.engine.scheduler import SchedulerOutput


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """One step's flat input; ``slot`` is an index into ``SchedulerOutput.scheduled``."""

    num_slots: int  # len(scheduled)
    token_ids: list[int]  # [T]: the decodes' tokens, then each prefill chunk's
    positions: list[int]  # [T]
    decode_block_table: np.ndarray | None  # [decodes, >= most blocks], the scheduler's copy (not copied again)
    decode_ctx_lens: list[int]  # per decode: its context, the new token included
    decode_slots: list[int]  # per decode: the KV cache slot of its new token
    prefills: list[tuple[list[int], int, int]]  # per prefill chunk: (block_ids, start_pos, num_tokens)
    logit_rows: list[int]  # per sampled request: the row of its last token
    sample_slots: list[int]  # per logit row: the slot it samples for
    prompt_plan: prompt_logprobs.PromptLogprobsPlan | None  # rows feeding prompt logprobs, if any

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def decode_only(self) -> bool:
        """Decodes and nothing else: row i is slot i (an empty batch is not decode-only)."""
        return not self.prefills and bool(self.decode_ctx_lens)

    def by_slot(self, row_values: list, fill) -> list:
        """Values per logit row (sampled tokens, logprobs) in slot order, ``fill`` where a
        slot samples nothing. Every slot of a decode-only batch samples: the list itself."""
        if self.decode_only and len(row_values) == self.num_slots:  # row i is slot i
            return row_values
        out = [fill] * self.num_slots
        for j, i in enumerate(self.sample_slots):
            out[i] = row_values[j]
        return out


def layout_batch(sched: SchedulerOutput, block_size: int) -> BatchLayout:
    scheduled = sched.scheduled
    bs = block_size
    ids: list[int] = []
    pos: list[int] = []
    decode_idx: list[int] = []
    prefill_idx: list[int] = []
    dec_ctx: list[int] = []
    dec_slots: list[int] = []  # each decode token's own cache slot
    want_prompt_lps = False
    for i, s in enumerate(scheduled):
        p = s.start_pos
        if s.decode:
            decode_idx.append(i)
            ids.append(s.req.all_token_ids[p])
            pos.append(p)
            dec_ctx.append(p + 1)
            dec_slots.append(s.block_ids[p // bs] * bs + p % bs)
        else:
            prefill_idx.append(i)
        if s.req.prompt_logprobs is not None:
            want_prompt_lps = True
    prefills: list[tuple[list[int], int, int]] = []
    for i in prefill_idx:
        s = scheduled[i]
        ids.extend(s.req.all_token_ids[s.start_pos:s.start_pos + s.num_tokens])
        pos.extend(range(s.start_pos, s.start_pos + s.num_tokens))
        prefills.append((s.block_ids, s.start_pos, s.num_tokens))
    if not prefill_idx:  # decode-only: row i is scheduled[i]
        sample_slots = [i for i, s in enumerate(scheduled) if s.samples]
        logit_rows = sample_slots
        first_rows = list(range(len(scheduled))) if want_prompt_lps else None
    else:
        logit_rows, sample_slots = [], []
        row = 0
        first_rows = [0] * len(scheduled)  # flat row of each request's first token in this step
        for i in decode_idx + prefill_idx:
            s = scheduled[i]
            first_rows[i] = row
            row += s.num_tokens
            if s.samples:
                logit_rows.append(row - 1)
                sample_slots.append(i)
    prompt_plan = prompt_logprobs.plan_rows(scheduled, first_rows) if want_prompt_lps else None
    return BatchLayout(len(scheduled), ids, pos, sched.decode_block_table, dec_ctx, dec_slots, prefills, logit_rows,
                       sample_slots, prompt_plan)
