"""A model file changed while a process runs it: tmac's own writers (``tmac convert``, the packed cache) replace a
file by rename, so a reader mapping the old one answers on unharmed; with ``--no-mmap`` the model is read into
memory, and truncating or overwriting the file in place cannot kill the run either (mapped, it would: SIGBUS, as
in llama.cpp without its ``--no-mmap``); a file changed while it is being read is refused naming it."""
import os
import queue
import subprocess
import sys
import threading

import pytest
from conftest import smollm2_path

from tmac import ModelFormatError

QUESTIONS = ["What is 2+2?", "Name a color."]


class Chat:
    """``tmac chat`` on a pipe, one question at a time: each answer waits for its stats line."""

    def __init__(self, *args, env=None):
        self.proc = subprocess.Popen([sys.executable, "-m", "tmac", "chat", *args, "--temperature", "0", "-n", "16",
                                      "-c", "256"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self.err: queue.Queue = queue.Queue()
        self.lines: list[str] = []
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read_err(self):
        for line in self.proc.stderr:
            self.lines.append(line)
            self.err.put(line)
        self.err.put(None)

    def ask(self, question: str) -> None:
        self.proc.stdin.write(question + "\n")
        self.proc.stdin.flush()
        while (line := self.err.get(timeout=300)) is not None:
            if line.startswith("prompt:"):
                return
        raise AssertionError("".join(self.lines))

    def finish(self) -> tuple[int, str]:
        out, _ = self.proc.communicate(timeout=120)
        return self.proc.returncode, out


def _chat_through(model: str, between, *args, env=None) -> tuple[int, str, str]:
    """Both questions asked of one ``tmac chat`` on ``model``, ``between()`` run after the first answer."""
    chat = Chat(model, *args, env=env)
    try:
        chat.ask(QUESTIONS[0])
        between()
        chat.ask(QUESTIONS[1])
    finally:
        rc, out = chat.finish()
    return rc, out, "".join(chat.lines)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mapped")
    for name, extra in (("model.tmac", []), ("other.tmac", ["--bits", "2"])):
        r = subprocess.run([sys.executable, "-m", "tmac", "convert", smollm2_path(), "-o", str(d / name), *extra],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
    rc, out, err = _chat_through(str(d / "model.tmac"), lambda: None)
    assert rc == 0 and len(out.strip().splitlines()) == 2, err
    return d, out


def test_tmac_convert_replacing_the_file_leaves_its_reader_unharmed(files, tmp_path):
    d, undisturbed = files
    target = tmp_path / "model.tmac"
    target.write_bytes((d / "model.tmac").read_bytes())
    inode = os.stat(target).st_ino

    def convert_over():
        r = subprocess.run([sys.executable, "-m", "tmac", "convert", smollm2_path(), "--bits", "2", "-o",
                            str(target)], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr

    rc, out, err = _chat_through(str(target), convert_over)
    assert rc == 0 and out == undisturbed, err
    assert os.stat(target).st_ino != inode  # replaced by a new file, the old one never written


def test_the_packed_cache_rewriting_a_copy_leaves_its_reader_unharmed(tmp_path):
    env = {"TMAC_MODEL_CACHE": "1", "TMAC_CACHE_DIR": str(tmp_path / "cache")}

    def run(*args):
        r = subprocess.run([sys.executable, "-m", "tmac", *args], capture_output=True, text=True, timeout=600,
                           env={**os.environ, **env})
        assert r.returncode == 0, r.stderr
        return r

    run("run", smollm2_path(), "-p", "Hi", "-n", "1")  # writes the packed copy
    copies = [os.path.join(p, f) for p, _, names in os.walk(tmp_path / "cache" / "models") for f in names
              if f.endswith(".tmac")]
    assert len(copies) == 1
    inode = os.stat(copies[0]).st_ino

    def rewrite():  # removed, then packed and written again while the reader maps the old copy
        run("cache", "clear", "--models")
        run("run", smollm2_path(), "-p", "Hi", "-n", "1")

    rc, out, err = _chat_through(smollm2_path(), rewrite, env=env)
    assert rc == 0 and len(out.strip().splitlines()) == 2, err
    assert os.stat(copies[0]).st_ino != inode
    rc, again, err = _chat_through(smollm2_path(), lambda: None, env=env)
    assert rc == 0 and again == out, err


@pytest.mark.parametrize("change", ["truncate to 0", "truncate to half", "overwrite with another model"])
def test_no_mmap_runs_on_when_the_file_is_changed_in_place(files, tmp_path, change):
    d, undisturbed = files
    target = tmp_path / "model.tmac"
    target.write_bytes((d / "model.tmac").read_bytes())
    size = os.path.getsize(target)

    def change_in_place():
        if change.startswith("truncate"):
            os.truncate(target, 0 if change.endswith("0") else size // 2)
        else:
            with open(target, "r+b") as f:  # (as cp does: the same inode, new bytes)
                f.write((d / "other.tmac").read_bytes())

    rc, out, err = _chat_through(str(target), change_in_place, "--no-mmap")
    assert rc == 0 and out == undisturbed, (rc, err[-2000:])


def test_a_file_changed_while_it_is_read_is_refused(files, tmp_path):
    from tmac.base.memory import read_file

    d, _ = files
    target = tmp_path / "model.tmac"
    target.write_bytes((d / "model.tmac").read_bytes())
    size = os.path.getsize(target)

    class Shrinking:
        """A file that another process truncates after the first read."""

        def __init__(self, f):
            self.f, self.reads = f, 0

        def __getattr__(self, name):
            return getattr(self.f, name)

        def readinto(self, view):
            self.reads += 1
            if self.reads == 2:
                os.truncate(target, size // 3)
            return self.f.readinto(view[:1 << 20])

    with open(target, "rb") as f, pytest.raises(ModelFormatError, match="model.tmac: the file changed while"):
        read_file(Shrinking(f), size, str(target))
