import os
import subprocess
import sys


def test_import_tmac_is_light():
    code = "import sys, tmac; bad = [m for m in ('tvm', 'torch', 'fastapi', 'uvicorn') if m in sys.modules]; print(bad); assert not bad"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_library_code_leaves_the_process_as_it_found_it():
    """``import tmac``, loading a model and generating from it change neither the environment (but for TVM's own
    pool settings, which only tmac's kernels read), torch's thread count nor torch's functions (``skeleton`` builds
    without patching ``torch.nn.init``)."""
    code = ("import os, torch; env = dict(os.environ); torch.set_num_threads(2); inits = dict(vars(torch.nn.init)); "
            "import tmac; assert dict(os.environ) == env, 'import'; "
            "model = tmac.load_model(context=64, progress=False); "
            "tmac.Session(model).generate([1, 2, 3], max_new_tokens=4, temperature=0, ignore_eos=True); "
            "changed = {k for k in set(os.environ) | set(env) if os.environ.get(k) != env.get(k)}; "
            "assert changed <= {'TVM_NUM_THREADS', 'TVM_THREAD_POOL_SPIN_COUNT'}, changed; "
            "assert torch.get_num_threads() == 2, torch.get_num_threads(); "
            "assert dict(vars(torch.nn.init)) == inits; print('ok')")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr[-3000:]


def test_the_command_line_chooses_passive_openmp_only_when_it_can_and_the_user_did_not():
    """The CLI owns its process: torch's OpenMP workers must not spin on the kernels' cores, so it asks them to
    sleep — unless the user set the policy, or torch was imported first and has read it already. What it chose is
    taken out of the environment the benchmark's llama.cpp peer runs in."""
    code = ("import os, sys; {} from tmac.apps import process; process.prefer_passive_openmp(); "
            "print(os.environ.get('OMP_WAIT_POLICY'), 'OMP_WAIT_POLICY' in process.user_environment())")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    for before, extra, expected in [("", {}, "PASSIVE False"), ("", {"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE True"),
                                    ("import torch;", {}, "None False")]:
        r = subprocess.run([sys.executable, "-c", code.format(before)], capture_output=True, text=True,
                           env={**env, **extra})
        assert r.returncode == 0 and r.stdout.split() == expected.split(), (before, extra, r.stdout + r.stderr)


def test_subpackages_map_to_top_level_folders():
    import tmac.codegen
    import tmac.kernels
    import tmac.models

    for mod, folder in ((tmac.codegen, "codegen"), (tmac.kernels, "kernels"), (tmac.models, "models")):
        assert mod.__file__.replace("\\", "/").split("/")[-2] == folder


def test_nothing_in_the_package_can_execute_a_model_file():
    """No pickle anywhere: no pickle/marshal/shelve imports, no torch.load or numpy allow_pickle, no eval/exec.
    (Model files are safetensors, GGUF and JSON; chat templates render sandboxed — next test.)"""
    import ast
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    offenders = []
    for folder in ("tmac", "models", "codegen", "kernels"):
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                for node in ast.walk(ast.parse(open(path).read(), path)):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        mods = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                        offenders += [(path, m) for m in mods if m.split(".")[0] in ("pickle", "marshal", "shelve",
                                                                                       "dill", "cloudpickle")]
                    elif isinstance(node, ast.Call):
                        f = node.func
                        called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                        owner = getattr(f.value, "id", "") if isinstance(f, ast.Attribute) else ""
                        kwargs = {k.arg for k in node.keywords}
                        if called in ("eval", "exec") and not owner or (owner, called) == ("torch", "load") \
                                or "allow_pickle" in kwargs:
                            offenders.append((path, ast.unparse(node)[:80]))
    assert not offenders, offenders


def test_chat_templates_render_in_a_sandbox():
    import pytest

    import tmac
    from tmac.models.text.chat_template import compile_template

    hostile = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(tmac.ModelFormatError, match="SecurityError"):
        compile_template(hostile)(messages=[])
    mutate = "{% set m = messages %}{{ m.append(1) }}"
    with pytest.raises(tmac.ModelFormatError, match="SecurityError"):
        compile_template(mutate)(messages=[])
    assert compile_template("{% for m in messages %}{{ m.content }}{% endfor %}")(
        messages=[{"content": "hi"}]) == "hi"


BOMBS = {"nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
         "a huge string": "{{ 'x' * 10**10 }}", "a huge list": "{{ ([0] * 10**9) | length }}",
         "tojson indent": "{{ messages | tojson(indent=10**9) }}", "a power": "{{ 7 ** 100000000 }}",
         "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
         "doubling": "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}"
                     "{{ ns.s | length }}",
         "output": "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
         "busy loop": "{% for m in ([messages] * 90000) %}{% for n in ([messages] * 90000) %}{% endfor %}{% endfor %}"}


def test_chat_templates_are_bounded_in_time_memory_and_output():
    """A template is a model file's data: whatever it asks, rendering ends within seconds with ModelFormatError."""
    import pytest

    import tmac
    from tmac.models.text.chat_template import TEMPLATE_SECONDS, compile_template

    for name, source in BOMBS.items():
        with pytest.raises(tmac.ModelFormatError, match="chat template") as e:
            compile_template(source)(messages=[{"role": "user", "content": "hi"}])
        assert "TemplateLimit" in str(e.value) or "RecursionError" in str(e.value), (name, e.value)
    with pytest.raises(tmac.ModelFormatError, match=f"used more than {TEMPLATE_SECONDS} s of CPU"):
        compile_template(BOMBS["busy loop"])(messages=[])


def test_a_chat_template_rendering_on_a_busy_machine_is_waited_for(monkeypatch):
    """The wall-time limit is for a render that has stopped: one still using CPU (its CPU time capped) gets more
    time, as on a loaded or emulated machine, where 30 s of wall time can hold under 2 s of a render's CPU."""
    import os
    import time

    import pytest

    import tmac
    from tmac.models.text import chat_template

    if not os.path.exists(f"/proc/{os.getpid()}/stat"):
        pytest.skip("no /proc: the wall limit cannot see a child's CPU time")
    ticks = chat_template._cpu_ticks(os.getpid())
    end = time.process_time() + 0.1
    while time.process_time() < end:
        pass
    assert chat_template._cpu_ticks(os.getpid()) > ticks
    # about half a second of CPU (under the 2 s cap), several times the wall limit
    busy = "{% for i in range(100000) %}{% for m in 'abc' %}{{ m ~ i % 7 }}{% endfor %}{% endfor %}"
    monkeypatch.setattr(chat_template, "TEMPLATE_WALL", 0.1)
    expected = "".join(m + str(i % 7) for i in range(100000) for m in "abc")
    assert chat_template.compile_template(busy)(messages=[]) == expected
    # a child that blocks, using no CPU, is ended at the wall limit
    monkeypatch.setattr(chat_template, "TEMPLATE_WALL", 0.5)
    monkeypatch.setattr(chat_template, "_render_here", lambda source, context, timed=True: time.sleep(60) or "")
    t0 = time.monotonic()
    with pytest.raises(tmac.ModelFormatError, match="took more than 0.5 s"):
        chat_template.compile_template("{{ 1 }}")(messages=[])
    assert time.monotonic() - t0 < 30


def test_readme_tables_are_made_from_the_format_table_and_the_isa_descriptions():
    """The README's format and ISA tables are what tmac.apps.doc_tables makes from the code (python -m tmac.apps.doc_tables
    README.md rewrites them), and the README stays a manual: short, and measurements live in docs/."""
    import os
    import re

    from tmac.apps.doc_tables import TABLES, render

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(root, "README.md")).read()
    for name in TABLES:
        assert f"<!-- table: {name} -->" in text, name
    assert render(text) == text, "README tables are stale: run python -m tmac.apps.doc_tables README.md"
    assert len(text.encode()) <= 16 * 1024, len(text.encode())
    for doc in ("design.md", "performance.md", "decisions.md", "llama-cpp.md"):
        assert os.path.isfile(os.path.join(root, "docs", doc)), doc
    numbered = re.compile(r"\bsessions? \d+|\brun \d+'s\b", re.I)
    for base, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("build", "__pycache__")]
        for f in files:
            if f.endswith((".py", ".md", ".toml", ".txt")) or f == "Makefile":
                path = os.path.join(base, f)
                assert not numbered.search(open(path, errors="replace").read()), f"{path} numbers working sessions"


def test_a_chat_template_renders_when_the_system_refuses_a_process(monkeypatch):
    """fork() fails with EAGAIN under a pids limit or while many threads start: the render waits a moment, then
    runs here under its time limit, instead of a BlockingIOError."""
    import os

    from tmac.models.text import chat_template

    calls = []

    def refuse():
        calls.append(1)
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", refuse)
    template = chat_template.compile_template("{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}")
    assert template(messages=[{"role": "user", "content": "hi"}]) == "[user] hi" and len(calls) == 4
