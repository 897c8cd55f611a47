"""The dataset's per-sample (h, w) as the trainer asks for them (``DataServerClient``'s
sizes): one ``SizeFetch`` (session/announce.py) at a time, asked of the servers that
announce them; a failed or abandoned one is asked again. The engine owns one and runs it in
its I/O thread: the trainer's ask and abandon as commands, a pump each loop pass, the SIZES
answers through the handlers (``current``)."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from dataserver_client.errors import DataServerError
from dataserver_client.net.links import Links
from dataserver_client.net.serverlink import ServerLink
from dataserver_client.net.welcome import DatasetInfo
from dataserver_client.session.announce import SizeFetch


class SizeAsks:
    """The fetch of the sizes, once asked for (``current``; None: never, or abandoned)."""

    def __init__(self) -> None:
        self.current: SizeFetch | None = None

    def ask(self, info: DatasetInfo, links: Links, now: float) -> Future[np.ndarray]:
        """A Future of the table, asked of the servers now unless it is already (one fetch
        a client; a failed or abandoned one is asked again)."""
        assert info.sizes_count > 0
        fetch = self.current
        if fetch is None or (fetch.future.done() and fetch.future.exception() is not None):
            fetch = SizeFetch(info.sizes_count, info.sizes_digest)
            self.current = fetch
            fetch.pump(_servers(links), now)
        return fetch.future

    def pump(self, links: Links, now: float) -> None:
        """A loop pass: the fetch under way asks on (``SizeFetch.pump``)."""
        if self.current is not None and not self.current.future.done():
            self.current.pump(_servers(links), now)

    def abandon(self, why: str) -> None:
        """The trainer stopped waiting for the sizes: the fetch ends (a later ask starts
        another)."""
        if self.current is not None:
            self.current.fail(DataServerError(why))
            self.current = None


def _servers(links: Links) -> list[ServerLink]:
    """The servers a size fetch may ask: ready, announcing the sizes the handshake fixed
    (every accepted WELCOME does)."""
    return [
        link
        for link in links.ready()
        if link.welcome_msg is not None and link.welcome_msg.sizes_count > 0
    ]
