"""How links reach the disk: private files (0600, directories 0700, whatever the umask, as the
tier files are: a checkpoint holds a copy of every row), a file per tensor, and what a failed
write says (a full disk named as such, dcp's per-rank failures by their own message)."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
from collections.abc import Generator
from pathlib import Path
from typing import cast

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700


def private_dir(path: Path) -> None:
    """Creates ``path`` (and missing parents) as 0700 and makes an existing one 0700."""
    path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    path.chmod(PRIVATE_DIR)


def write_private(path: Path, text: str, durable: bool = False) -> None:
    """Writes ``text`` to ``path`` with mode 0600 whatever the umask. ``durable``: synced, and
    in place by a rename, so that the file is either absent or whole after a crash."""
    target = path.with_name(f".{path.name}.tmp") if durable else path
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, PRIVATE_FILE)
    os.fchmod(fd, PRIVATE_FILE)
    with os.fdopen(fd, "w") as out:
        out.write(text)
        if durable:
            out.flush()
            os.fsync(out.fileno())
    if durable:
        os.replace(target, path)


class PrivateFileSystem(FileSystem):
    """dcp's local file system, creating files 0600 and directories 0700 whatever the umask."""

    @contextlib.contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        if "r" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, PRIVATE_FILE)
        os.fchmod(fd, PRIVATE_FILE)
        try:
            with os.fdopen(fd, mode) as stream:
                yield cast(io.IOBase, stream)
        except Exception as e:
            # torch.save turns a failed write into "unexpected pos ..."; the errno survives
            # only as that error's context, which dcp's gathering of errors drops.
            if disk_full(e) and not isinstance(e, OSError):
                raise OSError(errno.ENOSPC, f"no space left on the device writing {path}") from e
            raise

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        private_dir(Path(path))


def private_writer(path: Path) -> FileSystemWriter:
    """dcp's file writer for a link: private files, one per tensor. dcp's writer keeps every
    tensor of a file referenced until the file is closed, so one file per rank would hold all
    of a log-structured table's rows, gathered batch by batch, in memory at once."""
    writer = FileSystemWriter(path, single_file_per_rank=False)
    writer.fs = PrivateFileSystem()
    return writer


def disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or what it wraps: causes, dcp's per-rank failures) is a full disk."""
    seen: set[int] = set()
    todo: list[BaseException] = [error]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(e, CheckpointException):
            todo.extend(failure[0] for failure in e.failures.values())
        todo.extend(c for c in (e.__cause__, e.__context__) if c is not None)
    return False


def nearly_full(directory: Path) -> bool:
    """torch.save reports a failed write as a position mismatch ("unexpected pos"), losing
    the errno: a disk with under 1 MiB left is taken as the cause."""
    try:
        return shutil.disk_usage(directory).free < 2**20
    except OSError:
        return False


def free_space(directory: Path) -> str:
    """The space left on ``directory``'s disk, for messages."""
    try:
        return f"{shutil.disk_usage(directory).free / 2**20:.1f} MiB"
    except OSError:
        return "unknown"


def first_line(error: BaseException) -> str:
    """The gist of an error: dcp's per-rank failures by their own message, else the first
    line of the message."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _) = min(error.failures.items())
        return f"rank {rank}: {first_line(cause)}"
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
