"""Proving the cluster secret on a fresh connection: challenge and response, both ways.

The side that accepted sends a random nonce; the side that dialed answers with its claim
(its rank), its own nonce and HMAC-SHA256(key, "dial" || purpose || both nonces || claim);
the accepting side checks it in constant time and answers with the "accept" MAC over the same
values, which the dialer checks in turn. Fresh nonces on both sides mean a recorded
exchange proves nothing later, and the direction in every MAC means one side's answer cannot
be reflected back as the other's. One round trip more than a plain hello, at link set-up only.

A failed proof is a ProofError; the caller closes the socket. The key is never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import time

NONCE_BYTES = 32
_MAGIC = b"shoal-p1"
_CHALLENGE = struct.Struct("<8s32s")  # magic, the accepting side's nonce
_ANSWER = struct.Struct("<q32s32s")  # claim, the dialing side's nonce, its MAC
_CONFIRM = struct.Struct("<32s")  # the accepting side's MAC


class ProofError(ConnectionError):
    """The other side did not prove the cluster secret (or broke off while trying)."""


def challenge(sock: socket.socket, key: bytes, purpose: bytes, timeout_s: float) -> int:
    """Accepting side: the dialer's proven claim (ProofError if its MAC is wrong; another
    OSError, TimeoutError included, if it breaks off or stays silent for timeout_s)."""
    deadline = time.monotonic() + timeout_s
    ours = secrets.token_bytes(NONCE_BYTES)
    _send(sock, _CHALLENGE.pack(_MAGIC, ours), deadline)
    claim, theirs, mac = _ANSWER.unpack(_recv(sock, _ANSWER.size, deadline))
    if not hmac.compare_digest(mac, _mac(key, b"dial", purpose, ours, theirs, claim)):
        raise ProofError("its answer does not prove the cluster secret")
    _send(sock, _CONFIRM.pack(_mac(key, b"accept", purpose, ours, theirs, claim)), deadline)
    return claim


def prove(sock: socket.socket, key: bytes, purpose: bytes, claim: int,
          timeout_s: float) -> None:
    """Dialing side: answer the challenge with claim and check the other side's proof in
    turn (ProofError if it fails or the other side hangs up on our answer)."""
    deadline = time.monotonic() + timeout_s
    magic, theirs = _CHALLENGE.unpack(_recv(sock, _CHALLENGE.size, deadline))
    if magic != _MAGIC:
        raise ProofError("it does not speak shoal's proof protocol")
    ours = secrets.token_bytes(NONCE_BYTES)
    _send(sock, _ANSWER.pack(claim, ours, _mac(key, b"dial", purpose, theirs, ours, claim)),
          deadline)
    try:
        (mac,) = _CONFIRM.unpack(_recv(sock, _CONFIRM.size, deadline))
    except ConnectionError:  # closed on us: our answer was refused
        raise ProofError("it refused this side's proof (a different cluster secret?)") from None
    if not hmac.compare_digest(mac, _mac(key, b"accept", purpose, theirs, ours, claim)):
        raise ProofError("its answer does not prove the cluster secret")


def _mac(key: bytes, direction: bytes, purpose: bytes, accepting_nonce: bytes,
         dialing_nonce: bytes, claim: int) -> bytes:
    message = b"\0".join((direction, purpose, accepting_nonce, dialing_nonce,
                          struct.pack("<q", claim)))
    return hmac.new(key, message, hashlib.sha256).digest()


def _remaining(deadline: float) -> float:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("the proof of the cluster secret took too long")
    return remaining


def _send(sock: socket.socket, data: bytes, deadline: float) -> None:
    sock.settimeout(_remaining(deadline))
    sock.sendall(data)


def _recv(sock: socket.socket, size: int, deadline: float) -> bytes:
    data = bytearray()
    while len(data) < size:
        sock.settimeout(_remaining(deadline))
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the other side closed the connection during the proof")
        data += chunk
    return bytes(data)
