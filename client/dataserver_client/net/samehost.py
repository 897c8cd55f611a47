"""Whether a server shares this client's host (``same_host``: the proof its WELCOME gave,
made with the token beside its ipc endpoints, for our HELLO's nonce and the connection it
came by), and where to reach the worker endpoints a server announces
(``announced_address``). ``ServerLink.sync_results`` asks both: a server proven on our
host is reached by its ipc endpoints and takes our landing buffer."""

from __future__ import annotations

import hmac
import os
from collections.abc import Sequence

from dataserver.endpoint import tcp_endpoint, tcp_port
from dataserver.security import host_proof, read_own_file


def announced_address(data_address: str, announced: str) -> str:
    """Where to connect to an endpoint a server announces (its workers' results): its
    port on the host we reached the server by (it may have bound 0.0.0.0, which is no
    address to connect to)."""
    m = tcp_endpoint(data_address)
    port = tcp_port(announced)
    if m is None or port is None:
        return announced
    return f"tcp://{m.host}:{port}"


def same_host(
    local: Sequence[str], proof: bytes, nonce: bytes, session: bytes, ends: bytes | None
) -> bool:
    """Whether the token in the file beside the server's first ipc endpoint makes the
    ``proof`` its WELCOME gave for our HELLO's ``nonce`` on the connection ``ends`` it came
    by (``security.host_proof``): then this client shares its host and file system, and
    its ipc endpoints reach it. The token itself never goes on the wire, so no one who is
    not on the host can make the proof; and it is made for one connection, so a relay
    (ours to it is not its own to the server) cannot pass the real server's on."""
    if not proof or ends is None or not local or not local[0].startswith("ipc://"):
        return False
    path = os.path.join(os.path.dirname(local[0][len("ipc://") :]), "host-token")
    # The path comes from the server: believe only a regular file of our own user.
    raw = read_own_file(path, 128)
    if raw is None:
        return False
    token = raw.decode(errors="replace").strip()
    return hmac.compare_digest(host_proof(token, nonce, session, ends), proof)
