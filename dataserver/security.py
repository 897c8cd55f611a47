"""ZeroMQ CURVE: key files, the server's authenticator, the client's keys.

``dataserver keygen DIR`` writes ``NAME.key`` (public) and ``NAME.key_secret`` (public and
secret) in ZeroMQ's certificate format. A server started with ``--curve-secret-key
server.key_secret --curve-authorized-keys DIR`` accepts only clients whose public key file
is in DIR, and all traffic is encrypted.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


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
