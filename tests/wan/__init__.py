"""The userspace WAN emulator shared by tests and benchmarks (``from wan import WanEmulator``).

:mod:`wan.link` is the sans-IO model of one direction of a link (delay, jitter, loss, bandwidth);
:mod:`wan.emulator` the UDP forwarder that puts nodes behind such links. The tests of both live
beside them; ``bench/wan.py`` measures splits and routed requests through it.
"""

from wan.emulator import WanEmulator, WanNode
from wan.link import LinkProfile, LinkState, LinkStats

__all__ = ["LinkProfile", "LinkState", "LinkStats", "WanEmulator", "WanNode"]
