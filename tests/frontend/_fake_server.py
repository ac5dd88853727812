"""A real frontend app on a loopback port over a fake engine client (tests/frontend/_fakes.py):
the guards' tests (test_guards.py, test_hostile_http.py, test_slow_clients.py, test_admission.py)
build their servers here."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from aiohttp import web

from planaria.frontend.generation import Generator
from planaria.frontend.http_guard import CappedTCPSite
from planaria.frontend.limits import ServerLimits
from planaria.frontend.metrics import FrontendMetrics
from planaria.frontend.render import PromptRenderer
from planaria.frontend.server import FrontendServer
from planaria.frontend.serving import ModelInfo, OpenAIServing
from tests.frontend._fakes import EOS, VOCAB, FakeEngineClient, FakeTokenizer, detokenizer


@dataclass
class Served:
    server: FrontendServer
    site: CappedTCPSite
    port: int

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextlib.asynccontextmanager
async def serve_fake(client: FakeEngineClient, tokenizer=None, render_timeout_s: float = 20.0,
                     max_model_len: int = 64, **limits):
    tok = tokenizer or FakeTokenizer()
    lim = ServerLimits(**limits)
    metrics = FrontendMetrics("fake")
    gen = Generator(client, detokenizer(tok), metrics)
    model = ModelInfo(name="fake", path="/models/fake", vocab_size=VOCAB, max_model_len=max_model_len,
                      eos_token_id=EOS)
    serving = OpenAIServing(gen, tok, model, renderer=PromptRenderer(tok, render_timeout_s, 2),
                            request_timeout_s=lim.request_timeout_s, write_timeout_s=lim.write_timeout_s)
    server = FrontendServer(client, serving, metrics, lim)
    runner = web.AppRunner(server.build_app(), handler_cancellation=True, access_log=None,
                           keepalive_timeout=lim.keep_alive_timeout_s)
    await runner.setup()
    site = CappedTCPSite(runner, "127.0.0.1", 0, max_connections=lim.max_connections,
                         max_connections_per_client=lim.max_connections_per_client,
                         header_read_timeout_s=lim.header_read_timeout_s)
    await site.start()
    try:
        yield Served(server, site, site.port)
    finally:
        await runner.cleanup()
        serving.renderer.close()
