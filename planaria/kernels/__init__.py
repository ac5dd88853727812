"""Planaria's compute kernels, written in plain torch: paged attention (attention.py), MoE
routing and grouped expert matmul (moe.py), RMSNorm (norm.py), rotary (rotary.py),
sampling (sampling.py), pooling (pooling.py), linears at a few rows (linear.py).

Tensors in, tensors out: the kernels import nothing else of planaria (checked by
tests/test_layers.py) and reject bad arguments with ValueError. What reads requests or
configs lives in the engine: the sampler that turns a step's SamplingMetadata into tokens
and Logprobs records is engine/sampler.py, the rotary frequencies of a checkpoint's config
are engine/models/rope.py.

C++ kernels for the CPU (csrc/, built at install by cpu_ext.py and loaded if present):
decode attention read from the paged KV cache in place and the fused MoE experts at
decode batches (float32, bfloat16, float16), RMSNorm (float32, bfloat16, float16; float32
sums in another order than torch's mean: the last bits differ), the greedy argmax, linears at a few rows
(linear.py says when each dtype takes it), and bf16 linears whose rows do not depend on
each other (the batch-invariant mode: linear.py, attention.py, moe.py take an
``invariant`` argument); the torch code stays the
fallback and the reference they are tested against. There
are no separate GPU kernels (no Triton or CUDA code): the same torch code runs on CPU and
on CUDA. tests/kernels/test_*.py check each kernel on
CPU against naive references; tests/kernels/test_kernels_gpu.py (marked ``gpu``, skipped
without a CUDA device) runs them, and a short engine generate, on CUDA in float32 and
bfloat16 and compares with the CPU results.

The package is ``planaria.kernels``, so it does not shadow the Hugging Face ``kernels`` hub
package that transformers imports (tests/test_namespace.py checks both work side by side).
"""
