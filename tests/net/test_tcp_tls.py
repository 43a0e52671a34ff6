"""TLS 1.3 over TCP on node keys (net/tcp_tls.py), on real sockets on 127.0.0.1: both ends learn the
other's node id, and a client without a node certificate, or with one from another CA, gets nothing."""

from __future__ import annotations

import asyncio
import datetime
import ssl
import tempfile
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat
from cryptography.x509.oid import NameOID
from nacl.signing import SigningKey

from meshllm.identity.ids import node_id
from meshllm.net import tcp_tls
from meshllm.net.errors import PeerMismatch


def _foreign_context() -> ssl.SSLContext:
    """A client context with a self-signed Ed25519 certificate that no meshllm node issued."""
    key = Ed25519PrivateKey.generate()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "stranger")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, algorithm=None))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with tempfile.TemporaryDirectory() as tmp:
        cert_file, key_file = Path(tmp, "c.pem"), Path(tmp, "k.pem")
        cert_file.write_bytes(cert.public_bytes(Encoding.PEM))
        key_file.write_bytes(key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption()))
        ctx.load_cert_chain(cert_file, key_file)
    return ctx


def test_both_ends_learn_each_others_node_id_and_strangers_get_nothing() -> None:
    server_key, client_key = SigningKey.generate(), SigningKey.generate()

    async def main() -> None:
        server_ctx, _ = tcp_tls.contexts(server_key)
        _, client_ctx = tcp_tls.contexts(client_key)
        seen: list[str] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(tcp_tls.peer_node_id(writer.get_extra_info("ssl_object")))
            writer.write(b"hello")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_ctx)
        port = server.sockets[0].getsockname()[1]
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx)
            tcp_tls.check_peer(writer.get_extra_info("ssl_object"), node_id(bytes(server_key.verify_key)))
            with pytest.raises(PeerMismatch):
                tcp_tls.check_peer(writer.get_extra_info("ssl_object"), node_id(bytes(client_key.verify_key)))
            assert await asyncio.wait_for(reader.read(), 5.0) == b"hello"
            writer.close()
            assert seen == [node_id(bytes(client_key.verify_key))]
            # no client certificate, or one no meshllm node issued: the handshake fails, nothing is served
            bare = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            bare.check_hostname, bare.verify_mode = False, ssl.CERT_NONE
            for ctx in (bare, _foreign_context()):
                with pytest.raises((ssl.SSLError, ConnectionError)):
                    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=ctx)
                    data = await asyncio.wait_for(reader.read(), 5.0)
                    writer.close()
                    if not data:
                        raise ConnectionError("closed without a byte")
            assert len(seen) == 1
        finally:
            server.close()

    asyncio.run(main())
