"""Serving: the `leap_sparse` vLLM quantization method and the sparse linear op it computes with."""
