"""``python -m dataserver.bench.codecs``: the protocol's msgspec codecs against the
hand-written ones they replaced (docs/DESIGN-NOTES.md, "Codecs: msgspec or not").

The hand-written codecs are read from git (commit ``HANDWRITTEN``) and imported beside the
current ones. It measures encode and decode microseconds per TASK and per RESULT (header
only, as the front reads it, and in full with its arrays), both codecs interleaved in one
process and the median of ``--rounds`` rounds kept (the machines are shared and noisy);
counts the code lines of each; and with ``--fuzz N`` runs N fuzzed headers and N fuzzed
messages (``tests/fuzzing.py``, needs hypothesis) through both decoders and reports every
difference in what they accept and anything but ``ProtocolError`` escaping; then hand-made
probes of the edges the fuzzer does not reach.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import importlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import timeit
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from dataserver import protocol
from dataserver.protocol import MAGIC, MsgType, ProtocolError

HANDWRITTEN = "dbee2a58359af34e66d4ad86827a6c58761a4dce"  # the last commit with them


def handwritten() -> Any:
    """The hand-written codecs (``dataserver.protocol`` as of ``HANDWRITTEN``), read from git
    and imported as the package ``_ds_handwritten`` beside the msgspec ones."""
    if "_ds_handwritten" in sys.modules:
        return sys.modules["_ds_handwritten"]
    repo = Path(__file__).resolve().parents[2]
    tmp = tempfile.mkdtemp(prefix="ds-codecs-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    target = Path(tmp) / "_ds_handwritten"
    target.mkdir()
    for name in ("__init__", "wire", "fields", "messages"):
        text = subprocess.run(
            ["git", "-C", str(repo), "show", f"{HANDWRITTEN}:dataserver/protocol/{name}.py"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        (target / f"{name}.py").write_text(text.replace("dataserver.protocol", "_ds_handwritten"))
    sys.path.insert(0, str(target.parent))
    return importlib.import_module("_ds_handwritten")


# ---------------------------------------------------------------------------- the messages

SID = b"0123456789abcdef"
AUTH = b"bench-secret-16b"
N_IMAGES = 8
BOXES_PER_IMAGE = 10


def task_fields() -> dict[str, Any]:
    """A realistic TASK: 8 output images of one source each, grid 1, every field set."""
    return {
        "session": SID,
        "auth": AUTH,
        "task_id": 123456,
        "plan_version": 3,
        "epoch": 2,
        "seed": 987654321,
        "images": tuple((1000 + i,) for i in range(N_IMAGES)),
        "grid": 1,
        "out_hw": (512, 512),
        "fit_hw": (512, 512),
        "on_error": "skip",
        "control_seq": 5,
        "exclude": (7,),
        "priority": 1,
        "land_token": "tok-0123456789",
        "land_region": 3,
        "land_gen": 11,
        "land_offset": 1 << 22,
    }


def result_fields() -> dict[str, Any]:
    """The RESULT of that TASK: its images sent (not landed), 10 boxes an image."""
    return {
        "session": SID,
        "task_id": 123456,
        "plan_version": 3,
        "images": tuple((1000 + i,) for i in range(N_IMAGES)),
        "box_counts": (BOXES_PER_IMAGE,) * N_IMAGES,
        "failed": (),
        "decoded": N_IMAGES,
        "landed": False,
        "task_us": 54321,
        "decode_us": tuple(1000 + i for i in range(N_IMAGES)),
    }


def result_arrays() -> list[np.ndarray]:
    m = N_IMAGES * BOXES_PER_IMAGE
    return [
        np.zeros((N_IMAGES, 3, 512, 512), dtype=np.uint8),
        np.ones((m, 4), dtype=np.float32),
        np.arange(m, dtype=np.int64),
    ]


def as_bytes(frames: list[Any]) -> list[bytes]:
    """Frames as a receiver holds them (one copy of each, made once)."""
    return [bytes(memoryview(f).cast("B")) for f in frames]


def cases() -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """(hand-written, msgspec) callables per measured operation, on equal messages."""
    old = handwritten()
    arrays = result_arrays()
    task, new_task = old.Task(**task_fields()), protocol.Task(**task_fields())
    res = old.Result(**result_fields(), pixels=arrays[0], boxes=arrays[1], labels=arrays[2])
    new_res = protocol.Result(
        **result_fields(), pixels=arrays[0], boxes=arrays[1], labels=arrays[2]
    )
    task_frames, new_task_frames = as_bytes(task.encode()), as_bytes(new_task.encode())
    res_frames, new_res_frames = as_bytes(res.encode()), as_bytes(new_res.encode())
    for a, b in ((task_frames, new_task_frames), (res_frames, new_res_frames)):
        _same(old.decode(a), protocol.decode(b))  # equal messages, read both ways round
        _same(old.decode(b), protocol.decode(a))
    return {
        "TASK encode": (task.encode, new_task.encode),
        "TASK decode": (lambda: old.decode(task_frames), lambda: protocol.decode(new_task_frames)),
        "RESULT encode": (res.encode, new_res.encode),
        "RESULT decode, header only (front)": (
            lambda: old.decode(res_frames, with_arrays=False),
            lambda: protocol.decode(new_res_frames, with_arrays=False),
        ),
        "RESULT decode, with arrays": (
            lambda: old.decode(res_frames),
            lambda: protocol.decode(new_res_frames),
        ),
    }


def _same(old_msg: Any, msg: protocol.Message) -> None:
    names = [name for name, _ in old_msg._codecs]
    want = {name: getattr(old_msg, name) for name in names}
    got = {name: getattr(msg, name) for name in names}
    arrays = [getattr(old_msg, n, None) for n in ("pixels", "boxes", "labels")]
    new_arrays = [getattr(msg, n, None) for n in ("pixels", "boxes", "labels")]
    same_arrays = all(
        (a is None and b is None) or (a is not None and b is not None and np.array_equal(a, b))
        for a, b in zip(arrays, new_arrays, strict=True)
    )
    if type(old_msg).__name__ != type(msg).__name__ or got != want or not same_arrays:
        raise AssertionError(f"the two codecs disagree: {want} != {got}")


def measure(rounds: int) -> dict[str, tuple[float, float]]:
    """Median microseconds per call of (hand-written, msgspec), alternated round by round."""
    timed = cases()
    numbers = {}
    for name, (cur, new) in timed.items():  # calls per measurement: ~20 ms of work
        numbers[name] = max(100, int(0.02 / max(_once(cur), _once(new), 1e-7)))
    samples: dict[str, tuple[list[float], list[float]]] = {n: ([], []) for n in timed}
    for _ in range(rounds):
        for name, (cur, new) in timed.items():
            for side, fn in enumerate((cur, new)):
                seconds = timeit.timeit(fn, number=numbers[name])
                samples[name][side].append(seconds / numbers[name] * 1e6)
    return {n: (statistics.median(a), statistics.median(b)) for n, (a, b) in samples.items()}


def _once(fn: Callable[[], object]) -> float:
    return timeit.timeit(fn, number=200) / 200


# ---------------------------------------------------------------------------- line counts


def code_lines(
    path: Path, names: set[str] | None = None, between: tuple[str, str] | None = None
) -> int:
    """Lines holding code (no blank lines, comments or docstrings) of ``path``: all of it,
    only the top-level definitions in ``names``, or only the lines between two markers."""
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    skip: set[int] = set()
    for node in ast.walk(tree):  # docstrings
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(getattr(first.value, "value", None), str):
            skip.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    wanted: set[int] = set(range(1, len(lines) + 1))
    if names is not None:
        wanted = set()
        for node in tree.body:
            if getattr(node, "name", None) in names:
                wanted.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    if between is not None:
        start = next(i for i, ln in enumerate(lines, 1) if between[0] in ln)
        end = next(i for i, ln in enumerate(lines, 1) if between[1] in ln and i > start)
        wanted &= set(range(start, end))
    code = [lines[i - 1].strip() for i in wanted - skip]
    return len([ln for ln in code if ln and not ln.startswith("#")])


def line_counts() -> dict[str, tuple[int, int]]:
    """Code lines of each protocol module, (hand-written, msgspec)."""
    old = Path(handwritten().__file__).parent
    new = Path(protocol.__file__).parent
    names = ("fields.py", "messages.py", "wire.py")
    counts = {n: (code_lines(old / n), code_lines(new / n)) for n in names}
    counts["together"] = (sum(a for a, _ in counts.values()), sum(b for _, b in counts.values()))
    return counts


# ---------------------------------------------------------------------------- fuzz comparison


class _Compare:
    """Both decoders on one input, tallied into ``report``."""

    def __init__(self, old: Any) -> None:
        self.old = old
        self.report: dict[str, Counter[str]] = {
            "runs": Counter(),
            "differences": Counter(),
            "escaped": Counter(),
            "accepted": Counter(),
        }

    def _decode_both(
        self, frames: list[bytes], with_arrays: bool
    ) -> tuple[Any, protocol.Message | None, str, str]:
        old, escaped = self.old, self.report["escaped"]
        cur: Any = None
        new: protocol.Message | None = None
        cur_err = new_err = ""
        try:
            cur = old.decode(frames, with_arrays)
        except old.ProtocolError as exc:
            cur_err = str(exc)
        except BaseException as exc:
            escaped[f"hand-written: {type(exc).__name__}"] += 1
        try:
            new = protocol.decode(frames, with_arrays)
        except ProtocolError as exc:
            new_err = str(exc)
        except BaseException as exc:
            escaped[f"msgspec: {type(exc).__name__}"] += 1
        return cur, new, cur_err, new_err

    def __call__(self, frames: list[bytes], with_arrays: bool, kind: str) -> None:
        report = self.report
        report["runs"][kind] += 1
        cur, new, cur_err, new_err = self._decode_both(frames, with_arrays)
        try:
            mtype = MsgType(frames[1][0]).name
        except (IndexError, ValueError):
            mtype = "?"
        verdict = {(True, True): "both", (True, False): "hand-written", (False, True): "msgspec"}
        report["accepted"][
            f"{kind}: {verdict.get((cur is not None, new is not None), 'none')}"
        ] += 1
        if (cur is None) != (new is None):
            side, err = (
                ("hand-written only", new_err) if cur is not None else ("msgspec only", cur_err)
            )
            report["differences"][
                f"{kind} {mtype}: accepted by {side}; other says: {_short(err)}"
            ] += 1
        elif cur is not None and new is not None:
            try:
                _same(cur, new)
            except AssertionError:
                report["differences"][f"{kind} {mtype}: both accept, values differ"] += 1


def fuzz_compare(count: int) -> dict[str, Counter[str]]:
    """Fuzzed headers (``fuzzing.headers``, decoded without arrays) and fuzzed messages
    (``fuzzing.messages``) through both decoders: where they differ, and what escaped."""
    tests = Path(__file__).resolve().parents[2] / "tests"
    sys.path.insert(0, str(tests))
    import msgpack
    from fuzzing import headers
    from fuzzing import messages as fuzz_messages
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    one = _Compare(handwritten())

    settings_ = settings(
        max_examples=count,
        database=None,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )

    @settings_
    @given(st.sampled_from(list(MsgType)).flatmap(lambda t: st.tuples(st.just(t), headers(t))))
    def run_headers(pair: tuple[MsgType, dict[str, Any]]) -> None:
        mtype, header = pair
        try:
            raw = msgpack.packb(header, use_bin_type=True)
        except (OverflowError, TypeError, ValueError):
            return
        one([MAGIC, bytes([int(mtype)]), raw], False, "header")

    @settings_
    @given(fuzz_messages())
    def run_messages(frames: list[bytes]) -> None:
        one(frames, True, "message")

    run_headers()
    run_messages()
    return one.report


def _short(err: str | None) -> str:
    """An error message without its values, so that equal causes count together."""
    text = (err or "").split(", got ")[0].split(" - at ")
    where = text[1] if len(text) > 1 else ""
    return f"{text[0][:70]} {where}".strip()


# ---------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=7, help="alternated rounds per side")
    parser.add_argument("--fuzz", type=int, default=0, help="fuzzed headers and messages each")
    args = parser.parse_args(argv)
    print(f"msgspec {msgspec.__version__}; medians of {args.rounds} rounds, us per message")
    print(f"{'':38} {'hand-written':>12} {'msgspec':>10} {'ratio':>7}")
    for name, (cur, new) in measure(args.rounds).items():
        print(f"{name:38} {cur:12.2f} {new:10.2f} {new / cur:7.2f}")
    print("\ncode lines (no blanks, comments, docstrings): hand-written, msgspec")
    for name, (a, b) in line_counts().items():
        print(f"  {name:36} {a:8} {b:10}")
    if args.fuzz:
        report = fuzz_compare(args.fuzz)
        print(f"\nfuzz: {dict(report['runs'])} decoded by both")
        print(f"  accepted by: {dict(report['accepted'])}")
        print(f"  escaped (not ProtocolError): {dict(report['escaped']) or 'nothing'}")
        print("  differences in what is accepted:" + ("" if report["differences"] else " none"))
        for what, n in report["differences"].most_common():
            print(f"  {n:6}  {what}")
    print("\nprobes (headers the fuzzer does not make): accepted by hand-written / msgspec")
    old = handwritten()
    for name, frames, with_arrays in probes():
        verdicts = []
        for fn in (old.decode, protocol.decode):
            try:
                fn(frames, with_arrays)
                verdicts.append("accept")
            except (ProtocolError, old.ProtocolError):
                verdicts.append("reject")
        mark = "  " if verdicts[0] == verdicts[1] else "!="
        print(f"  {mark} {verdicts[0]:6} / {verdicts[1]:6}  {name}")
    return 0


def probes() -> list[tuple[str, list[bytes], bool]]:
    """(what, frames, with_arrays): the edges where the two decoders could part."""
    import msgpack

    def frames(mtype: MsgType, raw: bytes, *buffers: bytes) -> list[bytes]:
        return [MAGIC, bytes([int(mtype)]), raw, *buffers]

    def hello(extra: bytes = b"", n: int = 0) -> bytes:  # {"session": SID, ...n extra pairs}
        return bytes([0x81 + n]) + msgpack.packb("session") + msgpack.packb(SID) + extra

    def deep_list(depth: int) -> bytes:
        return b"\x91" * depth + b"\x01"

    stats = msgpack.packb("stats")
    big = msgpack.packb({"session": SID, "zz": [0] * 70_000}, use_bin_type=True)
    wide = msgpack.packb({"session": SID, **{f"k{i}": 0 for i in range(70_000)}})
    bad_spec = msgpack.packb({**result_header(), "arrays": [["|O", [1]], "x", ["<i8", [0]]]})
    return [
        (
            "int map key in an unknown field",
            frames(MsgType.HELLO, hello(b"\xa2zz\x81\x01\x02", 1)),
            True,
        ),
        ("bytes key at the top level", frames(MsgType.HELLO, hello(b"\xc4\x02zz\x01", 1)), True),
        ("int key at the top level", frames(MsgType.HELLO, hello(b"\x05\x01", 1)), True),
        ("70,000-item list in an unknown field", frames(MsgType.HELLO, big), True),
        ("70,000 unknown keys", frames(MsgType.HELLO, wide), True),
        (
            "ext value in an unknown field",
            frames(MsgType.HELLO, hello(b"\xa2zz\xd4\x01\x00", 1)),
            True,
        ),
        (
            "ext value in a STATS tree",
            frames(MsgType.STATS, b"\x81" + stats + b"\x81\xa1x\xd4\x01\x00"),
            True,
        ),
        (
            "timestamp in a STATS tree",
            frames(
                MsgType.STATS,
                b"\x81" + stats + b"\x81\xa1x" + msgpack.packb(msgpack.Timestamp(1, 0)),
            ),
            True,
        ),
        (
            "ext value in CONTROL values",
            frames(
                MsgType.CONTROL,
                msgpack.packb(
                    {"session": SID, "control_seq": 1, "control": {"x": msgpack.ExtType(1, b"")}}
                ),
            ),
            True,
        ),
        (
            "invalid UTF-8 in an unknown field",
            frames(MsgType.HELLO, hello(b"\xa2zz\xa1\xff", 1)),
            True,
        ),
        ("invalid UTF-8 in a known field", frames(MsgType.ERROR, b"\x81\xa7message\xa1\xff"), True),
        (
            "unknown field nested 500 deep",
            frames(MsgType.HELLO, hello(b"\xa2zz" + deep_list(500), 1)),
            True,
        ),
        (
            "unknown field nested 1,100 deep",
            frames(MsgType.HELLO, hello(b"\xa2zz" + deep_list(1100), 1)),
            True,
        ),
        ("duplicate key (last wins?)", frames(MsgType.HELLO, hello(b"\xa7session\xa0", 1)), True),
        (
            "1.0 for an integer",
            frames(MsgType.READY, msgpack.packb({"worker": 1.0, "pid": 1})),
            True,
        ),
        (
            "true for an integer",
            frames(MsgType.READY, msgpack.packb({"worker": True, "pid": 1})),
            True,
        ),
        (
            "1 for a boolean",
            frames(MsgType.READY, msgpack.packb({"worker": 1, "pid": 1, "store": 1})),
            True,
        ),
        (
            "nil for a field with a default",
            frames(MsgType.READY, msgpack.packb({"worker": 1, "pid": 1, "results": None})),
            True,
        ),
        ("str for bytes", frames(MsgType.HELLO, msgpack.packb({"session": "0123"})), True),
        (
            "RESULT header-only, bad array specs",
            frames(MsgType.RESULT, bad_spec, b"", b"", b""),
            False,
        ),
        ("header as a list", frames(MsgType.STATS, b"\x90"), True),
    ]


def result_header() -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in result_fields().items()} | {
        "images": [[1]] * N_IMAGES
    }


if __name__ == "__main__":
    raise SystemExit(main())
