"""``python -m meshllm`` runs the CLI (the same as the ``meshllm`` console script)."""

from meshllm.cli.main import main

main()
