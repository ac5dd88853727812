"""A compiled decode forward: ``EngineConfig.compile`` (``planaria serve --compile``).

Decode-only batches (every sequence one new token: the steady state of serving) run the
model's forward through ``torch.compile`` (Inductor's CPU backend): one graph instead of
a few hundred Python-level module calls, and the elementwise work between the kernels
(rotary, residual adds, SiLU x up) fused into generated C++ loops. The C++ kernels and the
oneDNN-packed linears stay what they are: Inductor calls them as opaque ops (the fake
kernels below give it their output shapes). Batches with a prefill chunk run the eager
forward: a prefill is bound by its matmuls, not by Python.

Shapes: the batch size and the block-table width are dynamic (``mark_dynamic``), so one
graph serves every size in a range instead of one graph per size; a batch of one
sequence gets its own graph (torch specializes sizes of 1), and the linears' switch from
the C++ kernel to oneDNN (kernels/linear.py: bf16 past 8 rows) splits the rest in two,
so a bf16 model compiles 3 graphs. ``warm_up`` compiles them at start-up (a decode step
never waits for a compile), on dummy batches that touch one KV slot.

Cache: Inductor's and its FX graph cache live in ``TORCHINDUCTOR_CACHE_DIR``; the
supervisor points it at ``<state dir>/compile-cache`` so a restarted engine and a
scale-up standby load the compiled code instead of generating it again (Dynamo's
tracing runs every start). Expert-parallel engines run eager (their MoE layers talk to
peers mid-forward).

bfloat16: the fused elementwise code rounds once where eager rounds after each op, so a
compiled step's logits differ from eager's in the last bits (greedy tokens can differ
where two logits nearly tie); float32 agrees to float32 rounding. Measured in
bench/compiled_forward.py.
"""

from __future__ import annotations

import functools
import time

import structlog
import torch

from planaria.kernels import cpu_ext
from planaria.kernels.attention import AttentionMetadata, build_metadata

log = structlog.get_logger("planaria.engine.compiled")

@functools.cache
def register_fake_kernels() -> None:
    """Output shapes of the C++ ops for torch.compile's tracing (once per process)."""
    lib = torch.library

    @lib.register_fake("planaria::decode_attention")
    def _decode_attention(q, k_cache, v_cache, block_tables, ctx_lens, block_size, scale, out):
        return None

    @lib.register_fake("planaria::fused_moe")
    def _fused_moe(x, w13, w2, topk_weights, topk_ids, expert_offset, out):
        return None

    @lib.register_fake("planaria::rms_norm")
    def _rms_norm(x, weight, eps):
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    @lib.register_fake("planaria::skinny_linear")
    def _skinny_linear(x, w, bias):
        return x.new_empty((x.shape[0], w.shape[0]))

    @lib.register_fake("planaria::packed_linear")
    def _packed_linear(x, packed, bias):
        # a packed [N, K] weight is an opaque oneDNN tensor, but it reports its logical size
        return x.new_empty((x.shape[0], packed.shape[0]))

    @lib.register_fake("planaria::argmax_rows")
    def _argmax_rows(x):
        return x.new_empty((x.shape[0],), dtype=torch.long)


def _inference(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_inference() else x.clone()


def compilable(model, expert_parallel: bool = False) -> str | None:
    """Why this model's forward cannot take the compiled path (None: it can)."""
    if expert_parallel or any(getattr(m, "ep_forward", None) is not None for m in model.modules()):
        return "expert parallelism (MoE layers exchange tokens with peers mid-forward)"
    if model.batch_invariant:  # Inductor's fused elementwise code rounds unlike the eager prefill's
        return "batch-invariant mode (a compiled step would round unlike the eager prefill)"
    if next(model.parameters()).device.type == "cpu" and not cpu_ext.available():
        return f"the C++ CPU kernels are not loaded ({cpu_ext.status()})"
    return None


class CompiledDecode:
    """``model.forward`` compiled for decode-only batches (see the module docstring)."""

    def __init__(self, model) -> None:
        register_fake_kernels()
        self.model = model
        self.fn = torch.compile(model.forward, dynamic=False, fullgraph=True)

    def __call__(self, input_ids, positions, kv_caches, md: AttentionMetadata) -> torch.Tensor:
        with torch.inference_mode():
            # The graphs' guards include each input's dispatch keys: inference tensors
            # always (a copy of the few made outside inference mode), or a caller that
            # made them otherwise would trigger a compile mid-serving.
            input_ids, positions = _inference(input_ids), _inference(positions)
            md.slot_mapping, md.decode_ctx_lens = _inference(md.slot_mapping), _inference(md.decode_ctx_lens)
            blocks = md.decode_blocks
            if blocks.shape[1] < 2:  # a width of 1 would get a graph of its own
                blocks = torch.nn.functional.pad(blocks, (0, 1))
            md.decode_blocks = _inference(blocks)
            if input_ids.shape[0] > 1:
                for x in (input_ids, positions, md.slot_mapping, md.decode_blocks, md.decode_ctx_lens):
                    torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(md.decode_blocks, 1)
            return self.fn(input_ids, positions, kv_caches, md)

    def warm_up(self, kv_caches, block_size: int, max_num_seqs: int, device: torch.device) -> float:
        """Compile every graph a decode step can need, on dummy batches whose tokens all
        write KV slot 0 (block 0 holds no request yet). Returns the seconds it took."""
        t0 = time.monotonic()
        sizes = sorted({n for n in (1, 2, 4, 8, 9, 16, 32, 64, max_num_seqs) if n <= max_num_seqs})
        md = build_metadata([[0, 0]], [1], [], block_size, device)
        with torch.inference_mode():
            # one eager step first: the kernels' one-time lookups (the C++ library, CPU
            # flags) run in Python, not under tracing
            ids = torch.zeros(1, dtype=torch.long, device=device)
            self.model(ids, ids.clone(), kv_caches, md)
        for n in sizes:
            md = build_metadata([[0, 0]] * n, [1] * n, [], block_size, device)
            with torch.inference_mode():
                ids = torch.zeros(n, dtype=torch.long, device=device)
                s0 = time.monotonic()
                self(ids, ids.clone(), kv_caches, md)
            log.info("compiled decode forward warmed up", batch=n, seconds=round(time.monotonic() - s0, 2))
        return time.monotonic() - t0
