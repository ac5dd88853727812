"""The aiohttp application: routes, error bodies, health/readiness, metrics, draining.

    POST /v1/completions, /v1/chat/completions   (frontend.serving)
    POST /v1/embeddings                           (frontend.embeddings, pooling models)
    POST /tokenize, /detokenize                   (frontend.tokenization, as vllm serve)
    GET  /v1/models   (with the engines' weight_version / weight_versions)
    GET  /health    200 while the process runs (liveness)
    GET  /ready     200 when at least one engine is running and we are not draining, else 503
    GET  /metrics   Prometheus text (with an API key set, the cache figures only for its holders)

Guards, in the order a request meets them: the connection caps, in all and per client
address, and the request head's timeout (``http_guard.CappedTCPSite``, main.py), the API
key on /v1/*, /tokenize and /detokenize (and /metrics, /ready with
``api_key_protects_metrics``; /health never), the in-flight bound, counted in sequences
(``admission.py``: one unit on arrival, one per further engine request once the body is
parsed; 429 with Retry-After), the body read (timeout 408, size 413),
the JSON nesting depth (400; scanned on a thread for a large body), the body's own fields
(400, ``request_id`` among them: it is echoed in a header). ``limits.ServerLimits`` holds
their settings.

``create_server(client, model_dir, ...)`` builds the real collaborators (tokenizer,
detokenizer, Generator) in one place; ``FrontendServer`` takes them ready-made, so tests
can hand it fakes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

from aiohttp import web

from planaria.engine.detokenizer import IncrementalDetokenizer
from planaria.frontend import responses as R
from planaria.frontend.admin import EngineAdmin
from planaria.frontend.admission import ADMISSION, MAY_SET_PRIORITY, Admission
from planaria.frontend.embeddings import EmbeddingServing
from planaria.frontend.errors import FrontendError, ServiceUnavailableError, TooManyRequestsError, error_body
from planaria.frontend.generation import Generator
from planaria.frontend.http_guard import bearer_matches, check_api_key, read_body
from planaria.frontend.limits import RequestLimits, ServerLimits, check_json_depth
from planaria.frontend.metrics import FrontendMetrics
from planaria.frontend.render import PromptRenderer
from planaria.frontend.serving import ModelInfo, OpenAIServing
from planaria.frontend.tokenization import TokenServing

log = logging.getLogger(__name__)

ENGINE_WATCH_INTERVAL_S = 0.5
RETRY_AFTER_S = 1  # what a 429 tells the client to wait
KEYED_PATHS = ("/tokenize", "/detokenize")  # outside /v1/ (as vLLM), yet behind the API key
# A body larger than this has its JSON depth scanned on a thread: 4 MiB takes tens of ms
# (limits.json_depth), 16 KiB half a millisecond at worst (the hop to a thread ~0.1 ms).
DEPTH_SCAN_INLINE_BYTES = 2**14


class FrontendServer:
    def __init__(self, client, serving: OpenAIServing, metrics: FrontendMetrics,
                 limits: ServerLimits = ServerLimits()) -> None:
        self.client = client
        self.serving = serving
        self.metrics = metrics
        self.limits = limits
        self.created = R.now_s()
        self.draining = False
        self.num_in_flight = 0  # HTTP requests (draining waits for them)
        # sequences (engine requests) in flight: the --max-inflight-requests bound
        self.admission = Admission(limits.max_inflight_requests, on_refused=lambda: metrics.record_error("overloaded"))
        self.embeddings = None  # frontend.embeddings.EmbeddingServing (create_server sets it)
        self.admin = None  # frontend.admin.EngineAdmin (create_server sets it): weight versions
        self.tokens = TokenServing(serving)
        self._idle = asyncio.Event()
        self._idle.set()

    # -- app ------------------------------------------------------------------------------
    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors_middleware, self._auth_middleware],
                              client_max_size=self.limits.max_body_bytes)
        app.router.add_post("/v1/completions", self._generation(self.serving.completions))
        app.router.add_post("/v1/chat/completions", self._generation(self.serving.chat))
        if self.embeddings is not None:
            app.router.add_post("/v1/embeddings", self._generation(self.embeddings.embeddings))
        app.router.add_post("/tokenize", self._generation(self.tokens.tokenize))
        app.router.add_post("/detokenize", self._generation(self.tokens.detokenize))
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_text)
        app.cleanup_ctx.append(self._engine_watch)
        return app

    async def _engine_watch(self, app: web.Application):
        async def watch() -> None:
            while True:
                self.metrics.observe_engines(self.client.engines)
                await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)

        task = asyncio.create_task(watch(), name="frontend-engine-watch")
        yield
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler):
        """Exceptions become OpenAI error bodies here, and only here."""
        try:
            return await handler(request)
        except FrontendError as exc:
            if exc.status >= 500:
                log.warning("%s %s: %s", request.method, request.path, exc)
            resp = web.json_response(exc.body(), status=exc.status, headers=exc.headers())
            if exc.close_connection:
                resp.force_close()
            if exc.hang_up:  # send it and close now: aiohttp would linger reading the rest
                await resp.prepare(request)
                await resp.write_eof()
                if request.transport is not None:
                    request.transport.close()
            return resp
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = exc.text if exc.text and exc.text != f"{exc.status}: {exc.reason}" else exc.reason
            return web.json_response(error_body(message or exc.reason, "invalid_request_error" if exc.status < 500
                                                 else "internal_server_error", code=str(exc.status)),
                                     status=exc.status, headers={k: v for k, v in exc.headers.items()
                                                                 if k.lower() == "allow"})
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:
            log.exception("%s %s failed", request.method, request.path)
            return web.json_response(error_body(f"internal error: {type(exc).__name__}: {exc}",
                                                "internal_server_error"), status=500)

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler):
        key = self.limits.api_key
        if key and (request.path.startswith("/v1/") or request.path in KEYED_PATHS or (
                self.limits.api_key_protects_metrics and request.path in ("/metrics", "/ready"))):
            check_api_key(request, key)
        return await handler(request)

    def _generation(self, handler):
        async def tracked(request: web.Request) -> web.StreamResponse:
            if self.draining:
                raise ServiceUnavailableError("the server is shutting down", code="draining")
            ticket = self.admission.ticket()
            ticket.take(1)  # the request itself (429 past the bound); serving takes its further sequences
            self.num_in_flight += 1
            self._idle.clear()
            request[ADMISSION] = ticket
            try:
                request[MAY_SET_PRIORITY] = self._may_set_priority(request)
                body = await read_body(request, self.limits.body_read_timeout_s, self.limits.max_body_bytes)
                if len(body) > DEPTH_SCAN_INLINE_BYTES:  # numpy releases the GIL: the loop goes on meanwhile
                    await asyncio.to_thread(check_json_depth, body, self.serving.limits.max_json_depth)
                else:
                    check_json_depth(body, self.serving.limits.max_json_depth)
                return await handler(request)  # request.read() returns the body read here
            finally:
                ticket.release()
                self.num_in_flight -= 1
                if self.num_in_flight == 0:
                    self._idle.set()

        return tracked

    def _may_set_priority(self, request: web.Request) -> bool:
        """A request's ``priority`` moves it ahead of others in the engines' queues: only for
        callers the operator allows, all (``--allow-client-priority``) or those that present
        the priority key (``PLANARIA_PRIORITY_KEY``) as their bearer token."""
        if self.limits.allow_client_priority:
            return True
        key = self.limits.priority_key
        return bool(key) and bearer_matches(request, key)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Until no generation request is in flight; False at the timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    # -- small endpoints ------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        engines = self.client.engines
        num_healthy = sum(e.healthy for e in engines)
        ok = num_healthy > 0 and not self.draining
        body = {"ready": ok, "draining": self.draining, "num_healthy_engines": num_healthy,
                "engines": [{"index": e.index, "state": e.state, "pid": e.pid} for e in engines]}
        return web.json_response(body, status=200 if ok else 503)

    async def models(self, request: web.Request) -> web.Response:
        m = self.serving.model
        versions = await self.admin.weight_versions() if self.admin is not None else None
        return web.json_response(R.model_list(m.name, self.created, self.serving.max_model_len, m.path, versions))

    async def metrics_text(self, request: web.Request) -> web.Response:
        """Without the API key (when one is set and /metrics is open), nothing that tells how
        much of a prompt an engine had cached (metrics.CACHE_FAMILIES)."""
        key = self.limits.api_key
        text = self.metrics.render(self.client.engines, self.num_in_flight,
                                   max_in_flight=self.limits.max_inflight_requests,
                                   routing_decisions=self.client.routing_status()["decisions"],
                                   cache_figures=not key or bearer_matches(request, key))
        return web.Response(text=text, content_type="text/plain", charset="utf-8",
                            headers={"X-Prometheus-Format": "0.0.4"})


# -- building the real thing -------------------------------------------------------------
def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def load_model_info(model_dir: str | Path, tokenizer, served_model_name: str | None = None,
                    max_model_len: int | None = None, max_logprobs: int = 20) -> ModelInfo:
    d = Path(model_dir)
    cfg = _read_json(d / "config.json")
    gen = _read_json(d / "generation_config.json")
    eos = gen.get("eos_token_id", cfg.get("eos_token_id", tokenizer.eos_token_id))
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    vocab_size = cfg.get("vocab_size") or len(tokenizer)
    return ModelInfo(
        name=served_model_name or d.resolve().name, path=str(model_dir), vocab_size=vocab_size,
        max_model_len=max_model_len or cfg.get("max_position_embeddings") or 2048,
        eos_token_id=eos_ids[0] if eos_ids else None, extra_eos_token_ids=eos_ids[1:],
        max_logprobs=max_logprobs)


def create_server(client, model_dir: str | Path, served_model_name: str | None = None,
                  max_model_len: int | None = None, max_logprobs: int = 20,
                  limits: ServerLimits = ServerLimits(),
                  request_limits: RequestLimits = RequestLimits(),
                  tool_call_parser: str | None = "hermes") -> FrontendServer:
    """The real collaborators, built in one place: HF tokenizer, incremental detokenizer."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # deferred: transformers is heavy (seconds); tests build servers on fake tokenizers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = load_model_info(model_dir, tokenizer, served_model_name, max_model_len, max_logprobs)
    metrics = FrontendMetrics(model.name)
    client.on_iteration_details = metrics.iterations.observe
    generator = Generator(client, lambda ids, params: IncrementalDetokenizer(tokenizer, ids, params), metrics,
                          replay_wait_s=limits.engine_wait_s)

    def engine_max_model_len() -> int | None:
        lens = [e.max_model_len for e in client.engines if e.healthy and e.max_model_len]
        return min(lens) if lens else max_model_len

    renderer = PromptRenderer(tokenizer, limits.render_timeout_s, limits.render_threads)
    serving = OpenAIServing(generator, tokenizer, model, engine_max_model_len, limits=request_limits,
                            renderer=renderer, request_timeout_s=limits.request_timeout_s,
                            write_timeout_s=limits.write_timeout_s, tool_call_parser=tool_call_parser)
    server = FrontendServer(client, serving, metrics, limits)
    server.admin = EngineAdmin(client, utility_timeout_s=2.0)
    from planaria.engine.pooling.loader import is_bert_config  # deferred: engine.pooling imports torch

    server.embeddings = EmbeddingServing(client, tokenizer, model.name, model.path, lambda: serving.max_model_len,
                                         is_bert_config(_read_json(Path(model_dir) / "config.json")),
                                         vocab_size=model.vocab_size, limits=request_limits, renderer=renderer,
                                         request_timeout_s=limits.request_timeout_s)
    return server
