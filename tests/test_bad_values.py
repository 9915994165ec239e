"""Values a user or an environment gives that the machine cannot honour, and files that contradict themselves: each
is clamped to what the machine can run or refused with a message naming it — never a crash, a hang or garbage."""
import io
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import tmac
from conftest import copy_gguf
from tmac.apps import cli
from tmac.base.cpu import usable_cpus

GGUF = os.path.join(os.path.dirname(__file__), "data", "mixes", "Q4_0.gguf")


def _tmac(*args, **env):
    return subprocess.run([sys.executable, "-m", "tmac.apps.cli", *args], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, **env))


def test_thread_counts_past_the_cpus_are_clamped_with_a_warning():
    r = _tmac("run", GGUF, "-p", "Hi", "-n", "3", "--no-chat", "--json", TMAC_NUM_THREADS="100000",
              TVM_NUM_THREADS="100000")
    assert r.returncode == 0, r.stderr
    assert f"TMAC_NUM_THREADS=100000: this process may use {usable_cpus()} CPU" in r.stderr
    assert f"TVM_NUM_THREADS=100000: this process may use {usable_cpus()} CPU" in r.stderr
    r = _tmac("run", GGUF, "-p", "Hi", "-n", "3", "--no-chat", "--threads", "1000")
    assert r.returncode == 0 and f"threads=1000: this process may use {usable_cpus()}" in r.stderr, r.stderr


@pytest.mark.parametrize("name, value", [("TVM_THREAD_POOL_SPIN_COUNT", "-1"),
                                         ("TVM_THREAD_POOL_SPIN_COUNT", "1" * 20),
                                         ("TVM_NUM_THREADS", "lots"), ("TMAC_NUM_THREADS", "0")])
def test_environment_values_out_of_range_are_refused_by_name(name, value):
    r = _tmac("run", GGUF, "-p", "Hi", "-n", "2", "--no-chat", **{name: value})
    assert r.returncode == 1 and f"{name} must be an integer from" in r.stderr and "unexpected" not in r.stderr, \
        r.stderr


def _memory_cgroup(limit: int) -> str | None:
    """A memory cgroup (v1 or v2) of ``limit`` bytes made here, where this process may make one (root, cgroups
    mounted writable); None elsewhere."""
    for root, limit_file in (("/sys/fs/cgroup/memory", "memory.limit_in_bytes"), ("/sys/fs/cgroup", "memory.max")):
        group = os.path.join(root, f"tmac-test-{os.getpid()}")
        try:
            os.mkdir(group)
        except OSError:
            continue
        try:
            with open(os.path.join(group, limit_file), "w") as f:
                f.write(str(limit))
            return group
        except OSError:
            os.rmdir(group)
    return None


def test_a_kv_cache_larger_than_the_containers_memory_is_refused(monkeypatch):
    import tmac.base.memory

    model = tmac.load_model(GGUF, context=64, progress=False)
    need = 2 * model.config.n_layers * model.config.n_kv_heads * 4096 * model.config.head_dim * 2
    monkeypatch.setattr(tmac.base.memory, "cgroup_memory_left", lambda: need)  # the machine has more; the cgroup not
    with pytest.raises(ValueError, match="more than 80% of the .* memory available .*container"):
        model.setup_cache(4096)
    model.setup_cache(2048)  # half of it fits in 80 %
    monkeypatch.undo()
    group = _memory_cgroup(3 << 29)  # 1.5 GiB, as a small container; the default model's 65536 positions: 1.4 GiB
    if group is not None:  # (and where none can be made here, the limit above stands for it)
        try:
            r = subprocess.run(["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$@"', "sh", sys.executable,
                                "-m", "tmac.apps.cli", "run", "-p", "Hi", "--context", "65536", "-n", "2"],
                               capture_output=True, text=True, timeout=600)
        finally:
            os.rmdir(group)
        assert r.returncode == 1 and "a KV cache of 65536 positions" in r.stderr, (r.returncode, r.stderr[-500:])


def test_sampling_values_at_the_edges(capsys):
    assert cli.main(["run", GGUF, "-p", "Hi", "-n", "4", "--no-chat", "--temperature", "1e-38", "--seed", "1"]) == 0
    assert "nan" not in capsys.readouterr().err
    assert cli.main(["run", GGUF, "-p", "Hi", "-n", "4", "--no-chat", "--stop", ""]) == 1
    err = capsys.readouterr().err
    assert "stop strings must not be empty" in err and "unexpected" not in err


def test_chat_with_standard_input_closed_says_so(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", None)
    assert cli.main(["chat", GGUF]) == 1
    assert "standard input, which is closed" in capsys.readouterr().err


def test_ctrl_c_before_an_answer_begins_keeps_the_chat(monkeypatch, capsys):
    from tmac.apps import cli_generate

    monkeypatch.setattr(sys, "stdin", io.StringIO("first\nsecond\n/exit\n"))
    original, calls = cli_generate.fit_context, []

    def interrupted_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt  # between reading the line and the start of generation
        return original(*args)

    monkeypatch.setattr(cli_generate, "fit_context", interrupted_once)
    assert cli.main(["chat", GGUF, "-n", "3", "--no-chat"]) == 0
    out = capsys.readouterr()
    assert "(interrupted)" in out.err and len(calls) == 2 and out.err.count("generated: 3 tokens") == 1


def test_a_saved_layer_that_says_it_has_no_bias_but_holds_one_is_refused(tmp_path):
    layer = tmac.Linear.from_float(nn.Linear(64, 32, bias=False), bits=4, group_size=32)
    state = layer.state_dict()
    state["bias"] = torch.ones(32)
    with pytest.raises(RuntimeError, match="says bias: false but holds a bias tensor"):
        tmac.Linear.from_float(nn.Linear(64, 32, bias=False), bits=4, group_size=32).load_state_dict(state)


def test_a_layers_shape_is_read_only():
    layer = tmac.Linear.from_float(nn.Linear(64, 32, bias=False), bits=4, group_size=32)
    with pytest.raises(AttributeError):
        layer.out_features = 64
    with pytest.raises(AttributeError):
        layer.in_features = 128
    assert layer(torch.randn(2, 64)).shape == (2, 32)


def _gguf_with_tokens(path, extra: int):
    """The stored Q4_0 mix with ``extra`` more tokens than its 300 token rows."""

    def more(w, name, value, vtype, subtype):
        if name not in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            return False
        value = value + ([f"<extra{i}>" for i in range(extra)] if name.endswith("tokens") else [1] * extra)
        w.add_key_value(name, value, vtype, sub_type=subtype)
        return True

    copy_gguf(GGUF, path, more)
    return path


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path, monkeypatch):
    path = _gguf_with_tokens(tmp_path / "more.gguf", 1)
    with pytest.raises(tmac.ModelFormatError, match="tokenizer.ggml.tokens holds 301 tokens, more than the model's "
                                                    "300 token rows"):
        tmac.load_model(str(path))
    import tmac.models.files.gguf_file as gguf_file  # an array of strings past the largest vocabulary: refused unread

    monkeypatch.setattr(gguf_file, "MAX_STRINGS", 200)
    with pytest.raises(tmac.ModelFormatError, match=r"tokenizer.ggml.tokens: 301 strings; tmac reads at most 200"):
        tmac.load_model(str(path))
