"""This machine's own addresses: what a node bound to a wildcard address tells others to dial."""

from __future__ import annotations

import ipaddress

import ifaddr  # a dependency of zeroconf


def lan_addresses() -> list[str]:
    """Non-loopback, non-link-local IPv4 addresses of this machine's interfaces, in interface order."""
    found: list[str] = []
    for adapter in ifaddr.get_adapters():
        for ip in adapter.ips:
            if isinstance(ip.ip, str):
                addr = ipaddress.ip_address(ip.ip)
                if not addr.is_loopback and not addr.is_link_local and ip.ip not in found:
                    found.append(ip.ip)
    return found
