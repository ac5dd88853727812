"""Fakes for frontend logic tests: a character tokenizer and an engine client that
generates on a timer. The detokenizer is the real one (engine/detokenizer.py) over the
character tokenizer: ``detokenizer(tokenizer)``. The real tokenizer and engines are used in
test_http.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from planaria.engine.detokenizer import IncrementalDetokenizer
from planaria.engine.errors import EngineDeadError, NoEngineAvailableError
from planaria.engine.messages import EngineCoreOutput, Logprobs, SchedulerStats

VOCAB = 256  # token id = a byte (latin-1 character)
EOS = 0


class FakeTokenizer:
    eos_token_id = EOS
    chat_template = None  # role and content only: tools are written into the messages (tool_prompts.py)

    def __len__(self) -> int:
        return VOCAB

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids, skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == EOS))

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True,
                            continue_final_message=False, **kw) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def detokenizer(tokenizer):
    """The Generator's detokenizer factory: the real IncrementalDetokenizer (stop strings,
    hold-back) over ``tokenizer``."""
    return lambda prompt_token_ids, params: IncrementalDetokenizer(tokenizer, prompt_token_ids, params)


@dataclass
class FakeEngineInfo:
    index: int
    state: str = "running"
    pid: int | None = 1234
    stats: SchedulerStats | None = None
    max_model_len: int = 64
    num_cached_blocks: int = 0
    routed_hit_rate: float = 0.0

    @property
    def healthy(self) -> bool:
        return self.state == "running"


class FakeEngineClient:
    """Generates ``text`` (cycled) one token per step; ``die_after`` tokens then EngineDeadError."""

    def __init__(self, text: str = "hello world ", step_s: float = 0.001, die_after: int | None = None,
                 error: str | None = None, error_code: str | None = None) -> None:
        self.text = text
        self.step_s = step_s
        self.die_after = die_after
        self.error = error
        self.error_code = error_code  # with error: EngineCoreOutput.error_code
        self.engines = [FakeEngineInfo(0, stats=SchedulerStats())]
        self.requests: dict = {}
        self.running: set[str] = set()
        self.aborted: list[str] = []

    async def generate(self, req):
        if not any(e.healthy for e in self.engines):
            raise NoEngineAvailableError("no running engine")
        rid = req.request_id
        self.requests[rid] = req
        self.running.add(rid)
        sp = req.sampling_params
        finished = False
        try:
            if self.error is not None:
                finished = True
                yield EngineCoreOutput(request_id=rid, finish_reason="error", error=self.error,
                                       error_code=self.error_code)
                return
            for i in range(sp.max_tokens):
                await asyncio.sleep(self.step_s)
                if self.die_after is not None and i >= self.die_after:
                    finished = True
                    raise EngineDeadError(0, rid, "killed by the test")
                tok = ord(self.text[i % len(self.text)])
                lps = None
                if sp.logprobs is not None:
                    tops = [tok] + [(tok + k) % VOCAB for k in range(sp.logprobs)]
                    lps = [Logprobs(token_ids=tops, logprobs=[-0.5] + [-1.0 - k for k in range(sp.logprobs)],
                                    sampled_rank=1)]
                last = i == sp.max_tokens - 1
                finished = last
                yield EngineCoreOutput(request_id=rid, new_token_ids=[tok], new_logprobs=lps,
                                       finish_reason="length" if last else None)
        finally:
            self.running.discard(rid)
            if not finished:
                self.aborted.append(rid)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def routing_status(self) -> dict:
        """As EngineClient.routing_status: every request went to engine 0 on its load."""
        return {"policy": "kv", "decisions": {"no_prefix": len(self.requests)},
                "engines": {str(e.index): {"state": e.state, "num_cached_blocks": e.num_cached_blocks}
                            for e in self.engines}}
