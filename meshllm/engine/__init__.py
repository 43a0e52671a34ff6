"""Inference engines: llama.cpp (llama-cpp-python) and the ggml stage runtime (layer splits, ``--engine ggml``)."""
