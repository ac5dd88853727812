"""Planaria's compute kernels. The torch implementations here run on CPU and are the
reference; GPU variants must match them (tests/kernels, marked gpu).

Note: this top-level package shadows the Hugging Face ``kernels`` hub package by import
name; tests/engine/test_demo_model.py checks transformers still reports it unavailable.
"""
