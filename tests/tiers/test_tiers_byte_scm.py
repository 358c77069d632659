"""The byte-addressable tier: the mapping, MAP_SYNC on DAX mounts and NUMA (CXL) binding."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from torchrec_mtrains.tiers import RowStoreError, _linux
from torchrec_mtrains.tiers import byte_scm as byte_module
from torchrec_mtrains.tiers.byte_scm import ByteSCMStore
from torchrec_mtrains.tiers.options import ByteScmOptions
from torchrec_mtrains.types import RowLayout


def test_mapped_rows_is_the_file(tmp_path: Path) -> None:
    layout = RowLayout(64, 3, 1, "fp16")  # fp16 weights in two words, the fp32 state in one
    state = np.float32(1e-8)  # below fp16's range: kept only because the state is fp32
    with ByteSCMStore(tmp_path, "t", layout) as store:
        view = store.mapped_rows()
        assert view.shape == (64, 3) and view.dtype == np.uint32
        store.write_rows([5], np.array([[1.5, -2.0, 0.25, state]], np.float32))
        assert layout.decode(view[5:6]).tolist() == [[1.5, -2.0, 0.25, state]]
        view[6] = layout.encode(np.full((1, 4), 2.0, np.float32))  # stores reach the file too
        store.flush()
        assert store.stats.io_calls == 1  # one msync
        del view
    on_disk = np.fromfile(store.path, np.uint32, 64 * 3, offset=store.data_offset)
    assert layout.decode(on_disk.reshape(64, 3)[5:7]).tolist() == [
        [1.5, -2.0, 0.25, state],
        [2.0] * 4,
    ]


def test_close_with_a_live_view_keeps_the_view_valid(tmp_path: Path) -> None:
    store = ByteSCMStore(tmp_path, "t", RowLayout(8, 2))
    view = store.mapped_rows()
    store.write_rows([1], np.ones((1, 2), np.float32))
    store.close()
    assert view[1].tolist() == [1.0, 1.0]  # not unmapped under the reader


def test_map_sync_required_off_dax_is_a_clear_error(tmp_path: Path) -> None:
    if _linux.is_dax_mount(tmp_path):
        pytest.skip(f"{tmp_path} is on a DAX mount")
    with pytest.raises(RowStoreError, match=r"MAP_SYNC.*DAX") as err:
        ByteSCMStore(tmp_path, "t", RowLayout(8, 2), options=ByteScmOptions(map_sync=True))
    assert "t.byte_scm.rows" in str(err.value)


def test_dax_mount_tries_map_sync_then_falls_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[Path] = []

    def fake_dax(path: Path) -> bool:
        calls.append(path)
        return True

    monkeypatch.setattr(_linux, "is_dax_mount", fake_dax)
    caplog.set_level(logging.INFO, logger=byte_module.__name__)
    with ByteSCMStore(tmp_path, "t", RowLayout(8, 2)) as store:
        assert calls == [tmp_path]
        # A page-cache file system refuses MAP_SYNC, so the store must have fallen back.
        assert not store.map_sync
        store.write_rows([0], np.ones((1, 2), np.float32))
    assert "MAP_SYNC refused" in caplog.text


def test_dax_detection_from_mount_options(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/vda / ext4 rw,relatime 0 0\n"
        "/dev/pmem0 /mnt/pmem ext4 rw,dax 0 0\n"
        "/dev/pmem1 /mnt/pmem/never xfs rw,dax=never 0 0\n"
        "/dev/pmem2 /mnt/with\\040space xfs rw,dax=inode 0 0\n"
        "/dev/pmem3 /mnt/pmemfoo ext4 rw 0 0\n"
    )
    assert _linux.is_dax_mount(Path("/mnt/pmem/run1"), mounts)
    assert not _linux.is_dax_mount(Path("/mnt/pmem/never/x"), mounts)  # longest prefix wins
    assert _linux.is_dax_mount(Path("/mnt/with space/t"), mounts)
    assert not _linux.is_dax_mount(Path("/mnt/pmemfoo/x"), mounts)  # not a path prefix
    assert not _linux.is_dax_mount(Path("/home"), mounts)
    assert _linux.mount_of(Path("/mnt/pmem"), mounts)[0] == "/mnt/pmem"


def test_unknown_numa_node_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RowStoreError, match="NUMA node 4095 does not exist") as err:
        ByteSCMStore(tmp_path, "t", RowLayout(8, 2), options=ByteScmOptions(numa_node=4095))
    assert "/sys/devices/system/node" in str(err.value)
    assert not list(tmp_path.iterdir())  # refused before any file was made


def test_binding_to_a_numa_node_places_the_pages_there(tmpfs_mount: object) -> None:
    nodes = _linux.numa_nodes()
    if not nodes or _linux.syscall_number("mbind") is None:
        pytest.skip("no NUMA information or mbind on this machine")
    # shmem honours a shared mapping's policy; disk file systems' page cache ignores it.
    directory = tmpfs_mount("size=64m")  # type: ignore[operator]
    node = nodes[-1]  # the highest node: a CXL expander where one exists
    with ByteSCMStore(
        directory, "t", RowLayout(4096, 64), options=ByteScmOptions(numa_node=node)
    ) as store:
        store.write_range(0, np.ones((4096, 64), np.float32))
        view = store.mapped_rows()
        for row in (0, 2048, 4095):
            assert _linux.node_of_address(view[row].ctypes.data) == node
        del view


def test_a_file_made_without_preallocation_takes_no_disk_until_allocated(tmp_path: Path) -> None:
    layout = RowLayout(100_000, 64)  # 25.6 MB of rows
    with ByteSCMStore(tmp_path, "t", layout, options=ByteScmOptions(preallocate=False)) as store:
        assert store.path.stat().st_blocks * 512 < layout.total_bytes / 100
        assert not store.read_range(0, 10).any()
        store.allocate()
        assert store.path.stat().st_blocks * 512 >= layout.total_bytes
        store.write_range(5, np.ones((2, 64), np.float32))
        assert store.read_range(5, 2).all()


def test_allocating_on_a_full_device_names_the_file(tmpfs_mount: object) -> None:
    directory = tmpfs_mount("size=1m")  # type: ignore[operator]
    layout = RowLayout(10_000, 64)  # 2.56 MB: a sparse file is made, its blocks do not fit
    store = ByteSCMStore(directory, "t", layout, options=ByteScmOptions(preallocate=False))
    with pytest.raises(RowStoreError, match="allocating its blocks") as err:
        store.allocate()
    assert str(store.path) in str(err.value)
