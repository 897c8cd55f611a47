"""``Counts``: the counters of one declared set of names, changed only through named calls.

Each side declares its names once, as a ``StrEnum`` (the server's in
``dataserver/server/counts.py``, the client's in ``client/dataserver_client/counts.py``); a
``Counts`` of that enum takes only its members: mypy checks the type, and ``count`` checks
it again at run time, so a stray string fails the test that reaches it instead of making a
counter that nothing exports. A family of names (``landing_refused_<kind>``) is declared
member by member, and the function that picks one (``counts.landing_refused``) checks its
argument against a ``Literal`` of the suffixes.

A name shows in a report (``snapshot``) once it was counted, even by 0 (``Counter``'s
habit, which the reports keep), or from the start when it is one of ``shown``; in the
declaration's order. The owner of a ``Counts`` hands it to the collaborators that count
into it; they call its methods and never write its numbers themselves.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import Generic, TypeVar

N = TypeVar("N", bound=StrEnum)


class Counts(Generic[N]):
    """Counters named by the members of ``names`` (one side's declared set)."""

    def __init__(self, names: type[N], shown: Iterable[N] = ()) -> None:
        self._names = names
        self._n: dict[N, int] = {}
        for name in shown:
            self.count(name, 0)

    def count(self, name: N, n: int = 1) -> None:
        """``n`` more of ``name`` (a declared name, or ``TypeError``)."""
        if not isinstance(name, self._names):
            raise TypeError(f"{name!r} is not a declared {self._names.__name__} counter")
        self._n[name] = self._n.get(name, 0) + n

    def record(self, name: N, value: int) -> None:
        """``name`` is ``value`` now: a figure its owner keeps elsewhere (the scheduler's
        paced tasks, the scrape server's refusals), copied in when a report is made."""
        self.count(name, value - self._n.get(name, 0))

    def get(self, name: N) -> int:
        return self._n.get(name, 0)

    def take(self) -> dict[N, int]:
        """What was counted since the last ``take`` (everything is 0 again)."""
        out, self._n = self._n, {}
        return out

    def snapshot(self) -> dict[str, int]:
        """The counted names and their numbers, in the declaration's order (a copy)."""
        return {name.value: self._n[name] for name in self._names if name in self._n}
