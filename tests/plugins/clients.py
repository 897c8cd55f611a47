"""The one way the tests build a ``DataServerClient``: the options every test shares, the rest
by keyword.

It lives in tests/plugins because that folder is importable from everything the tests run:
pytest (conftest puts it on ``sys.path``), the scripts here (their own folder) and the scripts
in tests/ that tests start as subprocesses (``conftest.server_env`` puts it on their
``PYTHONPATH``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ParamSpec

from dataserver_client import DataServerClient

P = ParamSpec("P")

# What the tests share: every client runs on the CPU unless a test says otherwise (a test host
# with a GPU must run the same batches as one without). Everything else is a test's own choice:
# the constructor's defaults stand where a test gives none.
DEFAULTS: dict[str, Any] = {"device": "cpu"}


def _typed_as(
    constructor: Callable[P, DataServerClient],
) -> Callable[[Callable[..., DataServerClient]], Callable[P, DataServerClient]]:
    """Gives the builder the constructor's own signature, so mypy checks each override's name
    and type against ``DataServerClient`` itself (no copy of its options here to drift)."""

    def adopt(builder: Callable[..., DataServerClient]) -> Callable[P, DataServerClient]:
        return builder

    return adopt


@_typed_as(DataServerClient)
def make_client(addresses: Any, /, **overrides: Any) -> DataServerClient:
    """A client of ``addresses`` with ``DEFAULTS``, each overridden by a keyword of the same
    name (``device=None`` picks the constructor's own choice of device)."""
    return DataServerClient(addresses, **{**DEFAULTS, **overrides})
