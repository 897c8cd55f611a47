"""A worker's control states (dataserver/server/controls.py), without sockets: each session's
samples come from a dataset object in the state "as built, then told its own values"."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from ds_plugins import Merge

from dataserver.server.controls import ControlMissing, ControlStates

pytestmark = pytest.mark.timeout(30)


def tint(states: ControlStates, session: bytes, seq: int) -> int:
    dataset, _, _ = states.for_task(session, seq)
    return int(dataset[0]["image"][0, 0, 0])


def test_each_session_sees_its_own_values_from_a_known_start() -> None:
    states = ControlStates(Merge(4))
    states.learn(b"a", 1, {"tint": 100})
    states.learn(b"b", 3, {"label_shift": 5})  # merge-style: tint is not b's to inherit
    assert tint(states, b"a", 1) == 100
    assert tint(states, b"b", 3) == 0
    dataset_b, _, _ = states.for_task(b"b", 3)
    assert int(dataset_b[0]["labels"][0]) == 6
    assert tint(states, b"c", 0) == 0  # never set values: the pristine dataset
    assert states.pristine.state == {"tint": 0, "label_shift": 0}  # never told anything


def test_equal_values_share_one_object_and_keys_name_the_values() -> None:
    states = ControlStates(Merge(4), keep=2)
    states.learn(b"a", 1, {"tint": 3})
    states.learn(b"b", 9, {"tint": 3})
    da, ka, _ = states.for_task(b"a", 1)
    db, kb, _ = states.for_task(b"b", 9)
    assert da is db and ka == kb
    states.learn(b"c", 1, {"tint": 4})
    assert states.for_task(b"c", 1)[1] != ka
    assert states.made == 2


def test_unknown_or_forgotten_values_are_asked_for() -> None:
    states = ControlStates(Merge(4), sessions=2)
    with pytest.raises(ControlMissing):
        states.for_task(b"a", 1)
    states.learn(b"a", 1, {"tint": 1})
    with pytest.raises(ControlMissing):
        states.for_task(b"a", 2)  # newer values than the worker has
    states.learn(b"b", 1, {"tint": 2})
    states.learn(b"c", 1, {"tint": 3})  # a is forgotten now
    with pytest.raises(ControlMissing):
        states.for_task(b"a", 1)


class Uncopyable(Merge):
    def __init__(self, n: int = 4) -> None:
        super().__init__(n)
        self.lock = threading.Lock()  # deepcopy fails on a lock


def test_a_dataset_that_cannot_be_copied_is_built_again() -> None:
    built: list[Any] = []

    def fresh() -> Uncopyable:
        built.append(1)
        return Uncopyable()

    states = ControlStates(Uncopyable(), fresh)
    states.learn(b"a", 1, {"tint": 50})
    assert tint(states, b"a", 1) == 50
    assert built == [1]
    assert tint(states, b"z", 0) == 0


def test_a_dataset_without_set_control_is_shared_as_built() -> None:
    class Plain:
        def __len__(self) -> int:
            return 1

    plain = Plain()
    states = ControlStates(plain)
    assert states.for_task(b"a", 0) == (plain, "", {})
    assert states.for_task(b"a", 7) == (plain, "", {})  # values cannot matter to it
