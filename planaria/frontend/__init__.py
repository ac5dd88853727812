"""The OpenAI-compatible HTTP frontend: parses requests, tokenizes, talks to the engines
through ``engine.client.EngineClient``, detokenizes and streams.

    protocol.py    request structs (msgspec) and body decoding          pure
    params.py      request -> SamplingParams / structured output / fit   pure
    prompts.py     prompts and chat messages -> token ids                 tokenizer only
    logprobs.py    engine Logprobs -> the two OpenAI logprobs formats     pure
    generation.py  the one place that calls client.generate (journal goes here later)
    responses.py   OpenAI response and chunk bodies                       pure
    serving.py     the two generation endpoints: JSON bodies and SSE
    errors.py      FrontendError tree -> OpenAI error bodies (status, type, param, code)
    metrics.py     Prometheus metrics (prometheus_client, own registry)   pure
    server.py      aiohttp routes and SSE
    liveness.py    the event loop's beats to the supervisor (a frozen loop is restarted)
    main.py        ``python -m planaria.frontend.main``
"""
