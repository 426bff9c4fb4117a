"""Create a file only if its name is free: the one conditional write the lease and its fence rely on.

Why: of two writers creating the same name, exactly one must win, whatever the timing. On local disk the
content is written to a temp file and hard-linked to the name (`link` fails if the name exists, and the
content appears whole); `O_EXCL` where the filesystem has no hard links. On fsspec stores it is
`mode="create"`: s3fs sends a conditional PUT (`If-None-Match: *`), memory:// checks the name in-process.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid

import fsspec
from fsspec.implementations.local import LocalFileSystem


def create_exclusive(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Create `path` holding `data`, or raise FileExistsError if the name is taken."""
    if isinstance(fs, LocalFileSystem):
        create_local(path, data)
    else:
        fs.pipe_file(path, data, mode="create")


def create_local(path: str, data: bytes) -> None:
    """`create_exclusive` on local disk: a hard link of a complete temp file (readers never see it half
    written); `O_EXCL` where the filesystem has no hard links."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)  # atomic: fails if the name exists
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    finally:
        with contextlib.suppress(FileNotFoundError):  # a fence's sweep may have taken it (fence.py)
            os.remove(tmp)
