"""A stage server in its own process, for tests that kill it with -9 mid-request.

Usage: python stage_proc.py <gguf> <layer_start> <layer_end>; prints ``node_id port``, then serves.
"""

from __future__ import annotations

import asyncio
import sys

from nacl.signing import SigningKey

from meshllm.engine.ggml import StageModel
from meshllm.net import Endpoint, EndpointOptions
from meshllm.split import StageServer


async def main(path: str, start: int, end: int) -> None:
    endpoint = await Endpoint.create(
        SigningKey.generate(), "127.0.0.1", 0, admit=lambda *_: None, local_proof=lambda: b"p",
        options=EndpointOptions(probe_interval=0.1),
    )
    StageServer(endpoint).host("tiny", StageModel.load(path, start, end, max_context=256))
    print(endpoint.node_id, endpoint.local_addr[1], flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
