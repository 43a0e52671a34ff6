"""Discovery of published meshes: signed listings, found on the LAN (mDNS) or the internet (DHT).

:mod:`.listing` is the pure core (make and verify listings); :mod:`.mdns` advertises and browses
on the LAN and fetches listings over QUIC; :mod:`.dht` runs a py-libp2p Kademlia DHT in a thread.
libp2p is imported only when a :class:`~meshllm.discovery.dht.DhtNode` starts, so importing this
package never loads it. See docs/meshes.md.
"""
