"""Dataset categories (issue 24, point 5): a dataset's ``categories`` ((label, name) pairs)
are announced by its servers (WELCOME) and read as ``client.categories``; [] when it
announces none; labels on the wire unchanged (COCO keeps its ids). Servers of one job that
announce different categories are refused as servers of another dataset are."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from clients import make_client

from dataserver.data.spec import SpecError, dataset_categories
from dataserver.data.synthetic import SyntheticDataset

pytestmark = pytest.mark.timeout(120)

KW: dict[str, Any] = {"timeout": 10.0}


def named(categories: list[list[Any]]) -> tuple[str, ...]:
    args = json.dumps({"n": 16, "categories": categories})
    return ("--dataset", "compose_plugins:named", "--dataset-args", args)


def test_synthetic_and_coco_announce_theirs(start_server: Any, coco_dir: Path) -> None:
    synthetic = start_server("--dataset", "synthetic:images=16", workers=1)
    with make_client(synthetic.address, **KW) as client:
        assert client.categories == [(c, f"class{c}") for c in range(1, 81)]
        labels = {int(x) for t in next(iter(client)).targets for x in t["labels"]}
        assert labels <= {c for c, _ in client.categories}
    annotations = coco_dir / "annotations.json"
    doc = json.loads(annotations.read_text())
    coco = start_server("--dataset", f"coco:{annotations}", workers=1)
    with make_client(coco.address, **KW) as client:
        want = [(c["id"], c["name"]) for c in doc["categories"]]
        assert client.categories == want and want[0][0] == 1  # COCO ids, unchanged


def test_a_plugin_announces_its_own_or_none(start_server: Any) -> None:
    server = start_server(*named([[3, "cat"], [0, "background"], [9, "dog"]]), workers=1)
    with make_client(server.address, **KW) as client:
        assert client.categories == [(3, "cat"), (0, "background"), (9, "dog")]
        client.categories.append((1, "x"))  # (a copy)
        assert len(client.categories) == 3
    flat = start_server("--dataset", "ds_plugins:flat", workers=1)
    with make_client(flat.address, **KW) as client:
        assert client.categories == []


def test_servers_that_disagree_are_refused(start_server: Any) -> None:
    a = start_server(*named([[1, "cat"], [2, "dog"]]), workers=1)
    b = start_server(*named([[1, "cat"], [2, "wolf"]]), workers=1)
    with pytest.raises(Exception, match="servers disagree on the dataset's categories"):
        make_client([a.address, b.address], **KW)
    c = start_server(*named([[1, "cat"], [2, "dog"]]), workers=1)
    with make_client([a.address, c.address], **KW) as client:
        assert client.categories == [(1, "cat"), (2, "dog")]


@pytest.mark.parametrize(
    ("categories", "problem"),
    [
        ([(1, "a"), (1, "b")], "twice"),
        ([(-1, "a")], "class id"),
        ([(True, "a")], "class id"),
        ([(1, 2)], "string"),
        ([(1, "x" * 257)], "string"),
        ([(1,)], "pair"),
        ("ab", "pairs"),
    ],
)
def test_bad_categories_are_a_spec_error(categories: Any, problem: str) -> None:
    dataset = SyntheticDataset(4)
    dataset.categories = categories
    with pytest.raises(SpecError, match=problem):
        dataset_categories(dataset)
