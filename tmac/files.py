"""Reading files tmac does not control (model files, caches, kernel directories) without being hung or flooded.

Only regular files are read — a FIFO would block forever, ``/dev/zero`` never ends — and never more than a cap;
JSON nested deeper than the parser's recursion is refused as malformed, not raised as ``RecursionError``.
"""

from __future__ import annotations

import json
import os
import stat


def require_regular(path: str) -> str:
    """``path`` if it is a regular file (through links); ``ModelFormatError`` otherwise — before anything opens it,
    since opening a FIFO blocks and a device never ends."""
    from .errors import ModelFormatError

    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot read ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise ModelFormatError(f"{path}: not a regular file")
    return path


def read_regular(path: str, max_bytes: int) -> bytes:
    """The bytes of ``path``, a regular file (through links) of at most ``max_bytes``; ``ValueError`` otherwise,
    ``OSError`` when it cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO opens without waiting for a writer
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: not a regular file")
        if st.st_size > max_bytes:
            raise ValueError(f"{path}: {st.st_size} bytes, more than the {max_bytes} such a file may have")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:  # grew while read
        raise ValueError(f"{path}: more than the {max_bytes} bytes such a file may have")
    return data


def parse_json(text: str | bytes, what: str):
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{what}: JSON nested too deeply") from None
    except ValueError as e:
        raise ValueError(f"{what}: not valid JSON ({e})") from None


def read_json(path: str, max_bytes: int):
    """The JSON value in ``path`` (a regular file of at most ``max_bytes``); ``ValueError`` naming the file."""
    return parse_json(read_regular(path, max_bytes), path)


_KINDS = {stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFIFO: "a FIFO",
          stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}


def check_output(path: str, inputs=()) -> None:
    """Refuse to write ``path`` where writing would destroy something: an existing path that is not a regular file
    (a device such as /dev/null would be replaced by a file, as root too), or one of ``inputs`` — the same file by
    another name, a hard link or a symbolic one — or a file inside an input directory."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise ValueError(f"{path}: cannot check the output path ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = _KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
        raise ValueError(f"{path} is {kind}: tmac writes its output to a regular file (a new one, or one it replaces)")
    real = os.path.realpath(path)
    for source in inputs:
        if source is None or not os.path.exists(source):
            continue
        if os.path.samefile(path, source):
            raise ValueError(f"{path} is the input {source}: writing it would destroy the input; choose another path")
        if os.path.isdir(source) and real.startswith(os.path.realpath(source) + os.sep):
            raise ValueError(f"{path} is a file of the input directory {source}: choose a path outside it")
