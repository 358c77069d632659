"""A checkpoint directory read without a model: done records, chains (missing, unfinished and
out-of-order links named), retention, what a link's files say about it, options."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from torchrec_mtrains.checkpoint import (
    ChainError,
    CheckpointDirectory,
    CheckpointError,
    CheckpointOptions,
    Link,
    on_rank0,
    read_link,
)


def link(root: Path, step: int, parent: int | None = None, **extra: object) -> Path:
    """A finished link of ``step`` holding nothing but its done record."""
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    record: dict[str, object] = {"step": step, **extra}
    if parent is not None:
        record["parent"] = f"step_{parent:08d}"
    (path / "DONE").write_text(json.dumps(record))
    return path


def steps(links: list[Link]) -> list[int]:
    return [one.step for one in links]


def test_a_done_record_names_its_step_parent_and_extra(tmp_path: Path) -> None:
    path = link(tmp_path, 7, parent=4, epoch=1, batch=3)
    assert read_link(path) == Link(path, 7, "step_00000004")
    assert read_link(path).extra == {"epoch": 1, "batch": 3}
    (path / "DONE").write_text("7")  # an older layout: the step alone, a full link
    assert read_link(path) == Link(path, 7) and read_link(path).full
    (path / "DONE").write_text('{"step": 8}')
    with pytest.raises(CheckpointError, match=r"step_00000007/DONE records step 8"):
        read_link(path)
    for broken in ("{}", '{"step": 7, "parent": 3}', '{"step": 7, "parent": "../x"}', "[7", ""):
        (path / "DONE").write_text(broken)
        with pytest.raises(CheckpointError, match=r"step_00000007/DONE is unreadable"):
            read_link(path)


def test_a_chain_is_its_full_link_then_each_increment(tmp_path: Path) -> None:
    directory = CheckpointDirectory(tmp_path)
    for step, parent in ((2, None), (4, 2), (6, 4), (8, None)):
        link(tmp_path, step, parent)
    (tmp_path / "step_00000010").mkdir()  # a save that never finished
    (tmp_path / "notes").mkdir()
    assert [step for step, _ in directory.finished()] == [8, 6, 4, 2]
    assert steps(directory.links()) == [8, 6, 4, 2]
    assert steps(directory.chain(tmp_path / "step_00000006")) == [2, 4, 6]
    assert steps(directory.chain(tmp_path / "step_00000008")) == [8]
    assert directory.unfinished() == [tmp_path / "step_00000010"]
    assert directory.remove_unfinished() == [tmp_path / "step_00000010"]
    assert not (tmp_path / "step_00000010").exists()


def test_a_missing_unfinished_or_out_of_order_link_is_named(tmp_path: Path) -> None:
    directory = CheckpointDirectory(tmp_path)
    link(tmp_path, 2)
    link(tmp_path, 4, parent=2)
    six = link(tmp_path, 6, parent=4)
    (tmp_path / "step_00000002" / "DONE").unlink()
    with pytest.raises(ChainError) as info:
        directory.chain(six)
    assert str(info.value) == (
        f"checkpoint {tmp_path / 'step_00000004'} (which {six} builds on) holds the rows "
        f"changed since {tmp_path / 'step_00000002'}, which is missing or unfinished: it "
        "cannot be loaded without it"
    )
    assert info.value.path == tmp_path / "step_00000004"
    assert info.value.missing == tmp_path / "step_00000002"
    assert directory.problem(six) == str(info.value)

    (tmp_path / "step_00000004" / "DONE").write_text('{"step": 4, "parent": "step_00000006"}')
    with pytest.raises(
        ChainError,
        match=r"\(step 4\) builds on .*step_00000006 \(step 6\), which is not older: the chain is out of order",
    ):
        directory.chain(six)


def test_retention_keeps_the_newest_and_what_they_build_on(tmp_path: Path) -> None:
    directory = CheckpointDirectory(tmp_path)
    for step, parent in ((1, None), (2, 1), (3, 2), (4, None), (5, 4), (6, 5), (7, None)):
        link(tmp_path, step, parent)
    (tmp_path / "step_00000008").mkdir()  # unfinished: not retention's to judge
    assert directory.drop_old(keep=3) == [tmp_path / f"step_0000000{s}" for s in (3, 2, 1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"step_0000000{s}" for s in (4, 5, 6, 7, 8)
    ]
    assert directory.drop_old(keep=1) == [tmp_path / f"step_0000000{s}" for s in (6, 5, 4)]


def test_a_links_files_say_whether_it_loads(tmp_path: Path) -> None:
    """What dcp's metadata lists must be there, whole; a damaged link is set aside."""
    directory = CheckpointDirectory(tmp_path)
    good = tmp_path / "step_00000001"
    dcp.save({"x": torch.arange(1000.0)}, checkpoint_id=good, no_dist=True)
    (good / "DONE").write_text('{"step": 1}')
    bad = link(tmp_path, 2, parent=1)  # no metadata
    assert str(directory.problem(bad)).startswith(f"{bad / '.metadata'} is unreadable")
    assert directory.problem(good) is None and directory.latest() == Link(good, 1)

    (data,) = good.glob("*.distcp")
    size = data.stat().st_size
    os.truncate(data, size // 2)
    assert directory.problem(good) == f"{data} is truncated ({size // 2} of {size} bytes)"
    assert (
        directory.problem(bad)
        == f"it builds on {good}, and {data} is truncated ({size // 2} of {size} bytes)"
    )
    assert directory.latest() is None
    assert directory.loadable() == []  # both set aside, kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "damaged_step_00000001",
        "damaged_step_00000002",
    ]


def test_options_are_checked_when_made() -> None:
    assert CheckpointOptions() == CheckpointOptions(full_every=4, keep=3)
    assert CheckpointOptions(full_every=1, keep=None).keep is None
    for bad, message in (
        ({"full_every": 0}, r"full_every=0: must be a whole number >= 1$"),
        ({"full_every": True}, r"full_every=True"),
        ({"keep": 0}, r"keep=0: must be a whole number >= 1 or None \(keep every link\)"),
        ({"keep": 2.5}, r"keep=2.5"),
    ):
        with pytest.raises(ValueError, match=message):
            CheckpointOptions(**bad)  # type: ignore[arg-type]


def test_errors_reach_the_other_ranks_whole(tmp_path: Path) -> None:
    """``on_rank0`` hands rank 0's error to the others pickled: its attributes travel."""
    error = ChainError("message", tmp_path / "a", tmp_path / "b")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is ChainError and str(copy) == "message"
    assert (copy.path, copy.missing, copy.reason) == (error.path, error.missing, "message")
    assert on_rank0(lambda: 5) == 5  # no process group: rank 0 alone
