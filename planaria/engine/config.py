"""Engine configuration: one msgspec struct, so it can travel to an engine process."""

from __future__ import annotations

import hashlib

import msgspec

from planaria.engine.errors import EngineError


class EngineConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str
    dtype: str | None = None  # None / "auto": engine/dtype.py (bf16 on AMX/AVX512-BF16 CPUs and GPUs)
    device: str = "cpu"
    seed: int = 0
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 64
    # Requests an engine process lets wait (not yet running: queued, preempted, compiling a
    # grammar); one more gets at once an error output with error_code "overloaded". None:
    # 4 x max_num_seqs (256 by default), about four batches: beyond that a request would
    # wait several whole generations, and a fast refusal lets the caller go elsewhere or
    # back off. The offline LLM API feeds its own queue and is not bounded.
    max_num_waiting: int | None = None
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"  # or "priority"
    max_concurrent_batches: int = 1
    # KV cache sizing: an explicit kv_cache_bytes (or num_kv_blocks) skips profiling.
    kv_cache_bytes: int | None = None
    num_kv_blocks: int | None = None
    kv_source: str | None = None  # set "reused" by a scale-up launch that passes kv_cache_bytes
    memory_budget_bytes: int | None = None  # None: device memory (GPU) / available RAM (CPU)
    memory_utilization: float = 0.9
    max_cpu_kv_cache_bytes: int = 4 * 2**30  # CPU: never take more than this for KV by default
    num_threads: int | None = None  # CPU torch threads; None: all cores
    max_logprobs: int = 20
    # "generate" (decoder, KV cache) or "pooling" (encoder, embeddings); None: from the
    # checkpoint's architecture (BertModel -> pooling).
    runner_type: str | None = None
    tokenizer: str | None = None  # structured outputs' tokenizer; None: the model directory
    strict_max_model_len: bool = False  # refuse (KVCacheTooSmallError) instead of lowering it
    iteration_details: bool = False  # per-step records on the outputs (engine/iteration_details.py)
    # decode-only batches through torch.compile (engine/compiled.py): graphs compiled at
    # start-up (tens of seconds on a small CPU, less from the cache), then less Python per step
    compile: bool = False
    # every kernel's result for a token independent of its batch-mates and of prefill vs
    # decode, so a request's tokens and logprobs replay bit for bit (docs/performance.md,
    # "Batch invariance"); None: "auto", on where its kernels are as fast
    # (engine/batch_invariance.py); True needs the C++ CPU kernels; no compiled forward
    batch_invariant: bool | None = None

    def validate(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise EngineError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.max_num_seqs <= 0:
            raise EngineError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_waiting is not None and self.max_num_waiting < 1:
            raise EngineError(f"max_num_waiting must be positive, got {self.max_num_waiting}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise EngineError("max_num_batched_tokens must be >= max_num_seqs")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise EngineError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise EngineError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.max_concurrent_batches < 1:
            raise EngineError("max_concurrent_batches must be >= 1")
        if self.runner_type not in (None, "generate", "pooling"):
            raise EngineError(f"runner_type must be 'generate' or 'pooling', got {self.runner_type!r}")

    @property
    def waiting_limit(self) -> int:
        """max_num_waiting, or its default (4 x max_num_seqs)."""
        return self.max_num_waiting if self.max_num_waiting is not None else 4 * self.max_num_seqs

    def hash(self) -> str:
        """Fingerprint of the settings that must match between engines and frontends."""
        keys = (self.model, self.dtype, self.max_model_len, self.block_size)
        return hashlib.sha256(msgspec.json.encode(keys)).hexdigest()[:16]
