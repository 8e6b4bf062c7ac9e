"""The staged write: every command writes its output files through a staging folder.

`staged_write` stages the files in a folder inside the target folder and renames them into
place only once all are written (`Staging.publish`), so a failure, Ctrl-C or a killed process
leaves no partial output; `output_folder` removes the folders a failed write created;
`stale_staging` finds what a killed writer left. Files are copied in fixed-size blocks
(`copy_file`), so peak memory does not grow with the weights.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

COPY_BLOCK_BYTES = 16 << 20


def copy_file(source: Path, target: Path, progress: Callable[[int], None] | None) -> None:
    """Copy `source` to `target` block by block, with `source`'s permission bits."""
    copy_ranges(source, target, [(0, source.stat().st_size, 0)], progress)


def copy_ranges(source: Path, target: Path, ranges: Iterable[tuple[int, int, int]],
                progress: Callable[[int], None] | None) -> None:
    """Copy each (offset, length, start) range of `source` to byte `start` of `target` (the
    ranges in order of start, zeros between them) block by block, with `source`'s permission
    bits; `progress` gets the byte count of each block."""
    buffer = bytearray(COPY_BLOCK_BYTES)
    view = memoryview(buffer)
    with source.open("rb") as src, target.open("wb") as dst:
        # Windows before Python 3.13 has no fchmod: the path there.
        os.chmod(dst.fileno() if os.chmod in os.supports_fd else target,
                 stat.S_IMODE(os.fstat(src.fileno()).st_mode))
        for offset, length, start in ranges:
            dst.write(bytes(start - dst.tell()))
            src.seek(offset)
            left = length
            while left:
                count = src.readinto(view[:min(left, COPY_BLOCK_BYTES)])
                if not count:
                    raise OSError(f"{source} ends before byte {offset + length}")
                dst.write(view[:count])
                left -= count
                if progress is not None:
                    progress(count)


def _make_folder(folder: Path) -> Path | None:
    """Create `folder` and its missing parents; return the topmost one created, if any."""
    missing = [parent for parent in (folder, *folder.parents) if not parent.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    return missing[-1] if missing else None


@contextmanager
def output_folder(folder: str | os.PathLike) -> Iterator[Path]:
    """Create `folder` (and its missing parents) for a write; remove what it created on failure.

    Any exception leaving the block (a full disk, Ctrl-C, a signal turned into an exception)
    removes the folders this call created, so a failed command leaves no empty output folder; a
    folder that was already there is kept.
    """
    path = Path(folder)
    created = _make_folder(path)
    try:
        yield path
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        raise


# The file inside a staging folder that names the process writing it.
_STAGING_OWNER = ".owner"


def _staging_pattern(target_name: str) -> str:
    return f".{target_name}.*.staging"


def _process_alive(pid: int) -> bool:
    if sys.platform == "win32":  # os.kill(pid, 0) there ends the process: never called
        return True  # so on Windows staging left by a killed writer stays (remove it by hand)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_staging(folder: Path, target_name: str,
                  alive: Callable[[int], bool] = _process_alive) -> list[Path]:
    """The staging folders of `target_name` in `folder` left by writers no longer running.

    Only folders that carry an owner file with the pid of a process that is gone count; a
    folder without one is not provably ours and is left alone.
    """
    stale = []
    for candidate in sorted(folder.glob(_staging_pattern(target_name))):
        owner = candidate / _STAGING_OWNER
        try:
            text = owner.read_text(encoding="ascii").strip()
        except (OSError, UnicodeDecodeError):
            continue
        if candidate.is_dir() and not candidate.is_symlink() and text.isdigit() \
                and not alive(int(text)):
            stale.append(candidate)
    return stale


@dataclass(frozen=True)
class Staging:
    """A staging folder inside `target_dir`: write files into `path`, then `publish` them."""

    path: Path
    target_dir: Path

    def copy(self, source: str | os.PathLike, name: str,
             progress: Callable[[int], None] | None = None) -> None:
        """Copy `source` to `name` in the staging folder block by block, with its permission
        bits; `progress` receives the byte count of each block."""
        staged = self.path / name
        staged.parent.mkdir(parents=True, exist_ok=True)
        copy_file(Path(source), staged, progress)

    def publish(self, names: Iterable[str]) -> None:
        """Rename each staged file in `names` to the same name in the target folder, in order:
        the model file last, so it appears only once all it refers to is in place."""
        for name in names:
            destination = self.target_dir / name
            destination.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.path / name, destination)


@contextmanager
def staged_write(target_dir: str | os.PathLike, target_name: str) -> Iterator[Staging]:
    """A staging folder for writing `target_name` (and the files that go with it) into
    `target_dir`, which is created for the write (`output_folder`).

    The staging folder sits inside `target_dir` and carries an owner file with this process's
    pid; staging of `target_name` left there by a writer that is gone is removed first
    (`stale_staging`). The staging folder is removed when the block ends, and on any exception
    the folders this call created go too, so a failed write leaves nothing behind; only what
    `Staging.publish` renamed into place stays.
    """
    with output_folder(target_dir) as folder:
        for leftover in stale_staging(folder, target_name):
            logger.info("removing %s, left by an interrupted write", leftover)
            shutil.rmtree(leftover, ignore_errors=True)
        path = Path(tempfile.mkdtemp(prefix=f".{target_name}.", suffix=".staging", dir=folder))
        try:
            (path / _STAGING_OWNER).write_text(f"{os.getpid()}\n", encoding="ascii")
            yield Staging(path, folder)
        finally:
            shutil.rmtree(path, ignore_errors=True)
