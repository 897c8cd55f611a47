"""ZeroMQ CURVE: key files, the server's authenticator, the client's keys.

``dataserver keygen DIR`` writes ``NAME.key`` (public) and ``NAME.key_secret`` (public and
secret) in ZeroMQ's certificate format. A server started with ``--curve-secret-key
server.key_secret --curve-authorized-keys DIR`` accepts only clients whose public key file
is in DIR, and all traffic is encrypted.

Sessions are bound to keys: with CURVE, a client's session id begins with a tag of its
public key (``session_id``); the front refuses any message whose session id does not carry
the tag of the key that authenticated its connection, and a worker sends results straight
only to a connection that claimed the session with that key (``server/worker/direct.py``). So no
other key can use, or take over, a session. Besides its id, every session has a secret
(``new_secret``) that its HELLO binds and every message acting for it must carry: the id
names a session, the secret proves the sender is its owner. Without CURVE the secret is a
bearer token: nobody on the host can learn it (it is in no file name, log or STATS answer),
but anyone who can read the network traffic can.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from dataserver.tcpinfo import connection_ends

TAG_BYTES = 8


def session_tag(public_key_z85: bytes | str) -> bytes:
    """The first bytes of every session id a key may use."""
    key = public_key_z85.encode() if isinstance(public_key_z85, str) else public_key_z85
    return hashlib.blake2b(key, digest_size=TAG_BYTES, person=b"dataserver-sess").digest()


def session_id(public_key_z85: bytes | None = None) -> bytes:
    """A new 16-byte session id; tagged with ``public_key_z85`` when CURVE is on."""
    head = session_tag(public_key_z85) if public_key_z85 else os.urandom(TAG_BYTES)
    return head + os.urandom(16 - TAG_BYTES)


def new_secret() -> bytes:
    """A session's secret: what proves a message acts for the session (the id only names
    it). Never written to a file name, a log line or a STATS answer."""
    return os.urandom(16)


# A client claims its session (a HELLO) on each of its result connections to a worker as
# the connection comes up and this often after: a worker shuts down a result connection
# with no claim for 4 times this (or ``--idle-timeout``, when longer).
CLAIM_S = 5.0


def reply_id(secret: bytes) -> bytes:
    """The routing id a client's result connections use: derived from its session's
    secret, so only the session's owner can take its direct results (ROUTER_HANDOVER
    hands a name to whoever connects with it)."""
    return hashlib.blake2b(secret, digest_size=16, person=b"dataserver-rply").digest()


# The key the front and its workers share (in the workers' environment, never on a command
# line: ``/proc/PID/cmdline`` is anyone's to read) to tag the claims of admitted sessions.
CLAIM_KEY_ENV = "DATASERVER_CLAIM_KEY"


def claim_tag(key: bytes, session: bytes, name: bytes) -> bytes:
    """What proves a claim on a worker's result port is an admitted session's (issue 40):
    the front hands it to the session in its WELCOME (``claim``), keyed by what only the
    front and its workers hold, bound to the session id and its connections' name
    (``reply_id`` of its secret). A secret made up by a peer names its own connection but
    earns no tag."""
    return hashlib.blake2b(
        session + name, key=key, digest_size=16, person=b"dataserver-clm"
    ).digest()


def host_proof(token: str, nonce: bytes, session: bytes, ends: bytes) -> bytes:
    """What a server's WELCOME says to prove it is on the client's host without saying its
    host token (the token is in a file of the server's 0700 state dir; a client on the
    host reads it and checks): HMAC-SHA256 under the token of the HELLO's ``nonce``, the
    session id and the two ends of the connection the HELLO came by (``proof_ends``); 16
    bytes. A new nonce each HELLO: a replayed WELCOME proves nothing. The ends (issue 40
    item 6): a relay that forwards a trainer's HELLO to the real server gets a proof made
    for the relay's own connection to the server, which is not the trainer's connection
    to the relay (no two listeners of one host share an address and port), so the
    trainer does not take the relay for a server on its host."""
    body = msgpack.packb([b"host", nonce, session, ends], use_bin_type=True)
    return hmac.new(token.encode(), body, hashlib.sha256).digest()[:16]


def proof_ends(fd: int, server: bool) -> bytes | None:
    """The connection ``fd`` as a host proof binds it: its client's end, then its server's
    (``tcpinfo.connection_ends``), the same bytes whichever side asks (``server``: this
    process accepted the connection). None when ``fd`` names no connection (no proof)."""
    ends = connection_ends(fd) if fd >= 0 else None
    if ends is None:
        return None
    peer, own = ends
    return msgpack.packb([peer, own] if server else [own, peer], use_bin_type=True)


def same_secret(bound: bytes, given: bytes | None) -> bool:
    """Whether ``given`` is the session's secret ``bound`` (in constant time)."""
    return given is not None and hmac.compare_digest(bound, given)


def owns(session: bytes, user_id: str | None) -> bool:
    """Whether the CURVE user ``user_id`` (its z85 public key) may use ``session``."""
    return bool(user_id) and session[:TAG_BYTES] == session_tag(user_id or "")


class CurveKeyError(ValueError):
    """A key file or key value that cannot be used."""


def keygen(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write a key pair; return (public file, secret file)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(out), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def load_keypair(
    source: str | os.PathLike[str] | bytes, need_secret: bool
) -> tuple[bytes, bytes | None]:
    """(public, secret) from a key file path, or from a z85 key given as bytes (a secret
    key when ``need_secret``, else a public key)."""
    if isinstance(source, bytes):
        if len(source) != 40:
            raise CurveKeyError("a CURVE key given as bytes must be 40 z85 characters")
        if need_secret:
            return zmq.curve_public(source), source
        return source, None
    path = Path(source)
    if not path.is_file():
        raise CurveKeyError(f"no key file {path}")
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (ValueError, OSError) as exc:
        raise CurveKeyError(f"{path} is not a CURVE key file: {exc}") from None
    if need_secret and secret is None:
        raise CurveKeyError(f"{path} holds no secret key (use the .key_secret file)")
    return public, secret


def client_curve_keys(server_key: str | bytes, secret_key: str | bytes) -> dict[str, bytes]:
    """The client's side: the server's public key and this client's key pair."""
    server_public, _ = load_keypair(server_key, need_secret=False)
    public, secret = load_keypair(secret_key, need_secret=True)
    return {"server_public": server_public, "public": public, "secret": secret or b""}


def start_server_curve(
    ctx: zmq.Context[Any], secret_key_file: str, authorized_dir: str, sockets: list[zmq.Socket[Any]]
) -> ThreadAuthenticator:
    """Make ``sockets`` CURVE servers that accept only the public keys in ``authorized_dir``."""
    public, secret = load_keypair(secret_key_file, need_secret=True)
    if not Path(authorized_dir).is_dir():
        raise CurveKeyError(f"--curve-authorized-keys {authorized_dir} is not a directory")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(authorized_dir))
    for sock in sockets:
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
    return auth


def read_own_file(path: str | os.PathLike[str], limit: int) -> bytes | None:
    """The first ``limit`` bytes of ``path`` if it is a regular file of this process's
    user; None otherwise. Never blocks on it (a FIFO, a stalled mount) and never follows
    a link: the path may come from someone else (a server's announcement, a registry)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)
