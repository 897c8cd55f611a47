"""Dataset specs: the text a server is given, parsed and built inside every process.

A dataset is never pickled: the front and every worker build their own instance from the
same spec string and JSON arguments.

    synthetic                        the embedded default (2048 generated images, seed 0)
    synthetic:images=N,seed=S        N generated images from seed S
    coco:ANNOTATIONS.json[:IMAGE_DIR] a COCO-format set on disk or in object storage
    yolo:DATA.yaml[:SPLIT]           Ultralytics' YOLO layout (split ``train`` by default)
    wds:URLS                         WebDataset tar shards (a brace pattern: ``shards.py``)
    package.module:factory           a user's dataset: factory(**json.loads(--dataset-args))

An annotation source (coco, yolo, a factory with ``shared_index``) is indexed once per
server (``prepare_index``, in the front or ``dataserver index``); every process builds its
dataset on the mapped index (``build_dataset(spec, index)``) and parses nothing.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import re
import sys
import tarfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dataserver.data.coco import CocoDataset
from dataserver.data.cocoindex import AnnotationError, coco_columns
from dataserver.data.index import (
    Columns,
    IndexCache,
    MappedIndex,
    SharedIndex,
    SourceId,
    source_of,
)
from dataserver.data.synthetic import SyntheticDataset
from dataserver.data.yololayout import YoloLayout, yolo_dataset
from dataserver.protocol.fields import MAX_LABEL
from dataserver.protocol.messages import (
    MAX_ANNOUNCED_SIZES,
    MAX_CATEGORIES,
    MAX_CATEGORY_NAME,
    MAX_ORIG_SIDE,
)

DEFAULT_SPEC = "synthetic"
_PLUGIN = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")
_SYNTHETIC_KEYS = ("images", "seed")


class SpecError(ValueError):
    """A dataset spec that cannot be parsed or built; the message says what is wrong."""


@dataclass(frozen=True)
class DatasetSpec:
    """A parsed spec: ``kind`` is synthetic, coco or plugin; ``args`` its arguments."""

    text: str
    kind: str
    args: dict[str, Any] = field(default_factory=dict)
    args_json: str = "{}"


def _parse_args(args_json: str | None) -> dict[str, Any]:
    """``--dataset-args``: a JSON object (none: empty)."""
    if args_json is None:
        return {}
    try:
        args = json.loads(args_json)
    except json.JSONDecodeError as exc:
        raise SpecError(f"--dataset-args is not valid JSON: {exc}") from None
    if not isinstance(args, dict):
        raise SpecError("--dataset-args must be a JSON object")
    return args


def _parse_coco(text: str) -> DatasetSpec:
    rest = text[len("coco:") :]
    # The image part begins after ``.json:`` (either part may be a URL, with its own colon).
    cut = rest.find(".json:")
    ann, image_dir = (rest[: cut + 5], rest[cut + 6 :]) if cut >= 0 else (rest, "")
    if not ann:
        raise SpecError("coco: needs a path, as in coco:ANNOTATIONS.json[:IMAGE_DIR]")
    return DatasetSpec(text, "coco", {"annotations": ann, "image_dir": image_dir or None})


def _parse_yolo(text: str) -> DatasetSpec:
    rest = text[len("yolo:") :]
    data, sep, split = rest.rpartition(":")
    if not sep or not data.endswith((".yaml", ".yml")):
        data, split = rest, ""
    if not data:
        raise SpecError("yolo: needs a path, as in yolo:DATA.yaml[:SPLIT]")
    return DatasetSpec(text, "yolo", {"data": data, "split": split or "train"})


def parse_spec(text: str, args_json: str | None = None) -> DatasetSpec:
    """Parse a ``--dataset`` value (and ``--dataset-args``); raise ``SpecError``."""
    args = _parse_args(args_json)
    builtin = text == "synthetic" or text.startswith(("synthetic:", "coco:", "yolo:", "wds:"))
    if builtin and args:
        raise SpecError("--dataset-args is only for package.module:factory datasets")
    if text == "synthetic" or text.startswith("synthetic:"):
        return DatasetSpec(text, "synthetic", _parse_synthetic(text))
    if text.startswith("coco:"):
        return _parse_coco(text)
    if text.startswith("yolo:"):
        return _parse_yolo(text)
    if text.startswith("wds:"):
        if not text[4:]:
            raise SpecError("wds: needs shards, as in wds:/data/train-{000000..000009}.tar")
        return DatasetSpec(text, "wds", {"pattern": text[4:]})
    if _PLUGIN.match(text):
        return DatasetSpec(text, "plugin", args, json.dumps(args, sort_keys=True))
    raise SpecError(
        f"unknown dataset {text!r}: expected synthetic, synthetic:images=N,seed=S, "
        "coco:ANNOTATIONS.json[:IMAGE_DIR], yolo:DATA.yaml[:SPLIT], wds:URLS or "
        "package.module:factory"
    )


def _parse_synthetic(text: str) -> dict[str, int]:
    values: dict[str, int] = {}
    _, _, opts = text.partition(":")
    for item in filter(None, opts.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in _SYNTHETIC_KEYS:
            raise SpecError(f"synthetic: unknown option {item!r} (known: images=N, seed=S)")
        try:
            values[key] = int(value)
        except ValueError:
            raise SpecError(f"synthetic: {key} must be an integer, got {value!r}") from None
    if values.get("images", 1) < 1:
        raise SpecError("synthetic: images must be >= 1")
    return values


def prepare_index(
    spec: DatasetSpec,
    cache: IndexCache | None = None,
    progress: Callable[[float], None] | None = None,
    cached_only: bool = False,
) -> tuple[SharedIndex | None, str]:
    """The index a spec's processes share, built once (``None`` for a source without
    one: synthetic, a factory without ``shared_index``), and how it was had (``cached``,
    ``built``, ``rebuilt: WHY``, ``plugin``). Annotation sources go through ``cache``
    (default: the per-user cache directory); ``progress(f)`` is told 0..1 while building.
    ``cached_only``: an annotation source not cached is not built: (None, ``uncached``).
    ``SpecError`` says what is wrong, naming the file."""
    try:
        if spec.kind == "coco":
            ann = spec.args["annotations"]
            source = source_of("coco", ann)
            build = None if cached_only else (lambda: coco_columns(ann, progress))
            return (cache or IndexCache()).load_or_build(source, build)
        if spec.kind == "yolo":
            layout = YoloLayout.read(spec.args["data"], spec.args["split"])
            columns = None if cached_only else (lambda: layout.columns(progress))
            return (cache or IndexCache()).load_or_build(layout.source(), columns)
    except AnnotationError as exc:
        raise SpecError(str(exc)) from None
    except (OSError, ValueError) as exc:
        what = spec.args.get("annotations") or spec.args.get("data")
        raise SpecError(f"{spec.kind}: cannot load {what}: {exc}") from None
    if spec.kind != "plugin":
        return None, ""
    factory = _factory(spec)
    hook = getattr(factory, "shared_index", None)
    if hook is None:
        return None, ""
    shared = plugin_index(spec, hook, cache)
    return shared, "" if shared is None else "plugin"


def plugin_index(
    spec: DatasetSpec, hook: Callable[..., Any], cache: IndexCache | None
) -> SharedIndex | None:
    """A factory's ``shared_index(**args)`` (given ``index_cache`` too when it takes it):
    a mapping of names to numpy arrays (or a ``SharedIndex`` it had cached; None: no
    index), shared."""
    kwargs = dict(spec.args)
    if "index_cache" in inspect.signature(hook).parameters:
        kwargs["index_cache"] = cache or IndexCache()
    try:
        made = hook(**kwargs)
        if made is None or isinstance(made, SharedIndex):
            return made
        if not isinstance(made, Mapping):
            raise TypeError(f"it returned {type(made).__name__}, not a mapping of arrays")
        arrays = {str(k): np.asarray(v) for k, v in made.items()}
        source = SourceId("plugin", spec.text, 0, 0, "", spec.args_json)
        return SharedIndex.from_columns(Columns(arrays), source)
    except Exception as exc:
        raise SpecError(
            f"{spec.text}.shared_index(**args) failed: {type(exc).__name__}: {exc}"
        ) from None


def _factory(spec: DatasetSpec) -> Callable[..., Any]:
    module_name, _, factory_name = spec.text.partition(":")
    # Like gunicorn and uvicorn: a user's module in the working directory is importable.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise SpecError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise SpecError(f"{module_name!r} has no callable {factory_name!r}")
    return factory


def build_dataset(spec: DatasetSpec, index: MappedIndex | None = None) -> Any:
    """Build the dataset a spec names, on the server's shared ``index`` when it has one
    (``prepare_index``; without it an annotation source is indexed here); raise
    ``SpecError`` saying why it cannot be built."""
    if spec.kind == "synthetic":
        return SyntheticDataset(**spec.args)
    if spec.kind in ("coco", "yolo"):
        return _annotated(spec, index)
    if spec.kind == "wds":
        return _build_shards(spec.args["pattern"])
    factory = _factory(spec)
    kwargs = dict(spec.args)
    if index is not None:
        kwargs["index"] = index
    try:
        dataset = factory(**kwargs)
    except Exception as exc:
        raise SpecError(f"{spec.text}(**args) raised {type(exc).__name__}: {exc}") from None
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise SpecError(f"{spec.text} returned {type(dataset).__name__}, not a dataset")
    return dataset


def _build_shards(pattern: str) -> Any:
    """``wds:PATTERN`` (``shards.py``); ``SpecError`` naming the shard that failed."""
    from dataserver.data.shards import ShardDataset

    try:
        return ShardDataset(pattern)
    except (OSError, ValueError, KeyError, TypeError, tarfile.TarError) as exc:
        raise SpecError(f"wds: cannot index {pattern}: {exc}") from None


def _annotated(spec: DatasetSpec, index: MappedIndex | None) -> Any:
    """A coco or yolo spec's dataset; ``SpecError`` naming the file."""
    what = spec.args.get("annotations") or spec.args.get("data")
    try:
        if spec.kind == "coco":
            return CocoDataset(spec.args["annotations"], spec.args["image_dir"], index)
        return yolo_dataset(spec.args["data"], spec.args["split"], index)
    except AnnotationError as exc:
        raise SpecError(str(exc)) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SpecError(f"{spec.kind}: cannot load {what}: {exc}") from None


def dataset_fingerprint(spec: DatasetSpec, dataset: Any) -> str:
    """A short string that is equal on two servers only if they serve the same data."""
    if spec.kind == "synthetic":
        return f"synthetic-{dataset.images}-{dataset.seed}"
    own = getattr(dataset, "fingerprint", None)
    if isinstance(own, str):
        return f"{spec.kind}-{own}"
    digest = hashlib.sha1(f"{spec.text}|{spec.args_json}|{len(dataset)}".encode()).hexdigest()
    return f"{spec.kind}-{digest[:16]}"


def dataset_categories(dataset: Any) -> tuple[tuple[int, str], ...]:
    """The dataset's ``categories`` (attribute or property: a sequence of (label, name)
    pairs, labels distinct class ids, names strings), checked, as a WELCOME announces them;
    () when it has none. ``SpecError`` says what is wrong."""
    raw = getattr(dataset, "categories", None)
    if raw is None:
        return ()
    if isinstance(raw, (str, bytes, dict)) or not hasattr(raw, "__iter__"):
        raise SpecError(f"dataset categories must be (label, name) pairs, got {type(raw).__name__}")
    out: list[tuple[int, str]] = []
    for pair in raw:
        try:
            label, name = pair
        except (TypeError, ValueError):
            raise SpecError(f"dataset category {pair!r} is not a (label, name) pair") from None
        ok_label = isinstance(label, int) and not isinstance(label, bool)
        if not ok_label or not 0 <= label <= MAX_LABEL:
            raise SpecError(f"dataset category label {label!r} is not a class id 0..{MAX_LABEL}")
        if not isinstance(name, str) or len(name) > MAX_CATEGORY_NAME:
            raise SpecError(
                f"dataset category {label} name must be a string of at most "
                f"{MAX_CATEGORY_NAME} characters"
            )
        out.append((int(label), name))
        if len(out) > MAX_CATEGORIES:
            raise SpecError(f"a dataset announces at most {MAX_CATEGORIES} categories")
    if len({label for label, _ in out}) != len(out):
        raise SpecError("dataset categories name a label twice")
    return tuple(out)


def dataset_sizes(dataset: Any, size: int) -> np.ndarray | None:
    """The dataset's ``sizes`` (attribute or property: one (h, w) per index, each side a
    positive int; a sequence of pairs or an (N, 2) integer array), checked, as its server
    announces them (SIZES, on request): an int32 (N, 2) array, read-only; None when it has
    none. At most ``MAX_ANNOUNCED_SIZES``; ``SpecError`` says what is wrong."""
    raw = getattr(dataset, "sizes", None)
    if raw is None:
        return None
    if size > MAX_ANNOUNCED_SIZES:
        raise SpecError(
            f"a dataset announces at most {MAX_ANNOUNCED_SIZES} sizes (for aspect-grouped "
            f"batches); this one has {size} samples"
        )
    try:
        integers = isinstance(raw, np.ndarray) and raw.dtype.kind in "iu"
        table = raw if integers else np.asarray(raw, dtype=np.int64)  # (no copy of an array)
    except (TypeError, ValueError, OverflowError):
        raise SpecError("dataset sizes must be (h, w) pairs of ints, one per index") from None
    if table.ndim != 2 or table.shape[1] != 2:
        raise SpecError("dataset sizes must be (h, w) pairs of ints, one per index")
    if len(table) != size:
        raise SpecError(f"dataset sizes: {len(table)} sizes for {size} samples")
    bad = np.flatnonzero(((table < 1) | (table > MAX_ORIG_SIDE)).any(axis=1))
    if bad.size:
        index = int(bad[0])
        h, w = (int(v) for v in table[index])
        raise SpecError(f"dataset size {index} {(h, w)} is not 1..{MAX_ORIG_SIDE} a side")
    out = table.astype(np.int32)
    out.setflags(write=False)
    return out
