"""Chat templates: a model file's data, so a template renders in jinja2's immutable sandbox with bounds on its work,
output and memory — in a forked child whose CPU time and memory are capped, so that even work the sandbox cannot
see (a huge ``'%*d'`` width, a C-level loop) ends with ``ModelFormatError``, never a hang or an exhausted
machine."""

from __future__ import annotations

import contextlib
import functools
import json
import os

from tmac.base.errors import ModelFormatError

TEMPLATE_SECONDS = 2.0  # CPU time of one render in its child (wall time where it renders in this process)
TEMPLATE_WALL = 30.0  # wall time the parent waits for a child that neither finishes nor uses CPU
TEMPLATE_WALL_MAX = 300.0  # wall time it waits for one that uses CPU all along (a loaded or emulated machine)
TEMPLATE_OUTPUT = 1 << 20  # characters of one render
TEMPLATE_ITEMS = 100_000  # range() items of one render, and the longest string or list an operator may build


class TemplateLimit(Exception):
    """A chat template exceeded its time, output or size bounds."""


class TemplateRaised(Exception):
    """A chat template called ``raise_exception`` (it refuses the messages: a message for the user)."""


def _bounded_environment():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+"])

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, (int, float)) and isinstance(left, (int, float)) and \
                    (abs(right) > 64 or abs(left) > 2 ** 64):
                raise TemplateLimit(f"{left!r:.20} ** {right!r:.20} is too large")
            if operator == "*":
                seq, times = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > TEMPLATE_ITEMS:
                    raise TemplateLimit(f"a repetition of {len(seq) * times} items")
            if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) \
                    and len(left) + len(right) > TEMPLATE_OUTPUT:
                raise TemplateLimit(f"a concatenation of {len(left) + len(right)} items")
            return super().call_binop(context, operator, left, right)

    # not optimized: jinja's optimizer folds constant expressions at compile time, outside every bound
    return Bounded(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], optimized=False)


def compile_template(source: str):
    """A function rendering ``source`` with keyword arguments as its context, compiled and rendered within bounds
    (``_render_bounded``)."""
    if not isinstance(source, str):
        raise ModelFormatError(f"chat template is a {type(source).__name__}, not a string")

    def render(**context) -> str:
        return _render_bounded(source, context)
    return render


def _compile(source: str):
    from jinja2 import TemplateError

    def raise_exception(message):
        raise TemplateRaised(message)

    budget = [TEMPLATE_ITEMS]

    def bounded_range(*args):
        r = range(*args)
        budget[0] -= len(r)
        if budget[0] < 0:
            raise TemplateLimit(f"range() calls over {TEMPLATE_ITEMS} items in all")
        return r

    def tojson(value, indent=None):
        if indent is not None and (not isinstance(indent, int) or not 0 <= indent <= 16):
            raise TemplateLimit(f"tojson(indent={indent!r:.20})")
        return json.dumps(value, ensure_ascii=False, indent=indent)

    env = _bounded_environment()
    env.globals.update(raise_exception=raise_exception, range=bounded_range)
    env.filters["tojson"] = tojson
    try:
        return env.from_string(source)
    except (TemplateError, RecursionError, MemoryError, SyntaxError, OverflowError, ValueError, TypeError) as e:
        raise ModelFormatError(f"chat template does not compile: {type(e).__name__}: {e}") from None


def _render_bounded(source: str, context: dict) -> str:
    """Template ``source`` compiled and rendered with ``context`` in a forked child whose time and memory are capped,
    so that even work the sandbox cannot see (a huge ``'%*d'`` width, a C-level loop) ends; in this process where
    there is no fork."""
    if not hasattr(os, "fork"):
        return _render_here(source, context)
    _warm_jinja()
    import select
    import signal
    import time

    read_end, write_end = os.pipe()
    pid = _fork()
    if pid is None:  # the system lets this process start no other now: render here, under its time limit
        os.close(read_end)
        os.close(write_end)
        return _render_here(source, context)
    if pid == 0:
        _render_child(source, context, read_end, write_end)  # never returns
    os.close(write_end)
    start = time.monotonic()
    chunks, size, complete, deadline, ticks = [], 0, False, start + TEMPLATE_WALL, _cpu_ticks(pid)
    try:
        while size <= 4 * TEMPLATE_OUTPUT + 4096:  # (the child's output is capped in characters)
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_end], [], [], left)[0]:
                # a child that used CPU meanwhile is rendering on a busy (or emulated) machine, its CPU capped: it
                # gets more time; one that used none is stuck
                now, used = time.monotonic(), _cpu_ticks(pid)
                if used is not None and ticks is not None and used > ticks and now - start < TEMPLATE_WALL_MAX:
                    deadline, ticks = min(now + TEMPLATE_WALL, start + TEMPLATE_WALL_MAX), used
                    continue
                break
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                complete = True
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(read_end)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # done, or over its time
        _, status = os.waitpid(pid, 0)
    kind, _, text = b"".join(chunks).partition(b"\0")
    if complete and kind == b"ok":
        return text.decode()
    if complete and kind == b"error":
        raise ModelFormatError(text.decode())
    if complete and kind == b"raised":
        raise TemplateRaised(text.decode())
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGPROF, signal.SIGXCPU):
        raise ModelFormatError(f"chat template: TemplateLimit: rendering used more than {TEMPLATE_SECONDS} s of CPU")
    if time.monotonic() >= deadline:
        raise ModelFormatError(f"chat template: TemplateLimit: rendering took more than {TEMPLATE_WALL} s")
    raise ModelFormatError(f"chat template: TemplateLimit: rendering ran out of its {TEMPLATE_MEMORY >> 20} MiB of "
                           f"memory or its time")


TEMPLATE_MEMORY = 512 << 20  # bytes a render may allocate (in its child)


def _cpu_ticks(pid: int) -> int | None:
    """CPU time (clock ticks, user + system) process ``pid`` has used, where /proc says (Linux); else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return int(fields[11]) + int(fields[12])  # (fields 14 and 15: utime, stime)
    except (OSError, ValueError, IndexError):
        return None


def _fork() -> int | None:
    """``os.fork()``, tried again after a moment when the system has no process to spare (EAGAIN: a pids limit, or
    many threads starting at once); None when it still has none."""
    import time
    import warnings

    for pause in (0.05, 0.2, 0.5, None):
        try:
            with warnings.catch_warnings():  # the child only renders: no other thread's locks are taken in it
                warnings.simplefilter("ignore", DeprecationWarning)
                return os.fork()
        except BlockingIOError:
            if pause is None:
                return None
            time.sleep(pause)


@functools.cache
def _warm_jinja() -> None:
    """Import jinja and run its compiler once in this process, so each forked child only compiles and renders its
    template (on a slow or emulated CPU, importing jinja in every child costs more than the render's budget)."""
    _compile("{% for i in range(2) %}{{ i ~ x | tojson }}{% endfor %}").render(x="")


def _render_child(source: str, context: dict, read_end: int, write_end: int) -> None:
    """In the forked child: cap memory and time, render, write ``ok|error|raised \\0 text`` and exit."""
    code = 0
    try:
        import resource
        import signal

        os.close(read_end)
        # CPU time, not wall time: a loaded or emulated machine renders slower but the bound is the template's work;
        # the default action of SIGPROF ends the child even inside C code
        signal.signal(signal.SIGPROF, signal.SIG_DFL)
        signal.setitimer(signal.ITIMER_PROF, TEMPLATE_SECONDS)
        with open("/proc/self/status") as f:
            used = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmData:")), 0)
        hard = resource.getrlimit(resource.RLIMIT_DATA)[1]
        limit = used + TEMPLATE_MEMORY
        resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
        try:
            reply = b"ok\0" + _render_here(source, context, timed=False).encode()
        except ModelFormatError as e:
            reply = b"error\0" + str(e).encode()
        except TemplateRaised as e:
            reply = b"raised\0" + str(e).encode()
        view = memoryview(reply)
        while view:
            view = view[os.write(write_end, view):]
    except BaseException:
        code = 1
    finally:
        os._exit(code)


def _render_here(source: str, context: dict, timed: bool = True) -> str:
    import signal
    import threading

    from jinja2 import TemplateError

    def out_of_time(signum, frame):
        raise TemplateLimit(f"rendering took more than {TEMPLATE_SECONDS} s")

    timed = timed and threading.current_thread() is threading.main_thread()
    if timed:
        previous = signal.signal(signal.SIGALRM, out_of_time)
        signal.setitimer(signal.ITIMER_REAL, TEMPLATE_SECONDS)
    try:
        template = _compile(source)
        parts, size = [], 0
        for chunk in template.generate(**context):
            size += len(chunk)
            if size > TEMPLATE_OUTPUT:
                raise TemplateLimit(f"output over {TEMPLATE_OUTPUT} characters")
            parts.append(chunk)
        return "".join(parts)
    except (TemplateRaised, ModelFormatError):
        raise  # the template's own raise_exception (its message is for the user), or it does not compile
    except (TemplateError, TemplateLimit, RecursionError, MemoryError, OverflowError, TypeError, ValueError,
            ArithmeticError, AttributeError, LookupError) as e:
        raise ModelFormatError(f"chat template: {type(e).__name__}: {e}") from None
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
