"""Planaria: a fault-tolerant, elastic LLM serving daemon.

Every importable part lives in this one namespace (generic top-level names collide with
other distributions: transformers imports Hugging Face's ``kernels``, python-daemon ships
``daemon``):

    planaria.engine    engine core, engine process, client, offline ``LLM``
    planaria.kernels   torch reference kernels (paged attention, MoE, norms, rotary, sampling)
    planaria.frontend  OpenAI-compatible HTTP server, request journal and replay
    planaria.daemon    the ``planaria`` CLI and the supervisor
    planaria.elastic   etcd membership, election, epochs, expert parallelism
"""

__version__ = "0.1.0"
