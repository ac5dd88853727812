"""Pooling (embedding) models: an encoder-only BERT, no KV cache, one pooled vector per
request. ``PoolingEngineCore`` has EngineCore's interface; ``engine.core.create_engine_core``
picks it for ``runner_type == "pooling"`` (or a BertModel checkpoint)."""

from planaria.engine.pooling.core import PoolingEngineCore, is_pooling_model

__all__ = ["PoolingEngineCore", "is_pooling_model"]
