"""Errors raised by the engine package. Exceptions become wire error codes in one place
(engine/proc.py); callers keep causes with ``raise ... from exc``."""


class EngineError(Exception):
    """Base class for every engine error."""


class InvalidRequestError(EngineError, ValueError):
    """A request (prompt or sampling parameters) is not valid; only that request fails."""


class UnsupportedModelError(EngineError):
    """The checkpoint's architecture or a config value is not supported."""


class ModelLoadError(EngineError):
    """Weights or config could not be read from the model directory."""


class KVCacheTooSmallError(EngineError):
    """The KV cache cannot hold even one block, or one sequence of max_model_len."""


class EngineDeadError(EngineError):
    """The engine core died (reported by itself or by the supervisor)."""
