"""engine/batch_layout.py: the flat layout of a scheduled batch, no model and no tensors.
Block size 4 throughout; a decode's own cache slot is block_ids[p // 4] * 4 + p % 4."""

from __future__ import annotations

import numpy as np
import pytest

from planaria.engine.batch_layout import BatchLayout, layout_batch
from planaria.engine.request import Request
from planaria.engine.sampling_params import SamplingParams
from planaria.engine.scheduler import ScheduledRequest, SchedulerOutput

BS = 4


def _req(rid: str, prompt: list[int], output: list[int] = (), prompt_top: int | None = None) -> Request:
    req = Request(rid, list(prompt), SamplingParams(max_tokens=16, prompt_logprobs=prompt_top), None, 16)
    for t in output:
        req.append_output_token(t)
    if prompt_top is not None:
        req.prompt_logprobs = []  # owed (EngineCore._make_request)
    return req


def _prefill(req: Request, start: int, n: int, blocks: list[int]) -> ScheduledRequest:
    return ScheduledRequest(req, n, start, blocks, samples=start + n == req.num_tokens)


def _decode(req: Request, blocks: list[int], samples: bool = True) -> ScheduledRequest:
    return ScheduledRequest(req, 1, req.num_tokens - 1, blocks, samples=samples, decode=True)


A = [10, 11, 12, 13, 14, 15]  # prompts
B = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]

# (case, scheduled, expected fields; prompt_plan as (rows, targets, spans) or None)
CASES = [
    ("one prefill",
     lambda: [_prefill(_req("a", A), 0, 6, [7, 3])],
     dict(token_ids=A, positions=[0, 1, 2, 3, 4, 5], decode_ctx_lens=[], decode_slots=[],
          prefills=[([7, 3], 0, 6)], logit_rows=[5], sample_slots=[0], prompt_plan=None, decode_only=False)),
    ("decodes",
     lambda: [_decode(_req("a", [10, 11, 12], [13, 14]), [7, 3]), _decode(_req("b", [20, 21], [22]), [5])],
     dict(token_ids=[14, 22], positions=[4, 2], decode_ctx_lens=[5, 3], decode_slots=[3 * 4 + 0, 5 * 4 + 2],
          prefills=[], logit_rows=[0, 1], sample_slots=[0, 1], prompt_plan=None, decode_only=True)),
    ("a decode that samples nothing",  # e.g. a token already known (a replayed output)
     lambda: [_decode(_req("a", [10, 11], [12]), [1], samples=False), _decode(_req("b", [20, 21], [22]), [2])],
     dict(token_ids=[12, 22], positions=[2, 2], decode_ctx_lens=[3, 3], decode_slots=[6, 10],
          prefills=[], logit_rows=[1], sample_slots=[1], prompt_plan=None, decode_only=True)),
    ("mixed: decodes take the first rows",
     lambda: [_prefill(_req("a", A[:3]), 0, 3, [4]), _decode(_req("b", [20, 21, 22, 23], [24]), [5, 6])],
     dict(token_ids=[24, 10, 11, 12], positions=[4, 0, 1, 2], decode_ctx_lens=[5], decode_slots=[6 * 4 + 0],
          prefills=[([4], 0, 3)], logit_rows=[0, 3], sample_slots=[1, 0], prompt_plan=None, decode_only=False)),
    ("chunked prefill: a middle chunk samples nothing",
     lambda: [_prefill(_req("b", B), 4, 4, [1, 2, 3]), _decode(_req("a", [10], [11]), [9])],
     dict(token_ids=[11, 24, 25, 26, 27], positions=[1, 4, 5, 6, 7], decode_ctx_lens=[2], decode_slots=[37],
          prefills=[([1, 2, 3], 4, 4)], logit_rows=[0], sample_slots=[1], prompt_plan=None, decode_only=False)),
    ("chunked prefill: the last chunk samples",
     lambda: [_prefill(_req("b", B), 8, 2, [1, 2, 3])],
     dict(token_ids=[28, 29], positions=[8, 9], decode_ctx_lens=[], decode_slots=[],
          prefills=[([1, 2, 3], 8, 2)], logit_rows=[1], sample_slots=[0], prompt_plan=None, decode_only=False)),
    ("several prefills around a decode, in scheduled order",
     lambda: [_prefill(_req("a", A[:2]), 0, 2, [1]), _decode(_req("c", [30, 31], [32]), [2]),
              _prefill(_req("b", B), 0, 3, [3])],  # b: a first chunk
     dict(token_ids=[32, 10, 11, 20, 21, 22], positions=[2, 0, 1, 0, 1, 2], decode_ctx_lens=[3],
          decode_slots=[10], prefills=[([1], 0, 2), ([3], 0, 3)], logit_rows=[0, 2], sample_slots=[1, 0],
          prompt_plan=None, decode_only=False)),
    ("prompt logprobs: rows of a prefill after a decode",
     lambda: [_prefill(_req("a", A, prompt_top=2), 0, 6, [1, 2]), _decode(_req("b", [20], [21]), [3])],
     dict(token_ids=[21, *A], positions=[1, 0, 1, 2, 3, 4, 5], decode_ctx_lens=[2], decode_slots=[13],
          prefills=[([1, 2], 0, 6)], logit_rows=[0, 6], sample_slots=[1, 0], decode_only=False,
          prompt_plan=([1, 2, 3, 4, 5], A[1:], [(0, 0, 5, 2)]))),  # the last position's token is sampled
    ("prompt logprobs: a middle chunk",
     lambda: [_prefill(_req("b", B, prompt_top=0), 4, 3, [1, 2])],
     dict(token_ids=[24, 25, 26], positions=[4, 5, 6], decode_ctx_lens=[], decode_slots=[],
          prefills=[([1, 2], 4, 3)], logit_rows=[], sample_slots=[], decode_only=False,
          prompt_plan=([0, 1, 2], [25, 26, 27], [(0, 4, 3, 0)]))),
    ("prompt logprobs: a decode owes none",
     lambda: [_decode(_req("a", [10, 11], [12], prompt_top=1), [4])],
     dict(token_ids=[12], positions=[2], decode_ctx_lens=[3], decode_slots=[18], prefills=[],
          logit_rows=[0], sample_slots=[0], prompt_plan=None, decode_only=True)),
    ("empty batch",
     lambda: [],
     dict(token_ids=[], positions=[], decode_ctx_lens=[], decode_slots=[], prefills=[], logit_rows=[],
          sample_slots=[], prompt_plan=None, decode_only=False)),
]


def _fields(layout: BatchLayout) -> dict:
    plan = layout.prompt_plan
    return dict(token_ids=layout.token_ids, positions=layout.positions, decode_ctx_lens=layout.decode_ctx_lens,
                decode_slots=layout.decode_slots, prefills=layout.prefills, logit_rows=layout.logit_rows,
                sample_slots=layout.sample_slots, decode_only=layout.decode_only,
                prompt_plan=None if plan is None else (plan.rows, plan.targets, plan.spans))


@pytest.mark.parametrize("scheduled, want", [(s, w) for _, s, w in CASES], ids=[c for c, _, _ in CASES])
def test_layout(scheduled, want):
    sched = SchedulerOutput(scheduled=scheduled())
    layout = layout_batch(sched, BS)
    assert _fields(layout) == want
    assert layout.num_slots == len(sched.scheduled) and layout.num_tokens == len(want["token_ids"])
    assert layout.num_tokens == sum(s.num_tokens for s in sched.scheduled)  # every scheduled token, once


def test_decode_block_table_is_the_schedulers_own():
    table = np.array([[7, 3]], dtype=np.int64)
    sched = SchedulerOutput(scheduled=[_decode(_req("a", [1, 2, 3, 4], [5]), [7, 3])], decode_block_table=table)
    assert layout_batch(sched, BS).decode_block_table is table  # not copied again


# (case, scheduled, per-row values, fill, slot-order values)
BY_SLOT = [
    ("decode-only, all sample: the list itself",
     lambda: [_decode(_req("a", [1], [2]), [0]), _decode(_req("b", [3], [4]), [1])], [101, 102], -1, [101, 102]),
    ("decode-only, one samples nothing",
     lambda: [_decode(_req("a", [1], [2]), [0], samples=False), _decode(_req("b", [3], [4]), [1])],
     [102], -1, [-1, 102]),
    ("mixed: rows back in scheduled order",
     lambda: [_prefill(_req("a", [1, 2, 3]), 0, 3, [0]), _decode(_req("b", [3], [4]), [1])],
     ["row0", "row1"], None, ["row1", "row0"]),
    ("a chunk that samples nothing",
     lambda: [_prefill(_req("a", B), 0, 4, [0]), _prefill(_req("b", [1, 2]), 0, 2, [1])], [7], -1, [-1, 7]),
]


@pytest.mark.parametrize("scheduled, rows, fill, want", [c[1:] for c in BY_SLOT], ids=[c[0] for c in BY_SLOT])
def test_by_slot(scheduled, rows, fill, want):
    layout = layout_batch(SchedulerOutput(scheduled=scheduled()), BS)
    out = layout.by_slot(rows, fill)
    assert out == want
    if layout.decode_only and len(rows) == layout.num_slots:
        assert out is rows  # no copy on the hot path
