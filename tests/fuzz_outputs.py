"""Fuzz targets for what a command writes and what its environment says (``tests/fuzz_targets.py`` runs them):

- ``outputs``: ``tmac convert -o`` and ``tmac.save`` onto every kind of path — the input by another name or link, a
  device, FIFO or directory, a link to another file, a dangling link, a missing or read-only directory, an existing
  file: the input and every special file stay as they were, no temporary file is left, and the command either
  writes the output or refuses naming it;
- ``environment``: the variables tmac reads or passes to TVM (threads, spin counts, ISA, cache and hub settings) set
  to absurd values: ``tmac run`` generates, clamping what it can, or exits 1 naming the variable — never a signal,
  a hang or "unexpected";
- ``sizes``: texts, prompts, token counts, contexts and windows from nothing to far past the machine: done within
  the case's time and memory, or refused with a message that names the option.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import stat
import subprocess
import sys

from hypothesis import strategies as st

OUTPUT_KINDS = ["input", "hard link to input", "symlink to input", "input via ..", "character device", "FIFO",
                "directory", "symlink to a victim", "dangling symlink", "missing directory", "read-only directory",
                "existing file", "new file"]


def _cli(*args) -> tuple[int, str]:
    """``tmac ARGS`` in this process: exit code and standard error."""
    from tmac.apps import cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(list(args))
        except SystemExit as e:  # argparse's refusal of an option's value
            code = e.code
    return code, err.getvalue()


def _place(case_dir: str, kind: str, source: str, victim: str) -> str:
    """The output path of one case, made as ``kind`` says."""
    out = os.path.join(case_dir, "out.tmac")
    if kind == "input":
        return source
    if kind == "hard link to input":
        os.link(source, out)
    elif kind in ("symlink to input", "symlink to a victim", "dangling symlink"):
        os.symlink({"symlink to input": source, "symlink to a victim": victim}.get(kind, out + ".nowhere"), out)
    elif kind == "input via ..":
        os.makedirs(os.path.join(case_dir, "sub"))
        return os.path.join(case_dir, "sub", "..", os.path.basename(source))
    elif kind == "character device":
        os.mknod(out, stat.S_IFCHR | 0o666, os.makedev(1, 3)) if os.geteuid() == 0 else os.mkfifo(out)
    elif kind == "FIFO":
        os.mkfifo(out)
    elif kind == "directory":
        os.makedirs(out)
    elif kind == "missing directory":
        return os.path.join(case_dir, "no", "such", "out.tmac")
    elif kind == "read-only directory":
        ro = os.path.join(case_dir, "ro")
        os.makedirs(ro)
        os.chmod(ro, 0o500)
        return os.path.join(ro, "out.tmac")
    elif kind == "existing file":
        with open(out, "wb") as f:
            f.write(b"an older output")
    return out


def outputs_cases(d: str):
    from fuzz_targets import write_gguf

    seed = os.path.join(d, "seed.gguf")
    write_gguf(seed)
    pristine = open(seed, "rb").read()
    counter = [0]

    def check(case) -> str:
        kind, how = case
        counter[0] += 1
        case_dir = os.path.join(d, f"case{counter[0]}")
        os.makedirs(case_dir)
        source, victim = os.path.join(case_dir, "model.gguf"), os.path.join(case_dir, "victim")
        shutil.copyfile(seed, source)
        with open(victim, "wb") as f:
            f.write(b"precious")
        out = _place(case_dir, kind, source, victim)
        before = os.lstat(out) if os.path.lexists(out) else None
        if how == "convert":
            code, err = _cli("convert", source, "-o", out)
        else:
            import torch

            import tmac

            try:
                tmac.save(torch.nn.Linear(4, 4), out)
                code, err = 0, ""
            except (ValueError, OSError) as e:
                code, err = 1, str(e)
        if how == "convert" or "input" not in kind:  # (tmac.save has no input: overwriting a file is its job)
            assert open(source, "rb").read() == pristine, f"{kind}: the input changed"
        assert open(victim, "rb").read() == b"precious", f"{kind}: a linked file was written through"
        if before is not None and not stat.S_ISREG(before.st_mode) and not stat.S_ISLNK(before.st_mode):
            assert stat.S_IFMT(os.lstat(out).st_mode) == stat.S_IFMT(before.st_mode), f"{kind} was replaced"
        left = [n for _, _, names in os.walk(case_dir) for n in names if n.startswith((".tmac-save-", ".build-"))]
        assert not left, f"{kind}: temporary files left: {left}"
        assert code in (0, 1) and "unexpected" not in err, f"{kind} ({how}): exit {code}: {err[-500:]}"
        if code == 1:
            assert os.path.basename(out) in err or "out.tmac" in err or "input" in err, f"{kind}: {err[-300:]}"
        with contextlib.suppress(OSError):
            os.chmod(os.path.join(case_dir, "ro"), 0o700)
        shutil.rmtree(case_dir)
        return "written" if code == 0 else "refused"

    check.space = len(OUTPUT_KINDS) * 2
    return st.tuples(st.sampled_from(OUTPUT_KINDS), st.sampled_from(["convert", "save"])), check


VARIABLES = ["TMAC_NUM_THREADS", "TVM_NUM_THREADS", "TVM_THREAD_POOL_SPIN_COUNT", "TMAC_ISA", "TMAC_CACHE_DIR",
             "TMAC_KERNEL_DIR", "HF_HUB_OFFLINE", "OMP_NUM_THREADS"]
VALUES = ["", "0", "-1", "1", "2", "3", "100000", "1" * 20, "abc", " 2 ", "1e3", "0x10", "avx2", "neon", "/",
          "/dev/null", "/nonexistent", "-" * 100]


def environment_cases(d: str):
    from fuzz_targets import write_gguf

    seed = os.path.join(d, "seed.gguf")
    write_gguf(seed)

    def check(case) -> str:
        name, value = case
        env = dict(os.environ, **{name: value})
        if name not in ("TMAC_CACHE_DIR",):
            env["TMAC_CACHE_DIR"] = os.path.join(d, "cache")  # one warm cache, so a case is a run, not a compile
        # (in the case's directory: a relative value such as TMAC_CACHE_DIR=abc makes its directory there)
        r = subprocess.run([sys.executable, "-m", "tmac.apps.cli", "run", seed, "-p", "hi", "-n", "2", "--no-chat"],
                           capture_output=True, text=True, timeout=120, env=env, cwd=d)
        assert r.returncode in (0, 1), f"{name}={value!r}: exit {r.returncode}: {r.stderr[-800:]}"
        assert "unexpected" not in r.stderr and "Traceback" not in r.stderr, f"{name}={value!r}: {r.stderr[-800:]}"
        if r.returncode == 1:
            assert name in r.stderr or value.strip() in r.stderr, f"{name}={value!r}: {r.stderr[-500:]}"
            return "refused"
        return "clamped" if "warning" in r.stderr else "accepted"

    check.space = len(VARIABLES) * len(VALUES)
    check.share = 4  # a fresh process each: a quarter of the cases in a run
    return st.tuples(st.sampled_from(VARIABLES), st.sampled_from(VALUES)), check


SIZES = [0, 1, 7, 1000, 10**5, 10**6, 10**7, 3 * 10**7, 10**9, 2**31, 2**63]


def sizes_cases(d: str):
    from fuzz_targets import write_gguf

    seed = os.path.join(d, "seed.gguf")
    write_gguf(seed)
    text_file = os.path.join(d, "text.txt")

    def check(case) -> str:
        what, n, lines = case
        if what == "perplexity text":
            size = min(n, 3 * 10**7)
            with open(text_file, "w") as f:
                f.write(("hello world hell " * (size // 17 + 1))[:size] if lines else "x" * size)
            code, err = _cli("perplexity", seed, "--text", text_file, "--context", "16", "--windows", "2")
        elif what == "prompt":
            code, err = _cli("run", seed, "-p", "hell o" * min(n, 10**6), "-n", "1", "--no-chat", "--context", "64")
        elif what == "max new tokens":
            code, err = _cli("run", seed, "-p", "hi", "-n", str(n), "--no-chat", "--context", "32")
        elif what == "context":
            code, err = _cli("run", seed, "-p", "hi", "-n", "1", "--no-chat", "--context", str(n))
        else:  # windows
            with open(text_file, "w") as f:
                f.write("hello world hell " * 100)
            code, err = _cli("perplexity", seed, "--text", text_file, "--context", "16", "--windows", str(n))
        assert code in (0, 1, 2) and "unexpected" not in err, f"{what}={n}: exit {code}: {err[-800:]}"
        return "done" if code == 0 else "refused"

    whats = ["perplexity text", "prompt", "max new tokens", "context", "windows"]
    check.space = len(whats) * len(SIZES) * 2
    return st.tuples(st.sampled_from(whats), st.sampled_from(SIZES), st.booleans()), check


OUTPUT_TARGETS = {"outputs": outputs_cases, "environment": environment_cases, "sizes": sizes_cases}
