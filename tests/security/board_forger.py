"""A malicious member for tests: the real node, whose blackboard posts carry attacks.

Usage (tests/nodes.py ``entry``): ``python tests/security/board_forger.py join TOKEN --client ...``.
When its API is asked to post a note, it first pushes to every connected peer, unasked, one
``Notes`` message each of: a genuine note, the same note again (a replay), a note whose text was
changed after signing (a forgery), a validly signed note of 5,000 bytes, and eleven validly signed
notes of one minute; then it posts the note asked for as usual. Test-only: nothing in ``meshllm``
knows about it.
"""

from __future__ import annotations

import os
import sys
import time

from meshllm.mesh.blackboard import HeldNote, Note, Notes, Send, sign_note
from meshllm.mesh.blackboard_service import BlackboardService

_real_post = BlackboardService.post


def _attacking_post(self: BlackboardService, text: str) -> HeldNote:
    assert self.mesh.gossip is not None
    own, key = self.mesh.gossip.own, self.mesh.key.signing_key

    def signed(body: str) -> bytes:
        return sign_note(key, Note(author=self.mesh.node_id, mesh_id=own.mesh_id, name=own.name, ts=time.time(),
                                   nonce=os.urandom(16), text=body, membership_proof=own.membership_proof,
                                   owner_cert=own.owner_cert))

    genuine = signed("STATUS: genuine")
    forged = bytearray(signed("STATUS: tampered"))
    forged[forged.index(b"tampered")] ^= 0x20
    batches = [[genuine], [genuine], [bytes(forged)], [signed("STATUS: " + "x" * 5000)],
               [signed(f"STATUS: burst {i}") for i in range(11)]]
    for peer in sorted(self.core.connected):
        self._handle([Send(peer, Notes(batch)) for batch in batches])
    return _real_post(self, text)


if __name__ == "__main__":
    BlackboardService.post = _attacking_post  # type: ignore[method-assign]
    from meshllm.cli.main import main

    sys.argv = ["meshllm", *sys.argv[1:]]
    main()
