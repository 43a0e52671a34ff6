"""The admission exchange core (sans-IO)."""

from __future__ import annotations

import pytest

from meshllm.errors import MeshllmError, Untrusted
from meshllm.net.admission import Admission, AdmissionError, Phase
from meshllm.net.messages import Confirm, Hello, Welcome


def refuse(proof: bytes) -> None:
    raise Untrusted(f"proof {proof!r} is not from this mesh")


def pair(dialer_admit=lambda p: None, acceptor_admit=lambda p: None):  # type: ignore[no-untyped-def]
    d = Admission(dialer=True, local_proof=b"pd", admit=dialer_admit, peer_addr=("10.0.0.2", 1))
    a = Admission(dialer=False, local_proof=b"pa", admit=acceptor_admit, peer_addr=("10.0.0.1", 2))
    return d, a


def test_both_sides_admit_and_learn_observed_addresses() -> None:
    seen: list[bytes] = []
    d, a = pair(dialer_admit=seen.append, acceptor_admit=seen.append)
    (hello,) = d.start()
    assert not a.serving
    (welcome,) = a.receive(hello)
    assert a.serving and a.phase is Phase.AWAIT_CONFIRM
    (confirm,) = d.receive(welcome)
    assert d.phase is Phase.ADMITTED and d.serving
    assert a.receive(confirm) == []
    assert a.phase is Phase.ADMITTED
    assert seen == [b"pd", b"pa"]
    assert d.observed == ("10.0.0.1", 2) and a.observed == ("10.0.0.2", 1)


def test_acceptor_refusal_reaches_dialer_with_reason() -> None:
    d, a = pair(acceptor_admit=refuse)
    (welcome,) = a.receive(d.start()[0])
    assert isinstance(welcome, Welcome) and not welcome.accepted and welcome.proof == b""
    assert a.phase is Phase.REFUSED and not a.serving
    assert d.receive(welcome) == []
    assert d.phase is Phase.REFUSED and d.refused_by_peer and "not from this mesh" in (d.refusal or "")


def test_dialer_refuses_acceptor_proof() -> None:
    d, a = pair(dialer_admit=refuse)
    (confirm,) = d.receive(a.receive(d.start()[0])[0])
    assert isinstance(confirm, Confirm) and not confirm.accepted
    assert d.phase is Phase.REFUSED and not d.refused_by_peer
    a.receive(confirm)
    assert a.phase is Phase.REFUSED and not a.serving


def test_buggy_admit_refuses_instead_of_crashing() -> None:
    def broken(proof: bytes) -> None:
        raise KeyError("bug")

    d, a = pair(acceptor_admit=broken)
    a.receive(d.start()[0])
    assert a.phase is Phase.REFUSED and a.refusal == "internal error while checking admission"


@pytest.mark.parametrize("message", [Confirm(True, ""), Welcome(True, "", b"", ("h", 1))])
def test_out_of_order_message_is_a_protocol_error(message) -> None:  # type: ignore[no-untyped-def]
    _, a = pair()
    with pytest.raises(AdmissionError):
        a.receive(message)
    assert issubclass(AdmissionError, MeshllmError)


def test_only_dialer_starts() -> None:
    _, a = pair()
    with pytest.raises(AdmissionError):
        a.start()
    assert isinstance(pair()[0].start()[0], Hello)


def test_a_passive_dialer_says_so_in_its_hello() -> None:
    d = Admission(dialer=True, local_proof=b"pd", admit=lambda p: None, peer_addr=("10.0.0.2", 1), passive=True)
    a = Admission(dialer=False, local_proof=b"pa", admit=lambda p: None, peer_addr=("10.0.0.1", 2))
    (hello,) = d.start()
    assert isinstance(hello, Hello) and hello.passive
    a.receive(hello)
    assert a.peer_passive and not d.peer_passive
