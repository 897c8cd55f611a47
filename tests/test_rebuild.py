"""Replayable batches (issue 17, point 6) through the public API on real servers:
``client.rebuild(batch.manifest)`` gives the batch again, bit-identical (images, boxes,
labels, indices, mode, image size), in every mode and layout and at a MultiScale size; from
another client (other seed, size, layout and mode) of the same servers; after the client
moved on (a later epoch, other control values: the manifest's values are used, and the
next normal batch still has the current ones); without disturbing the running epoch. A
manifest is plain data (JSON and msgpack round-trip it); a bad one is a ValueError naming
its field."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
from batches import snap
from clients import make_client
from conftest import Server
from ds_plugins import colour_of

from dataserver_client import Batch, DataServerClient, MultiScale
from dataserver_client.plan.epoch import epoch_order

pytestmark = pytest.mark.timeout(180)

N = 40
SIZES = [(32, 32), (48, 64), (64, 48)]
KW: dict[str, Any] = {"timeout": 20.0}


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[Any, Server]]:
    """``ds_plugins:flat`` behind a 1-worker and a 2-worker server, and ``ds_plugins:merge``
    (pixels and labels made from the control values) behind a 2-worker one."""
    flat = ("--dataset", "ds_plugins:flat", "--dataset-args", json.dumps({"n": N}))
    started: dict[Any, Server] = {w: Server(*flat, workers=w) for w in (1, 2)}
    started["merge"] = Server(
        "--dataset", "ds_plugins:merge", "--dataset-args", json.dumps({"n": 32}), workers=2
    )
    yield started
    for server in started.values():
        server.stop()


def indices_of(batches: list[Batch] | list[dict[str, Any]]) -> list[int]:
    out: list[int] = []
    for b in batches:
        for idx in b["indices"] if isinstance(b, dict) else b.indices:
            out.extend(idx)
    return out


def check_rebuilt(client: DataServerClient, batches: list[tuple[dict[str, Any], Any]]) -> None:
    """Every (snap, manifest) rebuilt by ``client``: the same batch, and the same manifest."""
    for want, manifest in batches:
        again = client.rebuild(manifest)
        assert snap(again) == want, (want["epoch"], want["step"])
        assert again.manifest == manifest  # a rebuilt batch names itself the same way


# (client settings, set_mode(...) calls: before the epoch (-1) and after batch s)
CONFIGS: dict[str, tuple[dict[str, Any], dict[int, str]]] = {
    "regular": ({"image_size": (48, 64)}, {}),
    "spatial": ({"image_size": (64, 64)}, {-1: "stitch", 2: "regular"}),
    "mosaic": ({"image_size": (64, 64), "stitch_layout": "mosaic"}, {-1: "stitch", 3: "regular"}),
    "batch": ({"image_size": (64, 64), "stitch_layout": "batch", "stitch_k": 4}, {-1: "stitch"}),
    "multiscale": (
        {"image_size": MultiScale(SIZES, every=2), "stitch_layout": "mosaic"},
        {3: "stitch", 5: "regular"},
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_rebuilt_batch_is_bit_identical_from_any_client(
    servers: dict[Any, Server], name: str
) -> None:
    settings, flips = CONFIGS[name]
    seed = 11
    with make_client(
        servers[2].address, batch_size=2, seed=seed, prefetch=3, **settings, **KW
    ) as c:
        if -1 in flips:
            c.set_mode(flips[-1])
        c.set_epoch(0)
        recorded = []
        for batch in c:
            recorded.append((snap(batch), batch.manifest))
            if batch.step in flips:
                c.set_mode(flips[batch.step])
        assert indices_of([s for s, _ in recorded]) == epoch_order(N, seed, 0, True).tolist()
        modes = {s["mode"] for s, _ in recorded}
        assert modes == ({"regular"} if name == "regular" else {"regular", "stitch"}) or (
            name == "batch" and modes == {"stitch"}
        )
        if name == "multiscale":
            assert len({s["image_size"] for s, _ in recorded}) > 1
        check_rebuilt(c, recorded)  # between epochs
        # The client moves on: another epoch, size and mode, a batch taken.
        c.set_epoch(3)
        c.set_image_size((40, 40))
        c.set_mode("stitch" if c.mode == "regular" else "regular")
        it = iter(c)
        next(it)
        check_rebuilt(c, recorded[::2])
    # Another client of the same server: another seed, size, layout and mode, mid-epoch.
    other_layout = "spatial" if settings.get("stitch_layout") == "mosaic" else "mosaic"
    with make_client(
        servers[2].address,
        batch_size=3,
        seed=99,
        image_size=(32, 32),
        stitch_layout=other_layout,
        **KW,
    ) as other:
        other.set_mode("stitch")
        other.set_epoch(1)
        it = iter(other)
        own = [next(it)]
        check_rebuilt(other, recorded)
        own += list(it)
        assert sorted(indices_of(own)) == list(range(N))  # its own epoch, undisturbed
        assert {b.mode for b in own} == {"stitch"} and {b.image_size for b in own} == {(32, 32)}


def merge_pixel(batch: Batch, tint: int, label_shift: int) -> None:
    """``ds_plugins:merge`` made each image with these control values."""
    for image, target, idx in zip(batch.images, batch.targets, batch.indices, strict=True):
        r, g, b = colour_of(idx[0])
        assert image[:, 0, 0].tolist() == [(r + tint) % 256, g, b], (idx, tint)
        assert target["labels"].tolist() == [1 + label_shift]


def test_a_rebuild_uses_the_manifests_control_values_not_the_current_ones(
    servers: dict[Any, Server],
) -> None:
    address = servers["merge"].address
    kw = {"batch_size": 2, "image_size": (48, 48), "seed": 3, "prefetch": 3, **KW}
    with make_client(address, **kw) as c:
        c.set_epoch(0)
        it = iter(c)
        plain = next(it)
        merge_pixel(plain, 0, 0)
        c.control(tint=10, label_shift=1)
        tinted = next(it)
        merge_pixel(tinted, 10, 1)
        assert plain.manifest["control"] == {} and plain.manifest["control_seq"] == 0
        assert tinted.manifest["control"] == {"tint": 10, "label_shift": 1}
        recorded = [(snap(plain), plain.manifest), (snap(tinted), tinted.manifest)]
        edited = next(it)  # a manifest is the caller's own: editing it changes nothing else
        edited.manifest["control"]["tint"] = 99
        assert c.state_dict()["control"] == {"tint": 10, "label_shift": 1}
        later = next(it)
        merge_pixel(later, 10, 1)
        assert later.manifest["control"] == {"tint": 10, "label_shift": 1}
        # The client moves on: other values, a later epoch.
        c.control(tint=50, label_shift=3)
        c.set_epoch(2)
        it = iter(c)
        first = next(it)
        merge_pixel(first, 50, 3)
        again = c.rebuild(tinted.manifest)
        merge_pixel(again, 10, 1)  # the manifest's values
        assert snap(again) == recorded[1][0]
        again = c.rebuild(plain.manifest)
        merge_pixel(again, 0, 0)  # none at all: not what this session's dataset holds now
        assert snap(again) == recorded[0][0]
        after = next(it)
        merge_pixel(after, 50, 3)  # the next batch still has the current values
        assert after.step == 1 and after.epoch == 2
        rest = list(it)
        for b in rest:
            merge_pixel(b, 50, 3)
        assert sorted(indices_of([first, after, *rest])) == list(range(32))
    with make_client(address, **kw) as fresh:  # one that never set any values
        check_rebuilt(fresh, recorded)
        fresh.set_epoch(0)
        merge_pixel(next(iter(fresh)), 0, 0)


def test_rebuilding_does_not_disturb_the_running_epoch(servers: dict[Any, Server]) -> None:
    """Rebuilds of earlier batches between the epoch's own (with mode flips): every batch
    honours the latest steering, steps run on, the epoch delivers each index once."""
    seed = 21
    with make_client(
        servers[2].address, batch_size=2, image_size=(48, 48), seed=seed, prefetch=4, **KW
    ) as c:
        c.set_epoch(0)
        mode, calls = "regular", 0
        got: list[tuple[dict[str, Any], dict[str, Any]]] = []
        for batch in c:
            assert batch.mode == mode and batch.feedback_seq == calls
            assert batch.step == len(got)
            got.append((snap(batch), batch.manifest))
            for want, manifest in got[-3:]:
                assert snap(c.rebuild(manifest)) == want
            if batch.step % 3 == 1:
                mode = "stitch" if mode == "regular" else "regular"
                c.set_mode(mode)
                calls += 1
        assert c.state_dict()["position"] == 0  # the epoch is over: the next one starts
    assert indices_of([s for s, _ in got]) == epoch_order(N, seed, 0, True).tolist()
    assert {s["mode"] for s, _ in got} == {"regular", "stitch"}


def test_rebuilds_from_another_thread_while_the_trainer_steers(
    servers: dict[Any, Server],
) -> None:
    """A thread rebuilds recorded batches over and over while the trainer's thread takes
    batches, flips modes and sizes (each a new plan: the rebuilds in flight are planned
    again): every rebuild is right, and the epoch is exactly once and never stale."""
    seed = 8
    with make_client(
        servers[2].address, batch_size=2, image_size=(48, 48), seed=seed, prefetch=3, **KW
    ) as c:
        c.set_epoch(1)
        recorded = [(snap(b), b.manifest) for b in c]
        stop = threading.Event()
        failures: list[str] = []
        rebuilt = [0]

        def rebuild_loop() -> None:
            j = 0
            while not stop.is_set():
                want, manifest = recorded[j % len(recorded)]
                try:
                    if snap(c.rebuild(manifest)) != want:
                        failures.append(f"step {want['step']} rebuilt differently")
                except Exception as exc:  # reported below, with the test's failure
                    failures.append(repr(exc))
                rebuilt[0] += 1
                j += 1

        worker = threading.Thread(target=rebuild_loop)
        worker.start()
        try:
            c.set_epoch(2)
            mode, size, got = "regular", (48, 48), []
            for batch in c:
                assert batch.mode == mode and batch.image_size == size
                got.append(batch)
                if batch.step % 2 == 0:
                    mode = "stitch" if mode == "regular" else "regular"
                    c.set_mode(mode)
                if batch.step % 3 == 0:
                    size = (64, 48) if size == (48, 48) else (48, 48)
                    c.set_image_size(size)
        finally:
            stop.set()
            worker.join(30)
    assert not failures, failures[:3]
    assert rebuilt[0] > 0
    assert indices_of(got) == epoch_order(N, seed, 2, True).tolist()


def test_a_manifest_is_plain_data(servers: dict[Any, Server]) -> None:
    """JSON and msgpack round-trip it unchanged; the JSON copy rebuilds the batch, on
    another server of the same dataset too."""
    ms = MultiScale(SIZES, every=1)
    with make_client(
        servers[2].address, batch_size=3, image_size=ms, stitch_layout="mosaic", seed=4, **KW
    ) as c:
        c.set_mode("stitch")
        c.control(strength=0.5, names=["a", "b"])
        c.set_epoch(1)
        it = iter(c)
        next(it)
        batch = next(it)
        want = snap(batch)
        manifest = batch.manifest
    assert set(manifest) == {
        "version",
        "epoch",
        "step",
        "mode",
        "stitch_layout",
        "stitch_k",
        "image_size",
        "source_size",
        "indices",
        "control_seq",
        "control",
        "seed",
        "on_error",
        "fingerprint",
        "pad_value",
        "letterbox",
        "fit",
        "augment",
        "mosaic_partners",
        "mosaic_p",
    }
    assert manifest["mode"] == "stitch" and manifest["step"] == 1 and manifest["epoch"] == 1
    assert manifest["image_size"] == list(ms.size_at(4, 1, 1))
    assert manifest["control"] == {"strength": 0.5, "names": ["a", "b"]}
    assert manifest["indices"] == want["indices"]
    text = json.dumps(manifest)
    assert json.loads(text) == manifest
    assert msgpack.unpackb(msgpack.packb(manifest)) == manifest
    for workers in (1, 2):
        with make_client(servers[workers].address, image_size=(32, 32), **KW) as other:
            assert snap(other.rebuild(json.loads(text))) == want
            assert snap(other.rebuild(msgpack.unpackb(msgpack.packb(manifest)))) == want


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(m: dict[str, Any]) -> None:
        m[key] = value

    return change


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    def change(m: dict[str, Any]) -> None:
        del m[key]

    return change


BAD: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("no version", _drop("version"), "version"),
    ("version 2", _set("version", 2), "version"),
    ("no epoch", _drop("epoch"), "'epoch'"),
    ("epoch as text", _set("epoch", "0"), "'epoch'"),
    ("negative step", _set("step", -1), "'step'"),
    ("seed a bool", _set("seed", True), "'seed'"),
    ("no seed", _drop("seed"), "'seed'"),
    ("mode", _set("mode", "zoom"), "'mode'"),
    ("no mode", _drop("mode"), "'mode'"),
    ("layout", _set("stitch_layout", "grid"), "'stitch_layout'"),
    ("stitch_k 5", _set("stitch_k", 5), "'stitch_k'"),
    ("mosaic of 9", lambda m: m.update(stitch_layout="mosaic", stitch_k=9), "'stitch_k'"),
    ("stitch_k a float", _set("stitch_k", 4.0), "'stitch_k'"),
    ("no control_seq", _drop("control_seq"), "'control_seq'"),
    ("control_seq text", _set("control_seq", "0"), "'control_seq'"),
    ("no image_size", _drop("image_size"), "'image_size'"),
    ("image_size zero", _set("image_size", [0, 64]), "'image_size'"),
    ("image_size text", _set("image_size", "64x64"), "'image_size'"),
    ("image_size one side", _set("image_size", [64]), "'image_size'"),
    ("image_size beyond the protocol", _set("image_size", [20000, 64]), "'image_size'"),
    ("image_size beyond the servers", _set("image_size", [5000, 64]), "'image_size'"),
    ("no source_size", _drop("source_size"), "'source_size'"),
    ("source_size floats", _set("source_size", [64.0, 64.0]), "'source_size'"),
    ("source_size below image_size", _set("source_size", [48, 32]), "'source_size'"),
    ("no indices", _drop("indices"), "'indices'"),
    ("no images", _set("indices", []), "'indices'"),
    ("indices flat", _set("indices", [1, 2]), "'indices'"),
    ("two per regular image", _set("indices", [[1, 2]]), "'indices'"),
    ("index a float", _set("indices", [[1.5]]), "'indices'"),
    ("index negative", _set("indices", [[-1]]), "'indices'"),
    ("index beyond the dataset", _set("indices", [[3], [N]]), "'indices'.*beyond"),
    ("control not a dict", _set("control", 5), "'control'"),
    ("no control", _drop("control"), "'control'"),
    ("control not msgpack-able", _set("control", {"x": {1, 2}}), "'control'"),
    ("on_error", _set("on_error", "ignore"), "'on_error'"),
    ("another dataset", _set("fingerprint", "plugin-0000000000000000"), "fingerprint|dataset"),
    ("no fingerprint", _drop("fingerprint"), "'fingerprint'"),
]


def test_a_bad_manifest_is_refused_naming_its_field(servers: dict[Any, Server]) -> None:
    with make_client(servers[2].address, batch_size=2, image_size=(48, 64), seed=1, **KW) as c:
        c.set_epoch(0)
        it = iter(c)
        batch = next(it)
        good, want = batch.manifest, snap(batch)
        with pytest.raises(ValueError, match="not a batch manifest"):
            c.rebuild([good])  # type: ignore[arg-type]
        for what, change, field in BAD:
            manifest = json.loads(json.dumps(good))
            change(manifest)
            with pytest.raises(ValueError, match=field) as caught:
                c.rebuild(manifest)
            assert caught.value is not None, what
        assert snap(c.rebuild(good)) == want  # the client is as it was
        rest = list(it)
        assert rest[0].step == 1 and rest[0].feedback_seq == 0
        assert sorted(indices_of([batch, *rest])) == list(range(N))
