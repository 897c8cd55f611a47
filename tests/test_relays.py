"""Issue 40 item 6: relays. A process (uid 65534 where the tests run as root) that listens
on the host and forwards a trainer's connection to a real ``dataserver serve`` on the same
host (tests/relay.py). Before: a pure relay earned the real server's ``local_proof`` and the
trainer landed through it (handing its buffer to the real workers, its tasks through the
relay); a relay that merged its own values into the session's CONTROL changed 81-113 of
192 images, never caught (here, before: 20 and 27 of 64). Now the proof is bound to the connection it arrives on, so the
trainer never takes a relay for a server on its host (its results come over sockets), and
a task's control values are under its digest: a worker holding other values refuses the
task, and a result composed with other values than the task's is refused by the trainer
(``rejected["wrong_control"]``, the relayed server dropped as for a wrong answer)."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from clients import make_client
from conftest import server_env

from dataserver.security import proof_ends

pytestmark = pytest.mark.timeout(180)

HERE = Path(__file__).resolve().parent
MERGE = ("--dataset", "ds_plugins:merge", "--dataset-args", '{"n": 64}')
VALUES = {"tint": 55, "label_shift": 1}


class Relay:
    """tests/relay.py as a child process (as uid 65534 where we are root)."""

    def __init__(self, target: str, *args: str) -> None:
        uid = ["--uid", "65534"] if os.geteuid() == 0 else []
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "relay.py"), target, *args, *uid],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=server_env(),
        )
        assert self.proc.stdout is not None
        self.address = self.proc.stdout.readline().strip()
        if not self.address:
            self.stop()
            assert self.proc.stderr is not None
            raise AssertionError(f"the relay did not start: {self.proc.stderr.read()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def relay() -> Iterator[Any]:
    started: list[Relay] = []

    def start(target: str, *args: str) -> Relay:
        started.append(Relay(target, *args))
        return started[-1]

    yield start
    for each in started:
        each.stop()


def epoch(addresses: Any) -> tuple[list[str], dict[str, Any]]:
    """One epoch under ``VALUES``: a digest per image, in order (its pixels, boxes, labels
    and indices), and the client's stats."""
    with make_client(addresses, batch_size=8, image_size=(32, 32), seed=1, timeout=20) as client:
        client.control(**VALUES)
        client.set_epoch(0)
        out = []
        for batch in client:
            for image, target, indices in zip(
                batch.images.numpy(), batch.targets, batch.indices, strict=True
            ):
                h = hashlib.blake2b(image.tobytes(), digest_size=16)
                h.update(target["boxes"].numpy().tobytes())
                h.update(target["labels"].numpy().tobytes())
                h.update(repr(indices).encode())
                out.append(h.hexdigest())
        return out, client.stats()


def test_a_relay_never_makes_the_trainer_land(start_server: Any, relay: Any) -> None:
    """A pure relay: the real server's proof is made for the relay's connection to it, not
    the trainer's to the relay, so the trainer does not land; its epoch comes over the
    sockets, bit-identical."""
    server = start_server(*MERGE, workers=1)
    direct, stats = epoch(server.address)
    assert stats.get("results_landed", 0) > 0  # straight to the server: it lands
    relayed, stats = epoch(relay(server.address).address)
    assert relayed == direct
    assert stats.get("results_landed", 0) == 0, stats
    assert not stats["rejected"].get("bad_server"), stats["rejected"]


@pytest.mark.parametrize("digest", [False, True], ids=["control", "control_and_digest"])
def test_a_relay_that_rewrites_control_values_changes_no_image(
    start_server: Any, relay: Any, digest: bool
) -> None:
    """A relay merges its own values into the session's CONTROL (and, ``digest``, rewrites
    each task's control digest to match them): the worker refuses the task
    (``control_mismatch``), or its result says the values it composed with and the trainer
    refuses it; either way the relayed server is dropped and an honest one beside it
    answers. Every batch is bit-identical to an undisturbed run."""
    honest = start_server(*MERGE, workers=1)
    other = start_server(*MERGE, workers=1)
    undisturbed, _ = epoch(honest.address)
    swapped = relay(other.address, "--set", '{"tint": 0}', *(["--digest"] if digest else []))
    got, stats = epoch([honest.address, swapped.address])
    changed = sum(a != b for a, b in zip(got, undisturbed, strict=True))
    assert changed == 0, f"{changed} of {len(got)} images changed"
    assert stats["rejected"].get("wrong_control", 0) >= 1, stats["rejected"]
    assert stats["rejected"].get("bad_server", 0) == 1, stats["rejected"]


def test_the_proof_names_one_connection_the_same_from_either_side() -> None:
    """``proof_ends`` (what ``local_proof`` binds): the client's view of a connection is the
    server's, an IPv4 client of a dual-stack listener included; a relayed pair of
    connections (trainer to relay, relay to server) is two different ones."""
    with socket.socket(socket.AF_INET6) as listener:
        listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        listener.bind(("::", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as trainer:
            accepted, _ = listener.accept()
            with accepted, socket.create_connection(("127.0.0.1", port)) as relay:
                relayed, _ = listener.accept()
                with relayed:
                    mine = proof_ends(trainer.fileno(), server=False)
                    assert mine is not None
                    assert mine == proof_ends(accepted.fileno(), server=True)
                    assert mine != proof_ends(relayed.fileno(), server=True)
                    assert proof_ends(relay.fileno(), server=False) == proof_ends(
                        relayed.fileno(), server=True
                    )
    assert proof_ends(-1, server=True) is None
    with open(os.devnull, "rb") as f:  # not a socket: no ends, no proof
        assert proof_ends(f.fileno(), server=True) is None
