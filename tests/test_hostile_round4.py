"""Hostile inputs found by an outside audit: an empty or blank API key, the hub cache's refs used as paths, error
bodies naming the model's path, file names printed raw, loader keys of the wrong type, an HF_ENDPOINT with a port,
the batch's KV caches over the memory left, huge contexts, a linker that fails, huge inputs to ``tmac.Linear``, a
compile stopped half-way."""
import http.server
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import tmac
from conftest import copy_gguf, smollm2_path
from fuzz_targets import write_gguf, write_hf_dir
from test_serve import QUESTION, call, serving
from tmac import ModelFormatError
from tmac.apps import cli
from tmac.apps.serve import create_app


def tmac_cli(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "tmac.apps.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


# ---- API keys ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("how", [["--api-key", ""], ["--api-key", "   "], ["--api-key", " sesame"]])
def test_an_empty_or_blank_api_key_is_refused_at_start_up(how):
    t0 = time.monotonic()
    r = tmac_cli("serve", "--port", "1", *how)
    assert r.returncode == 1 and "API key" in r.stderr and time.monotonic() - t0 < 10
    r = tmac_cli("serve", "--port", "1", env={"TMAC_API_KEY": how[1]})
    assert r.returncode == 1 and "API key" in r.stderr and "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def model():
    return tmac.load_model(smollm2_path(), context=256, progress=False)


def test_a_bearer_without_a_token_is_refused(model):
    with serving(model, api_key="sesame") as url:
        body = {"messages": QUESTION, "max_tokens": 2}
        for header in ("Bearer ", "Bearer", "bearer  ", "Bearer sesame2", "Basic sesame"):
            assert call(url, "POST", "/v1/chat/completions", body, {"Authorization": header})[0] == 401, header
        assert call(url, "POST", "/v1/chat/completions", body, {"Authorization": "Bearer sesame"})[0] == 200
        assert call(url, "POST", "/tokenize", {"content": "x"})[0] == 401  # llama.cpp's routes too
        assert call(url, "GET", "/health")[0] == 200
    with pytest.raises(ValueError, match="API key"):
        create_app(model, "m", api_key="")


def test_error_bodies_name_the_model_never_its_path(model, monkeypatch):
    def refuse(messages, add_generation_prompt=True):
        raise ValueError(f"{model.source}: the chat template refuses these messages: no")

    with serving(model, name="smol") as url:
        monkeypatch.setattr(model.tokenizer, "render_chat", refuse)
        status, _, body = call(url, "POST", "/v1/chat/completions", {"messages": QUESTION})
    text = json.dumps(body)
    assert status == 400 and "smol" in text and os.path.dirname(model.source) not in text


# ---- the hub cache ---------------------------------------------------------------------------------------------

def _repo(cache, repo="acme/repo", ref=None):
    base = cache / ("models--" + repo.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    (base / "snapshots" / commit).mkdir(parents=True)
    (base / "snapshots" / commit / "m.gguf").write_bytes(b"GGUF")
    (base / "refs").mkdir()
    if ref is None:
        (base / "refs" / "main").write_text(commit)
    return base


@pytest.mark.parametrize("ref", ["/", "/etc", "../../../..", "0" * 40, "fifo", "/dev/zero", "/dev/urandom"])
def test_a_ref_is_a_commit_of_the_repos_own_snapshot_or_refused(tmp_path, monkeypatch, ref):
    from tmac.models.files.hub import resolve

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base = _repo(tmp_path, ref=ref)
    main = base / "refs" / "main"
    if ref == "fifo":
        os.mkfifo(main)
    elif ref.startswith("/dev/"):
        os.symlink(ref, main)
    else:
        main.write_text(ref)
    t0 = time.monotonic()
    with pytest.raises(ModelFormatError, match="refs/main"):
        resolve("acme/repo")
    assert time.monotonic() - t0 < 5


def test_a_good_ref_resolves_and_names_are_printed_escaped(tmp_path, monkeypatch):
    from tmac.models.files.hub import _gguf_of_quant, resolve

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    base = _repo(tmp_path)
    assert resolve("acme/repo").startswith(str(base))
    with pytest.raises(FileNotFoundError) as e:
        _gguf_of_quant("acme/repo:Q8_0", ["evil\x1b[31m-Q2_K\n.gguf"], "Q8_0")
    assert "\x1b" not in str(e.value) and "\n" not in str(e.value)


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list = []

    def do_GET(self):
        self.seen.append(self.path)
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


def test_an_hf_endpoint_with_a_port_is_the_one_contacted(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {"HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}", "HF_HUB_CACHE": str(tmp_path),
               "HF_HUB_OFFLINE": "0", "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "5"}
        r = tmac_cli("pull", "acme/absent", env=env)
    finally:
        server.shutdown()
    assert _Recorder.seen, r.stderr  # the endpoint got the request
    assert r.returncode == 1 and "cannot be reached" not in r.stderr and "Traceback" not in r.stderr


# ---- loaders -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", ["general.architecture", "tokenizer.ggml.model"])
def test_a_gguf_key_of_the_wrong_type_is_named(tmp_path, key):
    import gguf

    seed = tmp_path / "seed.gguf"
    write_gguf(str(seed))

    def as_array(w, name=key, *_):
        if name != key:
            return False
        w.add_key_value(key, ["llama", "gpt2"], gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.STRING)
        return True

    # (general.architecture: the writer writes its own first; the array follows as the field read last)
    copy_gguf(seed, tmp_path / "bad.gguf", as_array, as_array if key == "general.architecture" else None)
    with pytest.raises(ModelFormatError, match="architecture" if key == "general.architecture" else "ggml.model"):
        tmac.load_model(str(tmp_path / "bad.gguf"))


@pytest.mark.parametrize("heads", [0, False, -2, "4"])
def test_a_config_with_no_heads_is_named(tmp_path, heads):
    write_hf_dir(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_attention_heads"] = heads
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match="num_attention_heads"):
        tmac.load_model(str(tmp_path))


def test_a_head_wider_than_any_model_is_refused():
    """dim 4096 in a single head (head_dim derived, 4096) ran past a minute; it is refused as a stated head_dim
    above 1024 is."""
    from tmac.models.family.llama import LlamaConfig

    for head_dim in (0, 4096):
        with pytest.raises(ValueError, match="head_dim=4096"):
            LlamaConfig(vocab_size=64, dim=4096, n_layers=1, n_heads=1, n_kv_heads=1, ffn_dim=64, head_dim=head_dim)
    assert LlamaConfig(vocab_size=64, dim=1024, n_layers=1, n_heads=1, n_kv_heads=1, ffn_dim=64).head_dim == 1024


# ---- resources ---------------------------------------------------------------------------------------------------

def test_the_batchs_kv_caches_are_budgeted_together(model, monkeypatch):
    """Where only two KV caches fit the memory left, at most two requests run; the rest wait (503 past the queue)
    instead of failing with a 500 when their cache cannot be made."""
    from tmac.base import memory
    from tmac.models.run import batching

    one = model.kv_bytes(model.context, model.kv_dtype)
    monkeypatch.setattr(memory, "available_bytes", lambda: int(2.5 * one / 0.8))
    with serving(model, max_batch=8, max_queue=8) as url:
        batcher_caches = call(url, "GET", "/health")[2]["kv_caches"]
        results = []

        def ask():
            results.append(call(url, "POST", "/v1/completions", {"prompt": "Once", "max_tokens": 8,
                                                                 "temperature": 0})[0])

        threads = [threading.Thread(target=ask) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert batcher_caches == 2 and results == [200] * 8
    monkeypatch.setattr(memory, "available_bytes", lambda: one // 2)
    with pytest.raises(ValueError, match="needs .* GiB, more than 80%"):
        batching.kv_caches_that_fit(model, 4)


def test_a_context_beyond_memory_is_said_in_words():
    r = tmac_cli("run", "-c", "10000000", "-p", "Hi", "-n", "2")
    assert r.returncode == 1 and "KV cache of 10000000 positions" in r.stderr and "unexpected" not in r.stderr


@pytest.mark.slow
def test_a_linker_that_fails_is_said_in_words(tmp_path):
    r = tmac_cli("run", "-p", "Hi", "-n", "2", env={"TMAC_CC": "/bin/false", "TMAC_CACHE_DIR": str(tmp_path)},
                 timeout=600)
    assert r.returncode == 1 and "TMAC_CC" in r.stderr and "unexpected" not in r.stderr, r.stderr[-800:]


def test_huge_inputs_give_finite_outputs_as_f_linear_does():
    torch.manual_seed(0)
    dense = torch.nn.Linear(576, 72)
    layer = tmac.Linear.from_float(dense, bits=4, group_size=32)
    for scale in (1.0, 1e30, 3e37):
        x = torch.randn(3, 576) * scale
        with torch.inference_mode():
            got = layer(x).double()
            want = torch.nn.functional.linear(x.double(), layer.dequantized_weight().double(), dense.bias.double())
        assert torch.isfinite(got).all() and float((got - want).norm() / want.norm()) < 0.02, scale


def test_a_compile_stopped_half_way_keeps_what_it_finished(tmp_path, monkeypatch, capsys):
    from tmac.execution import runtime

    real, built = runtime.build_into, []

    def stop_after_two(spec, isa, path):
        if len(built) == 2:
            raise KeyboardInterrupt
        built.append(spec.name)
        return real(spec, isa, path)

    monkeypatch.setattr(runtime, "build_into", stop_after_two)
    out = tmp_path / "kernels"
    assert cli.main(["compile", "-o", str(out)]) == 130
    listed = json.loads((out / "manifest.json").read_text())
    assert sorted(e["name"] for e in listed["kernels"]) == sorted(built)
    monkeypatch.setattr(runtime, "build_into", real)
    capsys.readouterr()
    assert cli.main(["compile", "-o", str(out)]) == 0
    assert "kept 2" in capsys.readouterr().out
