"""Planaria's compute kernels, written in plain torch: paged attention (attention.py), MoE
routing and grouped expert matmul (moe.py), RMSNorm (norm.py), rotary (rotary.py),
sampling (sampling.py), pooling (pooling.py).

There are no separate GPU kernels (no Triton or CUDA code): the same torch code runs on
CPU, where it is the reference, and on CUDA. tests/kernels/test_*.py check each kernel on
CPU against naive references; tests/kernels/test_kernels_gpu.py (marked ``gpu``, skipped
without a CUDA device) runs them, and a short engine generate, on CUDA in float32 and
bfloat16 and compares with the CPU results.

Note: this top-level package shadows the Hugging Face ``kernels`` hub package by import
name; tests/engine/test_demo_model.py checks transformers still reports it unavailable.
"""
