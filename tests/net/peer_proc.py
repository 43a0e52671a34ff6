"""A transport peer in its own process, for tests that kill it (-9) mid-connection.

Usage: python peer_proc.py <hex seed>; prints its port on stdout, then serves until killed.
"""

from __future__ import annotations

import asyncio
import sys

from nacl.signing import SigningKey

from meshllm.net import Endpoint


async def main(seed: str) -> None:
    endpoint = await Endpoint.create(
        SigningKey(bytes.fromhex(seed)), "127.0.0.1", 0, admit=lambda *_: None, local_proof=lambda: b"p"
    )
    print(endpoint.local_addr[1], flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
