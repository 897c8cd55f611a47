"""How other threads reach the engine's I/O thread: a queue of commands, each answered
through its Future, and a pipe whose read end the thread's poller watches, so a command (or
``close()``) wakes the loop at once. The engine (engine.py) owns one: it posts from any
thread, runs the commands and drains the pipe in its own, and closes it as the thread ends
(the commands still queued are handed back, for the engine to fail)."""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

Command = tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]


class Mailbox:
    """The command queue and the wake pipe, under one lock (which also guards the queue's
    closing and the pipe's descriptors)."""

    def __init__(self) -> None:
        self._commands: deque[Command] = deque()
        self._lock = threading.Lock()
        self._closed = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    @property
    def fd(self) -> int:
        """The pipe's read end, for the poller (-1 once closed)."""
        return self._wake_r

    def post(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Future[Any] | None:
        """Queue ``fn(*args)`` for the thread and wake it: the Future gets its result; None
        when the queue is closed (the thread has stopped)."""
        fut: Future[Any] = Future()
        with self._lock:
            if self._closed:
                return None
            self._commands.append((fn, args, fut))
        self.wake()
        return fut

    def wake(self) -> None:
        with self._lock:
            if self._wake_w < 0:
                return
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass  # the pipe is full, so the thread is awake anyway

    def drain(self) -> None:
        """Read the pipe empty (in the thread, once its poller said it is readable)."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def run(self) -> None:
        """Run the queued commands, in order, each answered through its Future."""
        while True:
            with self._lock:
                if not self._commands:
                    return
                fn, args, fut = self._commands.popleft()
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:
                fut.set_exception(exc)

    def close(self) -> list[Future[Any]]:
        """No command is taken from now on: the Futures of those still queued."""
        with self._lock:
            self._closed = True
            left = [fut for _, _, fut in self._commands]
            self._commands.clear()
        return left

    def close_pipe(self) -> None:
        with self._lock:
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1
