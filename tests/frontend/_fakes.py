"""Fakes for frontend logic tests: a character tokenizer, a detokenizer with stop strings,
and an engine client that generates on a timer. The real ones are used in test_http.py."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

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

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == EOS))

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True,
                            continue_final_message=False, **kw) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class FakeDetokenizer:
    """update() returns a matched stop string; text is held back while it may begin one."""

    def __init__(self, tokenizer, prompt_token_ids, params) -> None:
        self.tok = tokenizer
        self.params = params
        self.output_text = ""
        self._sent = 0
        self._stopped = False

    def update(self, new_token_ids):
        self.output_text += self.tok.decode(new_token_ids)
        for s in self.params.stop:
            at = self.output_text.find(s)
            if at >= 0:
                end = at + len(s) if self.params.include_stop_str_in_output else at
                self.output_text = self.output_text[:end]
                self._stopped = True
                return s
        return None

    def _safe_end(self) -> int:
        if self._stopped:
            return len(self.output_text)
        hold = 0
        for s in self.params.stop:
            for k in range(min(len(s) - 1, len(self.output_text)), 0, -1):
                if self.output_text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return len(self.output_text) - hold

    def get_delta_text(self) -> str:
        end = max(self._safe_end(), self._sent)
        delta, self._sent = self.output_text[self._sent:end], end
        return delta

    def flush(self) -> str:
        delta, self._sent = self.output_text[self._sent:], len(self.output_text)
        return delta


@dataclass
class FakeEngineInfo:
    index: int
    state: str = "running"
    pid: int | None = 1234
    stats: SchedulerStats | None = None
    max_model_len: int = 64

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
