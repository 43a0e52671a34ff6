"""The userspace WAN emulator shared by tests and benchmarks (``from wan import WanEmulator``).

:mod:`wan.link` is the sans-IO model of one direction of a link (delay, jitter, loss, bandwidth),
:mod:`wan.forwarder` the process that forwards UDP through such links, :mod:`wan.emulator` its handle
and the node options that put a node behind it. :mod:`wan.tun` applies the same links to every IP
packet between nodes in network namespaces (root), so TCP (the bulk channel, stage lanes) crosses
them too. The tests live beside them; ``bench/wan.py``
measures splits and routed requests through it.
"""

from wan.emulator import WanEmulator, WanError, WanNode
from wan.link import LinkProfile, LinkState, LinkStats

__all__ = ["LinkProfile", "LinkState", "LinkStats", "WanEmulator", "WanError", "WanNode"]
