"""A real S3 API for the tests and ``dataserver bench --only remote``, as processes of their own: moto's S3 app under waitress
(keep-alive; its stock ``moto_server`` closes every connection), and in front of it a
small TCP proxy that delays what the store sends back (the latency a network would add:
this kernel has no netem), answers a share of requests 503 SlowDown (throttling), and
refuses a request signed with another access key id than the one it is told (moto checks
no signature: the proxy is the store's gatekeeper).

    python -m dataserver.bench.objstore store            prints "port N", serves
    python -m dataserver.bench.objstore proxy UPSTREAM_PORT --delay-ms 30 --fail-every 7 --key AKID

It needs moto's server extra and waitress (the ``test`` extra).

``ObjectStore`` (a context manager) runs both, uploads, and always stops them; it can
kill the store and start it again on the same port (its contents uploaded again: moto
keeps them in memory).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType

ACCESS_KEY = "AKIDDATASERVERTEST01"
SECRET_KEY = "dataserver-test-secret-0123456789abcdef"
BUCKET = "dsbucket"
_CREDENTIAL = re.compile(rb"Credential=([A-Z0-9]+)/")
_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.IGNORECASE)


def _slowdown(status: str, code: str) -> bytes:
    body = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>{code}</Message></Error>"
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n\r\n{body}"
    ).encode()


class _Proxy:
    """One proxy: each connection forwarded to the store, what comes back delayed."""

    def __init__(self, upstream: int, delay: float, fail_every: int, key: str) -> None:
        self.upstream = upstream
        self.delay = delay
        self.fail_every = fail_every
        self.key = key
        self.served = 0

    def _answer(self, head: bytes) -> bytes | None:
        """The proxy's own answer to a request (a refusal, throttling), or None: forward."""
        self.served += 1
        cred = _CREDENTIAL.search(head)
        if self.key and cred is not None and cred.group(1).decode() != self.key:
            return _slowdown("403 Forbidden", "InvalidAccessKeyId")
        if self.fail_every and self.served % self.fail_every == 0:
            return _slowdown("503 Slow Down", "SlowDown")
        return None

    async def _to_store(
        self,
        reader: asyncio.StreamReader,
        up_w: asyncio.StreamWriter,
        back: asyncio.Queue[tuple[float, bytes] | None],
    ) -> None:
        """Requests forwarded whole (head and body), or answered here (``_answer``)."""
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            m = _LENGTH.search(head)
            body = await reader.readexactly(int(m.group(1))) if m else b""
            answer = self._answer(head)
            if answer is not None:
                await back.put((time.monotonic(), answer))
            else:
                up_w.write(head + body)
                await up_w.drain()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            writer.close()  # the store is gone: the client sees the connection closed
            return
        back: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def from_store() -> None:
            while data := await up_r.read(1 << 16):
                await back.put((time.monotonic(), data))
            await back.put(None)

        async def to_client() -> None:
            while (item := await back.get()) is not None:
                at, data = item
                await asyncio.sleep(max(0.0, at + self.delay - time.monotonic()))
                writer.write(data)
                await writer.drain()
            writer.close()

        tasks = [
            asyncio.ensure_future(from_store()),
            asyncio.ensure_future(to_client()),
            asyncio.ensure_future(self._to_store(reader, up_w, back)),
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.sleep(self.delay + 0.05)  # (what the store sent is still delivered)
        except Exception:
            pass
        finally:
            for t in tasks:
                t.cancel()
            up_w.close()
            writer.close()


async def _proxy(upstream: int, delay: float, fail_every: int, key: str, port: int) -> None:
    proxy = _Proxy(upstream, delay, fail_every, key)
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", port, reuse_address=True)
    print(f"port {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


def _store(port: int) -> None:
    import waitress
    from moto.moto_server.werkzeug_app import create_backend_app

    server = waitress.create_server(
        create_backend_app("s3"), host="127.0.0.1", port=port, threads=8
    )
    print(f"port {server.effective_port}", flush=True)
    server.run()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["store", "proxy"])
    p.add_argument("upstream", type=int, nargs="?", default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--delay-ms", type=float, default=30.0)
    p.add_argument("--fail-every", type=int, default=0)
    p.add_argument("--key", default="")
    args = p.parse_args()
    if args.role == "store":
        _store(args.port)
    else:
        proxy = _proxy(args.upstream, args.delay_ms / 1000, args.fail_every, args.key, args.port)
        asyncio.run(proxy)


class _Process:
    """A child that prints ``port N`` when it listens; stopped by ``stop``."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dataserver.bench.objstore", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("port "):
            self.stop()
            raise RuntimeError(f"{args[0]} did not start: {line!r}")
        self.port = int(line.split()[1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


class ObjectStore:
    """moto S3 behind the delaying proxy; ``env`` is what a server needs to reach it."""

    def __init__(self, delay_ms: float = 30.0, fail_every: int = 0) -> None:
        self.delay_ms = delay_ms
        self.fail_every = fail_every
        self.objects: dict[str, bytes] = {}
        self.store: _Process | None = None
        self.proxy: _Process | None = None

    def __enter__(self) -> ObjectStore:
        try:
            self.store = _Process("store")
            self.proxy = self._start_proxy()
            self._bucket()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        for p in (self.proxy, self.store):
            if p is not None:
                p.stop()

    def env(self, key: str = ACCESS_KEY, secret: str = SECRET_KEY) -> dict[str, str]:
        assert self.proxy is not None
        return {
            "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.proxy.port}",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def _bucket(self) -> None:
        assert self.store is not None
        url = f"http://127.0.0.1:{self.store.port}/{BUCKET}"
        urllib.request.urlopen(urllib.request.Request(url, method="PUT"), timeout=30)

    def put(self, key: str, data: bytes) -> str:
        """Upload straight to the store (not through the proxy); returns its s3:// URL."""
        import obstore
        from obstore.store import S3Store

        assert self.store is not None
        direct = S3Store(
            BUCKET,
            endpoint=f"http://127.0.0.1:{self.store.port}",
            access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY,
            region="us-east-1",
            client_options={"allow_http": True},
        )
        obstore.put(direct, key, data)
        self.objects[key] = data
        return f"s3://{BUCKET}/{key}"

    def put_tree(self, root: Path, prefix: str) -> str:
        """Every file under ``root`` as ``prefix/relative path``; returns the s3:// prefix."""
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            self.put(f"{prefix}/{path.relative_to(root).as_posix()}", path.read_bytes())
        return f"s3://{BUCKET}/{prefix}/"

    def _start_proxy(self, port: int = 0) -> _Process:
        assert self.store is not None
        flags = ["--delay-ms", str(self.delay_ms), "--fail-every", str(self.fail_every)]
        args = ["proxy", str(self.store.port), "--port", str(port), *flags, "--key", ACCESS_KEY]
        return _Process(*args)

    def kill_store(self) -> None:
        """SIGKILL the store and its proxy: the store is gone (connections refused)."""
        for p in (self.proxy, self.store):
            if p is not None:
                p.stop()

    def restart_store(self) -> None:
        """Start the store again, its objects uploaded again (moto keeps them in memory),
        then its proxy on the port clients know: it answers only once it holds them all."""
        assert self.proxy is not None
        port = self.proxy.port
        self.store = _Process("store")
        self._bucket()
        for key, data in list(self.objects.items()):
            self.put(key, data)
        deadline = time.monotonic() + 20
        while True:
            try:
                self.proxy = self._start_proxy(port)
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
