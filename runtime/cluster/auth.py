"""Proving a shared secret on the controller's port: an HMAC-SHA256 challenge-response, both ways.

Before its first message, a connection runs this handshake (one JSON object a line, like the protocol):

    controller -> peer   Challenge(nonce=S)                      S: 16 fresh random bytes, hex
    peer -> controller   Answer(nonce=C, proof=HMAC(secret, "worker" S C))
    controller -> peer   Welcome(proof=HMAC(secret, "controller" S C))

The controller accepts the peer only with a correct ``Answer``; the peer trusts the controller only with a
correct ``Welcome``. Both nonces are fresh on each connection, so a recorded exchange replays nothing, and the
role in each proof keeps one side's proof from being reflected as the other's. The secret never crosses the
wire. This module is sans-IO: the controller's async server and the worker's blocking socket both use it.

Where the secret comes from: ``launch`` makes a fresh one per run (:func:`new_secret`) and hands it to its own
workers in their environment (:data:`ENV_TOKEN`; never the command line, which any local user can read in
``/proc``). A user who starts workers elsewhere gives the same secret to both ends (:func:`load_secret`:
the variable, or a file named by :data:`ENV_TOKEN_FILE` that only its owner can read).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

import msgspec

from elastic_runtime.core.errors import AuthenticationFailed

__all__ = [
    "ENV_TOKEN",
    "ENV_TOKEN_FILE",
    "MAX_LINE",
    "Answer",
    "Challenge",
    "Welcome",
    "answer",
    "challenge",
    "check_welcome",
    "encode",
    "load_secret",
    "new_secret",
    "welcome",
]

ENV_TOKEN = "ELASTIC_RUNTIME_TOKEN"  # the secret itself
ENV_TOKEN_FILE = "ELASTIC_RUNTIME_TOKEN_FILE"  # or a file holding it (readable by its owner only)

MAX_LINE = 512  # a handshake line is ~150 bytes; a peer that sends more is not one of ours
_VERSION = "elastic-runtime/1"


class Challenge(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The controller's nonce, sent first on every connection."""

    nonce: str


class Answer(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The peer's nonce and its proof of the secret over both nonces."""

    nonce: str
    proof: str


class Welcome(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The controller's proof of the secret over both nonces: the peer is accepted."""

    proof: str


_encoder = msgspec.json.Encoder()
_challenge = msgspec.json.Decoder(Challenge)
_answer = msgspec.json.Decoder(Answer)
_welcome = msgspec.json.Decoder(Welcome)


def new_secret() -> str:
    """A fresh random secret (256 bits, hex)."""
    return secrets.token_hex(32)


def load_secret(environ: Mapping[str, str] = os.environ) -> str | None:
    """The secret from :data:`ENV_TOKEN`, else from the file :data:`ENV_TOKEN_FILE` names; None if neither is set.

    Raises:
        AuthenticationFailed: the token file cannot be read, is empty, or is readable by its group or others.
    """
    token = environ.get(ENV_TOKEN)
    if token:
        return token
    path = environ.get(ENV_TOKEN_FILE)
    if not path:
        return None
    try:
        mode = Path(path).stat().st_mode
        text = Path(path).read_text().strip()
    except OSError as exc:
        raise AuthenticationFailed(f"cannot read the token file {path}: {exc}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise AuthenticationFailed(f"the token file {path} is accessible to other users (mode {mode & 0o777:o})")
    if not text:
        raise AuthenticationFailed(f"the token file {path} is empty")
    return text


def encode(message: Challenge | Answer | Welcome) -> bytes:
    """One handshake message as a JSON line (newline included)."""
    return _encoder.encode(message) + b"\n"


def _proof(secret: str, role: str, server_nonce: str, client_nonce: str) -> str:
    text = f"{_VERSION} {role} {server_nonce} {client_nonce}".encode()
    return hmac.new(secret.encode(), text, hashlib.sha256).hexdigest()


_M = TypeVar("_M", Challenge, Answer, Welcome)


def _decode(decoder: msgspec.json.Decoder[_M], line: bytes, what: str) -> _M:
    try:
        return decoder.decode(line)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise AuthenticationFailed(f"expected {what}, got {line[:80]!r}: {exc}") from exc


def challenge() -> Challenge:
    """The controller's side, first: a challenge with a fresh nonce."""
    return Challenge(nonce=secrets.token_hex(16))


def welcome(secret: str, sent: Challenge, line: bytes) -> Welcome:
    """The controller's side, second: check the peer's answer to ``sent``; the reply that proves us in turn.

    Raises:
        AuthenticationFailed: the line is not an answer, or its proof is not of ``secret``.
    """
    reply = _decode(_answer, line, "Answer")
    want = _proof(secret, "worker", sent.nonce, reply.nonce)
    # compare_digest: the time a comparison takes must not tell how much of a guess was right.
    if len(reply.nonce) < 32 or not hmac.compare_digest(reply.proof.encode(), want.encode()):
        raise AuthenticationFailed("wrong proof of the secret")
    return Welcome(proof=_proof(secret, "controller", sent.nonce, reply.nonce))


def answer(secret: str, line: bytes) -> tuple[Answer, str]:
    """The peer's side, first: the answer to the controller's challenge, and the proof its welcome must carry.

    Raises:
        AuthenticationFailed: the line is not a challenge.
    """
    sent = _decode(_challenge, line, "Challenge")
    mine = secrets.token_hex(16)
    return (
        Answer(nonce=mine, proof=_proof(secret, "worker", sent.nonce, mine)),
        _proof(secret, "controller", sent.nonce, mine),
    )


class ClosedDuringHandshake(AuthenticationFailed):
    """The controller closed the connection before its welcome: it refused our proof, or it closed our waiting
    handshake to make room (it keeps a bounded number; a flood of connections can push a real worker out)."""


def check_welcome(expected: str, line: bytes) -> None:
    """The peer's side, second: the controller proved the secret too.

    Raises:
        ClosedDuringHandshake: the connection closed (our proof refused, or our handshake closed for room).
        AuthenticationFailed: the controller's proof is wrong.
    """
    if not line:
        raise ClosedDuringHandshake(
            "the controller closed the connection during the handshake: it did not accept our proof of the secret"
        )
    reply = _decode(_welcome, line, "Welcome")
    if not hmac.compare_digest(reply.proof.encode(), expected.encode()):
        raise AuthenticationFailed("the controller's proof of the secret is wrong: not our controller")
