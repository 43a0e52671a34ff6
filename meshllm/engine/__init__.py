"""Inference engines: llama.cpp (llama-cpp-python) and the numpy stage runtime for layer splits."""
