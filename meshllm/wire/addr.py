"""``host:port`` text <-> ``(host, port)`` tuples, the one address format in records and invites."""

from __future__ import annotations

from meshllm.errors import DecodeError


def parse_addr(text: str) -> tuple[str, int]:
    """``"1.2.3.4:9338"`` or ``"[::1]:9338"`` -> ``(host, port)``; :class:`DecodeError` otherwise."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DecodeError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def format_addr(addr: tuple[str, int] | tuple[str, int, int, int]) -> str:
    """``(host, port)`` -> ``"host:port"`` (IPv6 hosts in brackets)."""
    host, port = addr[0], addr[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
