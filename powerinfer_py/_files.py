"""Output files written whole or not at all, the one way every writer of the package does
it: to a new temporary file beside the output, renamed over it when complete.

The temporary's name is unique (mkstemp), so it can never be a file that exists: not an
input (`sparsify M.gguf.tmp --out M.gguf` once wrote over the model it was reading
through a memory map, SIGBUS and a truncated model), not someone else's file, not the
temporary of another run writing the same output. Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import tempfile
import threading
from typing import Iterator, Optional


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere the only way to read it is to set it
    os.umask(mask)
    return mask


def disk_full(path: str, e: OSError) -> OSError:
    """e, or an OSError that says the disk is full when it is: numpy's tofile() reports a
    short write as "N requested and M written" without errno, and Python's own ENOSPC
    does not name the file."""
    folder = os.path.dirname(os.path.abspath(path))
    full = e.errno == errno.ENOSPC
    if not full and e.errno is None and "requested and" in str(e):
        with contextlib.suppress(OSError):
            full = shutil.disk_usage(folder).free < (1 << 20)
    if not full:
        return e
    free = ""
    with contextlib.suppress(OSError):
        free = f" ({shutil.disk_usage(folder).free / 2**20:.1f} MiB free in {folder})"
    return OSError(errno.ENOSPC, f"no space left on device writing {path}{free}")


@contextlib.contextmanager
def replacing(path) -> Iterator[str]:
    """A new temporary file beside path (same folder, so the rename is atomic), for the
    caller to write; renamed to path when the block ends without an error, removed when it
    raises (an interrupt, SIGTERM under terminate_as_interrupt(), a full disk: then an
    OSError that says so), so that path holds what it held before or the whole new file."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
    os.close(fd)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would become the output's mode
        yield tmp
        os.replace(tmp, path)
    except OSError as e:
        full = disk_full(path, e)
        if full is e:
            raise
        raise full from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (`kill`, `docker stop`, systemd) raises KeyboardInterrupt inside the block,
    as SIGINT does, so that the cleanup a Ctrl-C gets (temporary files removed) runs for it
    too; after the cleanup the process ends by SIGTERM, as it would have. Nothing changes
    outside the main thread or where SIGTERM already has a handler."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    got: list = []

    def on_term(signum, frame):
        got.append(signum)
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if got:
            os.kill(os.getpid(), signal.SIGTERM)


def check_folder(path, label: str = "the output", create: bool = False) -> Optional[str]:
    """None when a file can be made at path, else why not, for a command to say before it
    works for minutes: path's folder must exist (with create: the nearest folder above it
    that exists, the command making the rest) and take a new file (checked by making and
    removing one: a read-only file system or missing permission is found too)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if create:
        while not os.path.exists(folder) and os.path.dirname(folder) != folder:
            folder = os.path.dirname(folder)
    if not os.path.exists(folder):
        return f"{label} {path}: its folder {folder} does not exist"
    if not os.path.isdir(folder):
        return f"{label} {path}: {folder} is not a folder"
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".powerinfer-check.")
        os.close(fd)
        os.remove(tmp)
    except OSError as e:
        return f"{label} {path}: cannot write in {folder} ({e.strerror or e})"
    return None


def check_space(path, nbytes: int, label: str = "the output") -> Optional[str]:
    """None when path's folder has room for nbytes more, else a message that says it has
    not (the writer's temporary needs the room even where path's old file will go)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    if free >= nbytes:
        return None
    return (f"no space left on device for {label} {path}: it needs about {nbytes / 2**20:.1f} MiB, "
            f"{free / 2**20:.1f} MiB are free in {folder}")
