"""A relaying "server" for tests/test_relays.py (issue 40 item 6):

    python tests/relay.py TARGET [--set JSON] [--digest] [--uid U]

It listens on 127.0.0.1 (a port of the kernel's choice; it prints ``tcp://127.0.0.1:PORT``
once listening) and forwards each connection to TARGET (``tcp://HOST:PORT``, a real
server's data port), byte for byte both ways: what a trainer pointed at it believes is a
server. With ``--set``, it reads the ZMTP frames the trainer sends and merges JSON's values
into every CONTROL (the session's control values: the pixels they decide are then its own),
re-framing the message; with ``--digest`` also, it rewrites each TASK's ``control_digest``
to the digest of the values it sent, so that the server's worker holds what the task says.
As ``--uid`` (set once listening: another local user). Runs until killed or its stdin
closes."""

from __future__ import annotations

import argparse
import encodings.idna  # noqa: F401 (resolving a host needs it: imported before --uid)
import hashlib
import json
import os
import socket
import struct
import sys
import threading
from typing import Any

import msgpack

from dataserver.protocol import MsgType

MORE, LONG, COMMAND = 0x01, 0x02, 0x04
GREETING = 64  # ZMTP 3: signature, version, mechanism, as-server, filler


def control_digest(values: dict[str, Any]) -> bytes:
    """What a worker computes of the values it holds (``protocol.control_digest``)."""
    return hashlib.blake2b(msgpack.packb(values, use_bin_type=True), digest_size=16).digest()


def frame(body: bytes, flags: int) -> bytes:
    """One ZMTP frame of ``body`` (``flags``: MORE and COMMAND; LONG is set here)."""
    if len(body) < 256:
        return bytes([flags, len(body)]) + body
    return bytes([flags | LONG]) + struct.pack(">Q", len(body)) + body


class Rewriter:
    """The trainer's byte stream in, the stream the server gets out: the greeting and
    commands as they came, each message re-framed after ``rewrite``."""

    def __init__(self, values: dict[str, Any], digest: bool) -> None:
        self.values = values
        self.digest = digest
        self.buf = bytearray()
        self.greeting = GREETING
        self.frames: list[bytes] = []
        self.sent: dict[bytes, dict[str, Any]] = {}  # session -> the values it was given

    def feed(self, data: bytes) -> bytes:
        self.buf += data
        out = bytearray()
        if self.greeting:
            n = min(self.greeting, len(self.buf))
            out += self.buf[:n]
            del self.buf[:n]
            self.greeting -= n
        while not self.greeting and len(self.buf) >= 2:
            flags = self.buf[0]
            head = 9 if flags & LONG else 2
            if len(self.buf) < head:
                break
            size = struct.unpack(">Q", self.buf[1:9])[0] if flags & LONG else self.buf[1]
            if len(self.buf) < head + size:
                break
            raw = bytes(self.buf[: head + size])
            del self.buf[: head + size]
            if flags & COMMAND:
                out += raw
                continue
            self.frames.append(raw[head:])
            if not flags & MORE:
                frames, self.frames = self.rewrite(self.frames), []
                for i, body in enumerate(frames):
                    out += frame(body, MORE if i < len(frames) - 1 else 0)
        return bytes(out)

    def rewrite(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) < 3 or len(frames[1]) != 1:
            return frames
        kind = frames[1][0]
        if kind not in (MsgType.CONTROL, MsgType.TASK):
            return frames
        header = msgpack.unpackb(frames[2], raw=False)
        if kind == MsgType.CONTROL:
            header["control"] = {**header["control"], **self.values}
            self.sent[header["session"]] = header["control"]
        elif self.digest and header.get("control_digest") and header["session"] in self.sent:
            header["control_digest"] = control_digest(self.sent[header["session"]])
        else:
            return frames
        return [frames[0], frames[1], msgpack.packb(header, use_bin_type=True), *frames[3:]]


def pump(src: socket.socket, dst: socket.socket, rewriter: Rewriter | None) -> None:
    try:
        while data := src.recv(1 << 16):
            dst.sendall(rewriter.feed(data) if rewriter is not None else data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def serve(listener: socket.socket, target: tuple[str, int], args: argparse.Namespace) -> None:
    values = json.loads(args.set) if args.set else None
    while True:
        conn, _ = listener.accept()
        try:
            upstream = socket.create_connection(target, timeout=10)
        except OSError:
            conn.close()
            continue
        upstream.settimeout(None)
        rewriter = Rewriter(values, args.digest) if values is not None else None
        for a, b, r in ((conn, upstream, rewriter), (upstream, conn, None)):
            threading.Thread(target=pump, args=(a, b, r), daemon=True).start()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("target")
    p.add_argument("--set", default="")
    p.add_argument("--digest", action="store_true")
    p.add_argument("--uid", type=int, default=None)
    args = p.parse_args()
    host, port = args.target.removeprefix("tcp://").rsplit(":", 1)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    if args.uid is not None:
        os.setgroups([])
        os.setgid(args.uid)
        os.setuid(args.uid)
    threading.Thread(target=serve, args=(listener, (host, int(port)), args), daemon=True).start()
    print(f"tcp://127.0.0.1:{listener.getsockname()[1]}", flush=True)
    sys.stdin.read()  # until the test closes it (or kills this process)
    return 0


if __name__ == "__main__":
    sys.exit(main())
