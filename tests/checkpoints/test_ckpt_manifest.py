"""The manifest: round trip, strict decoding, and no path outside the checkpoint, whatever the input."""

from __future__ import annotations

import contextlib

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from elastic_runtime.core.errors import CheckpointInvalid
from elastic_runtime.storage import manifest as mf


def sample(path: str = "state/a/0") -> mf.Manifest:
    structure, leaves = mf.describe_leaves({"a": np.zeros((2, 3), np.float32), "b": [np.int32(1)]})
    return mf.Manifest(
        step=12,
        data_position=13,
        layout="orbax-pytree",
        structure=structure,
        leaves=leaves,
        files=(mf.FileEntry(path=path, size=24, crc32c=0xDEADBEEF),),
        metadata={"rng": [1, 2], "mesh": {"data": 8}},
    )


def test_round_trip() -> None:
    manifest = sample()
    assert mf.decode(mf.encode(manifest), where="m") == manifest
    assert manifest.leaves[0].key == ("a",) and manifest.leaves[1].key == ("b", 0)
    assert manifest.leaves[0].shape == (2, 3) and manifest.leaves[0].dtype == "float32"


@pytest.mark.parametrize(
    "path", ["../x", "state/../../etc/passwd", "/etc/passwd", "a\\..\\b", "", "./a", "manifest.json", "a/\x00"]
)
def test_paths_outside_are_rejected(path: str) -> None:
    with pytest.raises(CheckpointInvalid, match="outside the checkpoint"):
        mf.decode(mf.encode(sample(path)), where="m")


@given(st.lists(st.sampled_from(["a", "b", "..", ".", "", "/", "c.d"]), min_size=1, max_size=6))
def test_accepted_paths_stay_inside(parts: list[str]) -> None:
    path = "/".join(parts)
    try:
        mf.check_relative(path, where="m")
    except CheckpointInvalid:
        return
    import posixpath

    normal = posixpath.normpath(path)
    assert not normal.startswith("..") and not posixpath.isabs(normal) and normal == path


@given(st.binary(max_size=200))
def test_garbage_is_invalid_never_another_error(data: bytes) -> None:
    with contextlib.suppress(CheckpointInvalid):
        mf.decode(data, where="m")


def test_wrong_types_and_versions_are_invalid() -> None:
    doc = msgspec.json.decode(mf.encode(sample()))
    doc["files"][0]["size"] = "big"
    with pytest.raises(CheckpointInvalid, match="does not validate"):
        mf.decode(msgspec.json.encode(doc), where="m")
    doc = msgspec.json.decode(mf.encode(sample()))
    doc["format"] = 99
    with pytest.raises(CheckpointInvalid, match="format 99"):
        mf.decode(msgspec.json.encode(doc), where="m")


def test_step_names_sort_like_steps() -> None:
    names = [mf.step_dirname(s) for s in (9, 10, 100)]
    assert sorted(names) == names
    assert [mf.parse_step_dirname(n) for n in names] == [9, 10, 100]
    assert mf.parse_step_dirname("step_12") is None and mf.parse_step_dirname("other") is None
