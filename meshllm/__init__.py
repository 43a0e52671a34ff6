"""meshllm: pool spare machines into one OpenAI-compatible LLM service."""

__version__ = "0.1.0"
