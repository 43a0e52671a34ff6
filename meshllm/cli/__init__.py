"""The ``meshllm`` command line (click) and the rich status dashboard."""
