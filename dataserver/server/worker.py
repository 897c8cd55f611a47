"""A worker process: builds its dataset from the spec, then turns TASKs into RESULTs.

Started by the front as ``python -m dataserver.server.worker`` (a fresh interpreter:
never forked from a process that may hold CUDA, never handed a pickle), with
``CUDA_VISIBLE_DEVICES=""``, SIGINT ignored (the front decides when workers stop) and a
parent-death signal so that it never outlives its front.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
from collections import OrderedDict
from typing import Any

import cv2
import zmq

from dataserver import protocol
from dataserver.data.pipeline import build_output, prepare
from dataserver.data.sample import Sample, SampleError
from dataserver.data.spec import build_dataset, parse_spec
from dataserver.protocol import Message, MsgType, ProtocolError
from dataserver.security import start_server_curve
from dataserver.server.config import bindable
from dataserver.server.memory import keep_large_blocks

log = logging.getLogger("dataserver.worker")

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except OSError:  # not Linux: the front's shutdown still reaps us
        return
    if os.getppid() != parent_pid:  # the front died before prctl took effect
        os._exit(1)


class SourceCache:
    """Prepared (read + augmented) sources of recent tasks, bounded in bytes, LRU.

    Keyed by everything that determines a prepared source, so a hit is always exact:
    (session, control_seq, seed, epoch, index). A re-planned task (after a mode switch)
    that lands here re-composes instead of re-decoding.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._items: OrderedDict[tuple[Any, ...], Sample] = OrderedDict()

    def get(self, key: tuple[Any, ...]) -> Sample | None:
        sample = self._items.get(key)
        if sample is not None:
            self._items.move_to_end(key)
        return sample

    def put(self, key: tuple[Any, ...], sample: Sample) -> None:
        if sample.nbytes > self.max_bytes or key in self._items:
            return
        self._items[key] = sample
        self.nbytes += sample.nbytes
        while self.nbytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.nbytes -= old.nbytes


class Worker:
    """One worker: a DEALER connected to the front's backend ROUTER."""

    def __init__(
        self,
        worker_id: int,
        backend: str,
        dataset: Any,
        cache_bytes: int,
        results_bind: str | None = None,
        curve: tuple[str, str] | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.backend = backend
        self.results_bind = results_bind
        self.curve = curve
        self.dataset = dataset
        self.size = len(dataset)
        self.cache = SourceCache(cache_bytes)
        self._applied: tuple[bytes, int] | None = None  # (session, control_seq) last applied

    def run(self) -> None:
        ctx = zmq.Context(io_threads=1)
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, f"w{self.worker_id}-{os.getpid()}".encode())
        results, auth = self._results_socket(ctx)
        endpoint = results.getsockopt_string(zmq.LAST_ENDPOINT) if results is not None else ""
        try:
            sock.connect(self.backend)
            ready = {"worker": self.worker_id, "pid": os.getpid(), "results": endpoint}
            sock.send_multipart(protocol.make(MsgType.READY, ready))
            while True:
                frames = sock.recv_multipart(copy=False)
                try:
                    msg = protocol.decode(frames)
                except ProtocolError as exc:
                    log.error(
                        "worker %d: dropped a bad message from the front: %s", self.worker_id, exc
                    )
                    continue
                if msg.type is MsgType.BYE:
                    break
                if msg.type is not MsgType.TASK:
                    continue
                out = self.run_task(msg.header)
                if out.type is MsgType.RESULT and self._send_direct(results, out):
                    sock.send_multipart(protocol.make(MsgType.DONE, _done_header(out)))
                    continue
                sock.send_multipart(protocol.encode(out), copy=False)
        except zmq.ContextTerminated:
            pass
        finally:
            sock.close(linger=0)
            if results is not None:
                results.close(linger=0)
            if auth is not None:
                auth.stop()
            ctx.term()

    def _results_socket(self, ctx: zmq.Context[Any]) -> tuple[zmq.Socket[Any] | None, Any]:
        """A ROUTER that clients connect to for results sent straight to them."""
        if self.results_bind is None:
            return None, None
        results = ctx.socket(zmq.ROUTER)
        results.setsockopt(zmq.LINGER, 0)
        results.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown client: we hear it, and fall back
        results.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a client that reconnects takes its name back
        results.setsockopt(zmq.SNDHWM, 64)
        results.setsockopt(zmq.RCVHWM, 1)
        results.setsockopt(zmq.MAXMSGSIZE, 1024)  # clients never send here: cut anyone who does
        auth = None
        if self.curve is not None:
            auth = start_server_curve(ctx, self.curve[0], self.curve[1], [results])
        results.bind(bindable(self.results_bind))
        return results, auth

    def _send_direct(self, results: zmq.Socket[Any] | None, out: Message) -> bool:
        """Send a RESULT straight to its client; False when that client is not connected to
        this worker (the front forwards it instead)."""
        if results is None:
            return False
        try:
            results.send_multipart(
                [out.header["session"], *protocol.encode(out)], zmq.NOBLOCK, copy=False
            )
        except zmq.ZMQError as exc:
            if exc.errno in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                return False
            raise
        return True

    def _apply_control(self, header: dict[str, Any]) -> None:
        key = (header["session"], header["control_seq"])
        if key == self._applied:
            return
        setter = getattr(self.dataset, "set_control", None)
        if callable(setter):
            setter(dict(header["control"]))
        self._applied = key

    def run_task(self, h: dict[str, Any]) -> Message:
        """Run one TASK header; return its RESULT or ERROR."""
        reply = {
            "session": h["session"],
            "task_id": h["task_id"],
            "plan_version": h["plan_version"],
        }
        bad = [i for i in h["indices"] if i >= self.size]
        if bad:
            msg = f"index {bad[0]} out of range: the dataset has {self.size} samples"
            return Message(
                MsgType.ERROR, {**reply, "index": bad[0], "message": msg, "kind": "request"}
            )
        try:
            self._apply_control(h)
        except Exception as exc:
            msg = f"dataset.set_control raised {type(exc).__name__}: {exc}"
            return Message(MsgType.ERROR, {**reply, "message": msg, "kind": "control"})
        session, cseq, seed, epoch = h["session"], h["control_seq"], h["seed"], h["epoch"]
        excluded = set(h.get("exclude", ()))
        decoded = 0

        def source(index: int) -> Sample:
            nonlocal decoded
            if index in excluded:  # the client found it kills workers: leave its cell empty
                raise SampleError(index, "killed worker processes when read; left out")
            key = (session, cseq, seed, epoch, index)
            sample = self.cache.get(key)
            if sample is None:
                sample = prepare(self.dataset, index, seed, epoch)
                decoded += 1
                self.cache.put(key, sample)
            return sample

        try:
            out = build_output(
                source, h["indices"], h["grid"], tuple(h["out_hw"]), h["on_error"] == "skip"
            )
        except SampleError as exc:
            err = {
                **reply,
                "index": exc.index,
                "file": exc.file,
                "message": str(exc),
                "kind": "sample",
            }
            return Message(MsgType.ERROR, err)
        except Exception as exc:
            log.exception("worker %d: task %d failed", self.worker_id, h["task_id"])
            msg = f"worker error on indices {h['indices']}: {type(exc).__name__}: {exc}"
            return Message(MsgType.ERROR, {**reply, "message": msg, "kind": "internal"})
        header = {
            **reply,
            "indices": out.indices,
            "failed": [list(f) for f in out.failed],
            "decoded": decoded,  # sources read and augmented for this task (cache misses)
        }
        return Message(MsgType.RESULT, header, [out.image, out.boxes, out.labels])


def _done_header(out: Message) -> dict[str, Any]:
    h = out.header
    keys = ("session", "task_id", "plan_version", "decoded")
    return {**{k: h[k] for k in keys}, "samples": len(h["indices"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dataserver-worker")
    parser.add_argument("--backend", required=True)
    parser.add_argument("--worker-id", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--dataset-args", default=None)
    parser.add_argument("--cache-mb", type=int, default=64)
    parser.add_argument("--results-bind", default=None)
    parser.add_argument("--curve-secret-key", default=None)
    parser.add_argument("--curve-authorized-keys", default=None)
    args = parser.parse_args(argv)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(args.parent_pid)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    keep_large_blocks()
    cv2.setNumThreads(1)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    dataset = build_dataset(parse_spec(args.dataset, args.dataset_args))
    curve = None
    if args.curve_secret_key and args.curve_authorized_keys:
        curve = (args.curve_secret_key, args.curve_authorized_keys)
    Worker(
        args.worker_id, args.backend, dataset, args.cache_mb << 20, args.results_bind, curve
    ).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
