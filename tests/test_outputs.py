"""Outputs never destroy what they should not: a command's input, a device or other special file, another process's
kernels in a shared manifest, or a file a planted link points at."""
import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch

import tmac
from tmac.apps import cli

DATA = os.path.join(os.path.dirname(__file__), "data", "mixes")


@pytest.fixture
def gguf(tmp_path):
    path = tmp_path / "model.gguf"
    shutil.copy(os.path.join(DATA, "Q4_0.gguf"), path)
    return path


def _same_bytes(path, original) -> bool:
    return open(path, "rb").read() == open(original, "rb").read()


def test_convert_refuses_to_write_over_its_input_by_any_name(gguf, tmp_path, capsys):
    os.link(gguf, tmp_path / "hard.gguf")
    os.symlink(gguf, tmp_path / "soft.tmac")
    (tmp_path / "sub").mkdir()
    for out in (gguf, tmp_path / "hard.gguf", tmp_path / "soft.tmac", tmp_path / "sub" / ".." / "model.gguf"):
        assert cli.main(["convert", str(gguf), "-o", str(out)]) == 1
        err = capsys.readouterr().err
        assert "would destroy the input" in err and "unexpected" not in err
    assert _same_bytes(gguf, os.path.join(DATA, "Q4_0.gguf")) and os.path.islink(tmp_path / "soft.tmac")
    assert sorted(os.listdir(tmp_path)) == ["hard.gguf", "model.gguf", "soft.tmac", "sub"]  # no temporary left


def test_convert_into_a_file_of_the_input_directory_is_refused(tmp_path, capsys):
    import transformers

    d = tmp_path / "hf"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32)).save_pretrained(d)
    before = (d / "model.safetensors").read_bytes()
    assert cli.main(["convert", str(d), "-o", str(d / "model.safetensors"), "--bits", "4"]) == 1
    assert "a file of the input directory" in capsys.readouterr().err
    assert (d / "model.safetensors").read_bytes() == before


@pytest.mark.parametrize("kind", ["character device", "FIFO", "directory"])
def test_outputs_never_replace_a_special_file(gguf, tmp_path, kind, capsys):
    target = tmp_path / "special"
    if kind == "character device":
        if os.geteuid() != 0:
            target = "/dev/null"  # (exists everywhere; only root could replace it, and the check comes first)
        else:
            os.mknod(target, stat.S_IFCHR | 0o666, os.makedev(1, 3))  # a /dev/null of our own
    elif kind == "FIFO":
        os.mkfifo(target)
    else:
        target.mkdir()
    mode = os.stat(target).st_mode
    assert cli.main(["convert", str(gguf), "-o", str(target)]) == 1
    assert f"is a {kind}" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"is a {kind}"):
        tmac.save(torch.nn.Linear(4, 4), target)
    assert os.stat(target).st_mode == mode  # still the same kind of file
    assert not [n for n in os.listdir(os.path.dirname(target)) if n.startswith(".tmac-save-")]


def test_concurrent_compiles_into_one_directory_keep_every_kernel(tmp_path):
    out = tmp_path / "kernels"
    procs = [subprocess.Popen([sys.executable, "-m", "tmac.apps.cli", "compile", "--shape", "256x256", "--bits", str(b),
                               "-o", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for b in (2, 3, 4)]
    results = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in results]
    from tmac.quant.cache import read_manifest

    _, kernels = read_manifest(str(out / "manifest.json"))
    libraries = sorted(n for n in os.listdir(out) if n.endswith(".so"))
    assert len(libraries) == 3 and sorted(k["file"] for k in kernels) == libraries
    assert not [n for n in os.listdir(out) if n.startswith(".build-") or n.endswith(".tmp")]


def test_a_link_planted_at_a_temporary_name_is_not_followed(tmp_path):
    from tmac.quant.cache import atomic_write_text

    victim = tmp_path / "victim"
    victim.write_text("precious")
    for name in ("manifest.json.tmp", ".manifest.json.tmp"):
        os.symlink(victim, tmp_path / name)
    atomic_write_text(str(tmp_path / "manifest.json"), "{}")
    assert victim.read_text() == "precious" and (tmp_path / "manifest.json").read_text() == "{}"
    assert sorted(os.listdir(tmp_path)) == [".manifest.json.tmp", "manifest.json", "manifest.json.tmp", "victim"]


def _limited(limit: int, *args, env=None):
    """``tmac ARGS`` in a process that may write files of at most ``limit`` bytes (RLIMIT_FSIZE, as ulimit -f)."""
    import resource

    def cap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run([sys.executable, "-m", "tmac.apps.cli", *args], capture_output=True, text=True, timeout=600,
                          preexec_fn=cap, env=env)


def test_convert_past_the_file_size_limit_says_so_and_leaves_nothing(gguf, tmp_path):
    out = tmp_path / "out.tmac"
    (tmp_path / ".tmac-save-999999999-stale").write_bytes(b"left by a killed convert")  # (no such process)
    r = _limited(100_000, "convert", str(gguf), "-o", str(out))
    assert r.returncode == 1 and "file-size limit (ulimit -f)" in r.stderr and "MiB needed" in r.stderr, r.stderr
    assert "unexpected" not in r.stderr and sorted(os.listdir(tmp_path)) == ["model.gguf"]


@pytest.mark.parametrize("command", ["run", "compile"])
def test_a_cold_compile_past_the_file_size_limit_says_so_and_leaves_no_lock(gguf, tmp_path, command):
    cache = tmp_path / "cache"
    env = dict(os.environ, TMAC_CACHE_DIR=str(cache))
    args = ["run", str(gguf), "-p", "Hi", "-n", "2", "--no-chat"] if command == "run" else \
        ["compile", "--shape", "256x256", "--bits", "4", "-o", str(tmp_path / "k")]
    r = _limited(20_000, *args, env=env)
    assert r.returncode == 1 and "ulimit -f" in r.stderr and "unexpected" not in r.stderr, r.stderr
    left = [n for _, _, names in os.walk(tmp_path) for n in names if n.endswith((".lock", ".so", ".tmp"))]
    assert not left, left


def test_temporaries_of_killed_processes_are_removed_and_odd_files_in_the_cache_heal(gguf, tmp_path):
    env = dict(os.environ, TMAC_CACHE_DIR=str(tmp_path / "cache"))
    d = subprocess.run([sys.executable, "-c", "from tmac.quant.cache import cache_dir; print(cache_dir())"], env=env,
                       capture_output=True, text=True).stdout.strip()
    os.makedirs(d)
    open(os.path.join(d, ".build-999999999-abc.so"), "wb").write(b"\x7fELF half a library")
    open(os.path.join(d, ".damaged"), "w").write("a file where the quarantine directory goes")
    # each run a fresh process: nothing loaded before it reads the cache
    run = [sys.executable, "-m", "tmac.apps.cli", "run", str(gguf), "-p", "Hi", "-n", "2", "--no-chat"]
    assert subprocess.run(run, env=env, capture_output=True, timeout=600).returncode == 0
    library = sorted(n for n in os.listdir(d) if n.startswith("lut_") and n.endswith(".so"))[0]
    with open(os.path.join(d, library), "r+b") as f:  # damage one library: it must be moved aside, rebuilt
        f.write(b"garbage!")
    os.makedirs(os.path.join(d, library[:-3] + ".json.tmp"))  # in the way of a fixed temporary name, were it used
    r = subprocess.run(run, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "moved to" in r.stderr, r.stderr
    names = os.listdir(d)
    assert not [n for n in names if n.startswith(".build-")] and os.path.isdir(os.path.join(d, ".damaged"))
    assert any(n.startswith(".damaged-not-a-directory.") for n in names)
