"""Receiving one message, with a RESULT's images received straight into the batch buffer.

A RESULT's image frame is the bulk of all traffic. Rather than a frame that is then
copied into the batch, the header is read first, the task it answers is looked up, and
the frame of its images is received with ``recv_into`` straight into its slots of the
batch buffer (a task's images are consecutive slots). Everything is checked as ``protocol.decode`` would check it, and anything wrong
raises ``ProtocolError`` only, after the rest of the message has been read off the socket
(so the next receive starts at a message boundary), except a message of too many frames
(``TooManyFrames``: left unread, its socket to be closed).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import zmq

from dataserver.protocol import (
    MAX_FRAMES,
    Message,
    MsgType,
    ProtocolError,
    Result,
    Welcome,
    decode,
    decode_head,
)
from dataserver.protocol.messages import check_boxes, check_images_spec
from dataserver.protocol.wire import check_spec
from dataserver_client.net.handshakes import HeldWelcome, WelcomeMemo

Destinations = Callable[[Result], "np.ndarray | None"]


class WrongAnswer(ProtocolError):
    """A well-formed RESULT for a wanted task that does not answer it (other images, other
    sizes): a protocol error against the server that sent it, not mere noise."""


class TooManyFrames(ProtocolError):
    """A message of more than ``MAX_FRAMES`` frames, left unread on its socket: reading off
    2,000,000 empty frames (4 MB sent) cost the trainer 51-92x its epoch. The socket is in
    the middle of it: its server is banned and the socket closed, which frees the rest
    (``Handlers.messages``)."""


def _rest(sock: zmq.Socket[Any]) -> list[Any]:
    frames: list[Any] = []
    while sock.getsockopt(zmq.RCVMORE):  # (after a ProtocolError: not the common path)
        if len(frames) >= MAX_FRAMES:
            raise TooManyFrames(f"a message of more than {MAX_FRAMES} frames")
        frames.append(sock.recv(copy=False))
    return frames


def receive(
    sock: zmq.Socket[Any],
    destinations: Destinations,
    seen: Callable[[int], None] | None = None,
    welcomes: WelcomeMemo | None = None,
) -> Message:
    """The next message on ``sock`` (``zmq.Again`` when there is none). For a RESULT that
    ``destinations(result)`` wants, its images land in the contiguous (N, 3, H, W) uint8
    array it returns, and ``result.pixels`` is that array (None when not wanted).
    ``seen(fd)`` is told the connection it came by (a message comes whole or not at all).
    ``welcomes``: a WELCOME whose bytes are those of the last one decoded there is that
    message again (the same object), not decoded again."""
    first = sock.recv(zmq.NOBLOCK, copy=False)
    try:
        fd = int(first.get(zmq.SRCFD))
    except (zmq.ZMQError, TypeError, ValueError):
        fd = -1
    else:
        if seen is not None:
            seen(fd)
    try:
        return _receive(sock, first, destinations, welcomes, fd)
    except TooManyFrames:
        raise
    except ProtocolError:
        _rest(sock)
        raise
    except (zmq.ZMQError, HeldWelcome):
        raise
    except Exception as exc:
        _rest(sock)
        raise ProtocolError(f"unreadable message ({type(exc).__name__}: {exc})") from None


def _images(
    sock: zmq.Socket[Any],
    result: Result,
    spec: tuple[Any, tuple[int, ...], int],
    n: int,
    destinations: Destinations,
    more: bool,
) -> tuple[np.ndarray | None, bool]:
    """Receive a RESULT's image frame (``more``: one follows) straight into where
    ``destinations`` says (None: not wanted, read off and dropped); and whether more
    frames follow it."""
    dtype, shape, nbytes = spec
    check_images_spec(dtype, shape, n)
    if not more:
        raise ProtocolError("RESULT ends before its images")
    dest = destinations(result)
    if dest is None:  # not wanted (late, or a duplicate): read it off, keep nothing
        return None, bool(sock.recv(copy=False).more)
    if dest.shape != shape:
        sock.recv(copy=False)
        raise WrongAnswer(f"images of {shape}, not the {dest.shape} asked")
    got = sock.recv_into(dest.data.cast("B"))
    if got != nbytes:
        raise ProtocolError(f"images: the frame holds {got} bytes, not {nbytes}")
    return dest, bool(sock.getsockopt(zmq.RCVMORE))  # (``recv_into`` gives no frame)


def _other(frames: list[Any], welcomes: WelcomeMemo | None, fd: int) -> Message:
    """A message other than a RESULT, decoded; a WELCOME (with ``welcomes``): the message
    kept when its frames are the last one's bytes, else decoded when its server's handshake
    rate allows (``HeldWelcome`` if not: held with ``fd``, the connection it came by)."""
    if welcomes is None or len(frames) < 2 or bytes(frames[1]) != bytes((MsgType.WELCOME,)):
        return decode(frames)
    digest = welcomes.digest(frames)
    known = welcomes.recall(digest)
    if known is not None:
        return known
    welcomes.admit(time.monotonic(), frames, fd)
    msg = decode(frames)
    if isinstance(msg, Welcome):
        welcomes.keep(digest, msg)
    return msg


def _receive(
    sock: zmq.Socket[Any],
    first: Any,
    destinations: Destinations,
    welcomes: WelcomeMemo | None,
    fd: int,
) -> Message:
    # Whether more frames follow is each frame's ``more`` (~0.1 us; ``getsockopt(RCVMORE)``
    # is a ~2 us call, five or six a result).
    head = [first]
    while len(head) < 3 and head[-1].more:
        head.append(sock.recv(copy=False))
    is_result = len(head) == 3 and bytes(memoryview(head[1])) == bytes((MsgType.RESULT,))
    if not is_result:
        return _other(head + _rest(sock), welcomes, fd)
    result = decode_head(head)
    if not isinstance(result, Result):
        raise ProtocolError(f"a {result.TYPE.name} where a RESULT was announced")
    specs = result.specs
    n = len(result.images)
    want = 2 if result.landed else 3
    if len(specs) != want:
        raise ProtocolError(f"RESULT names {len(specs)} arrays, not {want}")
    shapes = [check_spec(i, spec) for i, spec in enumerate(specs)]
    more = bool(head[-1].more)
    dest = None
    if not result.landed:  # (landed: the images are in our buffer already)
        dest, more = _images(sock, result, shapes[0], n, destinations, more)
    arrays = []
    for i in (want - 2, want - 1):
        if not more:
            raise ProtocolError("RESULT ends before its boxes and labels")
        frame = sock.recv(copy=False)
        more = bool(frame.more)
        dtype, shape, nbytes = shapes[i]
        buf = memoryview(frame.buffer)
        if len(buf) != nbytes:
            raise ProtocolError(f"array {i}: its frame holds {len(buf)} bytes, not {nbytes}")
        arrays.append(np.frombuffer(buf, dtype=dtype).reshape(shape))
    if more:
        raise ProtocolError("RESULT carries frames after its labels")
    check_boxes(arrays[0], arrays[1], sum(result.box_counts))
    return msgspec.structs.replace(result, pixels=dest, boxes=arrays[0], labels=arrays[1])
