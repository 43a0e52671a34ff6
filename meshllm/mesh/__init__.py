"""The mesh layer: admission, signed peer records, gossip, failure detection, the peer table and RTTs.

Every protocol here is sans-IO: objects take messages and the current time and return messages to
send and events, so they are tested without sockets or sleeping and driven by the node's event loop.
"""
