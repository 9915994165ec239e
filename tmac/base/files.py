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
    from tmac.base.errors import ModelFormatError

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
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ValueError(f"{path}: the directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"{path}: the directory {directory} is not writable")
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


def temp_prefix(kind: str) -> str:
    """The name prefix of this process's temporary files of ``kind`` (``remove_stale_temps`` finds the dead's)."""
    return f".{kind}-{os.getpid()}-"


def remove_stale_temps(directory: str, kind: str) -> int:
    """Remove the temporary files of ``kind`` that processes no longer running left in ``directory`` (killed while
    writing); returns how many. Only this user's regular files are touched."""
    import re

    pattern, removed = re.compile(rf"^\.{re.escape(kind)}-(\d+)-"), 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        m = pattern.match(name)
        if not m or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                os.unlink(path)
                removed += 1
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def disk_problem(path: str, error: BaseException, needed: int | None = None) -> OSError | None:
    """An ``OSError`` saying in words that writing at ``path`` failed for want of space (a full filesystem, a quota,
    a file-size limit), if that is what ``error`` (or the tool output it carries) says; else None."""
    import errno
    import shutil

    text = str(error)
    codes = {errno.ENOSPC: "no space left on the filesystem", errno.EDQUOT: "the disk quota is exhausted",
             errno.EFBIG: "the file grew past this process's file-size limit (ulimit -f)"}
    code = getattr(error, "errno", None)
    if code not in codes:
        code = next((c for c, words in ((errno.ENOSPC, "No space left"), (errno.EDQUOT, "Disk quota exceeded"),
                                        (errno.EFBIG, "File too large")) if words in text), None)
    if code is None:
        return None
    directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    try:
        free = f"{shutil.disk_usage(directory).free / 2**20:.1f} MiB free there"
    except OSError:
        free = "its free space unknown"
    need = f", {needed / 2**20:.1f} MiB needed" if needed else ""
    return _os_error(code, f"cannot write {path}: {codes[code]} ({free}{need}); nothing was left half-written")


def _os_error(code: int, message: str) -> OSError:
    """An ``OSError`` with ``errno`` ``code`` whose text is ``message`` alone (no "[Errno N]" before it)."""
    problem = OSError(message)
    problem.errno = code
    return problem


def check_room(directory: str, need: int) -> None:
    """Raise an ``OSError`` in words unless ``need`` bytes can be written in ``directory``: free space there and in
    the temporary directory, and this process's file-size limit (a compiler that runs out of either mid-way aborts
    the whole process)."""
    import errno
    import resource
    import shutil
    import tempfile

    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY and soft < need:
        raise _os_error(errno.EFBIG, f"cannot write kernels: this process may write files of at most {soft} bytes "
                                     f"(ulimit -f), a kernel needs up to {need >> 20} MiB")
    for where in (directory, tempfile.gettempdir()):
        try:
            free = shutil.disk_usage(where).free
        except OSError:
            continue
        if free < need:
            raise _os_error(errno.ENOSPC, f"cannot write kernels: no space left on the filesystem of {where} "
                                          f"({free / 2**20:.1f} MiB free, {need >> 20} MiB needed)")


def umask() -> int:
    """This process's umask, read without changing it (Linux's /proc; elsewhere set and restored at once)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomically(path: str, write, kind: str, *, suffix: str = "", mode: int | None = None,
                     needed: int | None = None):
    """Make ``path`` whole or not at all: ``write(tmp)`` fills a temporary file of this process's, created
    exclusively in ``path``'s directory (a link or directory planted at a predictable name is never followed or in
    the way), which then replaces ``path`` (with permissions ``mode``, by default those any new file gets: 0666
    less the umask, not the temporary's 0600); a failed write leaves nothing,
    and a full disk or file-size limit is said in words (``needed``: the bytes it would have taken). Temporaries of
    ``kind`` that processes no longer running left there are removed first. Returns what ``write`` returned."""
    import tempfile

    directory = os.path.dirname(os.path.abspath(path))
    remove_stale_temps(directory, kind)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=temp_prefix(kind), suffix=suffix)
    os.close(fd)
    try:
        try:
            result = write(tmp)
        except Exception as e:  # (a tool's or a library's own words for a full disk among them)
            raise (disk_problem(path, e, needed) or e) from None
        os.chmod(tmp, 0o666 & ~umask() if mode is None else mode)
        os.replace(tmp, path)
        return result
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
