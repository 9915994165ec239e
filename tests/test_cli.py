import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest

from conftest import smollm2_path


def tmac(*args, **kw):
    return subprocess.run([sys.executable, "-m", "tmac.apps.cli", *args], capture_output=True, text=True, timeout=600, **kw)


def test_info_lists_what_matters():
    r = tmac("info")
    assert r.returncode == 0, r.stderr
    for field in ("architecture", "avx2", "avx512bw", "avx512vnni", "avxvnni", "neon", "dotprod", "kernel ISA",
                  "threads", "torch", "apache-tvm", "apache-tvm-ffi", "kernel cache", "huge pages", "THP ", "i-quants"):
        assert field in r.stdout
    # the grid i-quants held at their file's size: where the ISA's kernels expand grids, all of them
    from tmac.kernels import ISAS
    from tmac.quant.layout import GRID_TYPES

    facts = json.loads(tmac("info", "--json").stdout)
    expands = facts["kernel_isa"] is not None and ISAS[facts["kernel_isa"]].expands_grids
    assert facts["iquants_at_file_size"] == (sorted(GRID_TYPES) if expands else [])
    assert ("IQ1_M, IQ1_S, IQ2_S" in r.stdout) == expands


@pytest.mark.slow
def test_compile_errors_are_one_line():
    for args, needle in [(["compile", "--bits", "2", "--shape", "64x100", "-o", "/tmp/x"], "K=100"),
                         (["compile", "--bits", "2", "--shape", "64by100", "-o", "/tmp/x"], "MxK"),
                         (["compile", "--bits", "2", "--group-size", "48", "--shape", "8x96", "-o", "/tmp/x"],
                          "group_size"),
                         (["compile", "--arch", "arm64", "--isa", "avx2", "--bits", "2", "--shape", "8x64", "-o",
                           "/tmp/x"], "--isa avx2 is for x86_64"),
                         (["compile", "--bits", "2", "--model", "/no/such.gguf", "-o", "/tmp/x"], "no such model"),
                         (["compile", "--arch", "sparc"], "unknown architecture 'sparc'"),
                         (["compile", "--isa", "avx1024"], "unknown ISA 'avx1024'"),
                         (["compile", "--shape", "64x128", "-o", "/tmp/x"], "--shape needs --bits")]:
        r = tmac(*args)
        assert r.returncode == 1, args
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.slow
def test_compile_arm64_bits_2_as_typed_needs_no_compiler(tmp_path):
    """The command exactly as documented, on a PATH without any C compiler: the default model's kernels for
    `tmac run --bits 2` (projections, head, decode glue) in the default directory, as aarch64 shared objects."""
    bare = tmp_path / "bin"  # a PATH with no cc, gcc, clang or cross gcc
    bare.mkdir()
    r = subprocess.run([sys.executable, "-m", "tmac.apps.cli", "compile", "--arch", "arm64", "--bits", "2"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path, env=dict(os.environ, PATH=str(bare)))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "tmac-kernels-neon_dotprod"
    assert str(out) in r.stdout and "zig cc" in r.stderr
    manifest = json.load(open(out / "manifest.json"))
    assert (manifest["arch"], manifest["isa"]) == ("arm64", "neon_dotprod")
    specs = [e["spec"] for e in manifest["kernels"]]
    # SmolLM2 at 2 bits: K = 576 (q|k|v, gate|up) and 1536 (down), the head its own Q8_0, glue for both caches
    assert sorted({(s["bits"], s["k"]) for s in specs if "bits" in s}) == [(2, 576), (2, 1536), (8, 576)]
    # each KV dtype's glue, for the GGUF's table and for its packed copy's
    assert sorted(s["kv_dtype"] for s in specs if "bits" not in s) == ["float16", "float16", "float32", "float32"]
    for entry in manifest["kernels"]:
        lib = (out / entry["file"]).read_bytes()
        assert lib[:4] == b"\x7fELF" and int.from_bytes(lib[18:20], "little") == 183  # EM_AARCH64
        assert len(lib) == entry["bytes"]


def test_compile_spellings_of_arch_and_isa():
    from tmac.kernels import target_isa as resolve_isa
    from tmac.base.cpu import normalize_arch

    assert normalize_arch("aarch64") == normalize_arch("arm64") == "arm64"
    assert normalize_arch("x86-64") == normalize_arch("x86_64") == normalize_arch("AMD64") == "x86_64"
    assert resolve_isa("aarch64", None).name == "neon_dotprod" and resolve_isa("x86-64", "avx2").name == "avx2"
    assert resolve_isa("arm64", None).name == "neon_dotprod"
    assert resolve_isa(None, "avx512-vbmi").name == resolve_isa(None, "avx512_vbmi").name == "avx512_vbmi"
    assert resolve_isa("arm64", "generic").name == "generic_arm64"
    assert resolve_isa(None, "neon").arch == "arm64"  # the ISA says which arch


@pytest.mark.slow
def test_run_default_model_json():
    r = tmac("run", "--prompt", "What is 2+2?", "-n", "6", "--json", "--threads", "1")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for key in ("text", "prompt_ids", "generated_ids", "prompt_tokens_per_s", "gen_tokens_per_s", "load_s",
                "peak_rss_mib"):
        assert key in out
    assert 1 <= len(out["generated_ids"]) <= 6 and out["prompt_tokens_per_s"] > 0 and out["peak_rss_mib"] > 0
    assert out["prompt_ids"][:2] == [1, 9690]  # <|im_start|>system: the chat template was applied
    raw = tmac("run", "--prompt", "What is 2+2?", "-n", "2", "--json", "--no-chat")
    raw_ids = json.loads(raw.stdout)["prompt_ids"]
    assert 1 not in raw_ids and len(raw_ids) < 10  # no template, no BOS (SmolLM2's metadata adds none)


@pytest.mark.slow
def test_run_streams_text_and_prints_stats():
    r = tmac("run", "--prompt", "Name a color.", "-n", "8")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "tok/s" in r.stderr and "peak RSS" in r.stderr


@pytest.mark.slow
def test_chat_two_turns_through_stdin():
    r = tmac("chat", "-n", "8", input="Hello!\nAnd again?\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "> " not in r.stdout and r.stderr.count("peak RSS") == 2  # piped: the answers alone on stdout


@pytest.mark.slow
def test_chat_drops_the_oldest_exchanges_when_the_context_fills():
    turns = ["Name a color.", "Name a fruit.", "Name an animal.", "Name a city."]
    r = tmac("chat", "--context", "100", "-n", "30", "--ignore-eos", input="\n".join(turns) + "\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("peak RSS") == len(turns)  # every turn answered, none ended the session
    assert "context full: dropped the" in r.stderr and "error" not in r.stderr


@pytest.mark.slow
def test_run_errors_are_one_line(tmp_path):
    not_gguf = tmp_path / "model.bin"
    not_gguf.write_bytes(b"\x00" * 64)
    cases = [(["run", "/no/such/model.gguf", "-p", "x"], "no such model"),
             (["run", str(not_gguf), "-p", "x"], "not a model"),
             (["run", "-p", "x", "--group-size", "64"], "--group-size needs --bits"),
             (["run", "-p", "x " * 5000, "--context", "512"], "exceed the context of 512")]
    for args, needle in cases:
        r = tmac(*args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 1 and needle in lines[-1] and "Traceback" not in r.stderr, (args, r.stderr)


@pytest.mark.slow
def test_convert_then_run_gives_the_same_greedy_ids(tmp_path):
    from safetensors import safe_open

    runs = [json.loads(tmac("run", smollm2_path(), "-p", "Name three colors.", "-n", "12", "--json", "--temp",
                            "0").stdout)]
    # by default the tied Q8_0 table is stored as a table (it stays in the mapped file); --shared-table stores it
    # once, as the head's weights (28.7 MiB less), rebuilt on load
    for flags, table_stored in (([], True), (["--shared-table"], False)):
        out = tmp_path / f"smollm2{len(flags)}.tmac"
        fresh = dict(os.environ, TMAC_CACHE_DIR=str(tmp_path / f"cache{len(flags)}"))  # convert compiles what runs
        r = tmac("convert", smollm2_path(), "-o", str(out), *flags, env=fresh)
        assert r.returncode == 0, r.stderr
        assert "quantized layers" in r.stdout and "q4_1" in r.stdout
        with safe_open(str(out), framework="pt") as f:
            keys = set(f.keys())
            head = sum(f.get_tensor(k).nbytes for k in keys if k.startswith("output."))
        assert bool([k for k in keys if k.startswith("tok_embeddings.")]) == table_stored and "output.qweight" in keys
        assert ("token table 0.0 (the head's, shared)" in r.stdout) != table_stored
        # never larger than the GGUF it came from, but for the head, which is the GGUF's table a second time
        assert out.stat().st_size <= os.path.getsize(smollm2_path()) + table_stored * head
        r = tmac("run", str(out), "-p", "Name three colors.", "-n", "12", "--json", "--temp", "0", env=fresh)
        assert "compiling" not in r.stderr, r.stderr
        run = json.loads(r.stdout)
        assert run["generated_ids"] == runs[0]["generated_ids"]
        assert run["prompt_ids"] == runs[0]["prompt_ids"]  # tokenizer and chat template travel in the file
    r = tmac("run", str(out), "-p", "x", "--bits", "2")
    assert r.returncode == 1 and "already converted" in r.stderr


@pytest.mark.slow
def test_ctrl_c_in_run_keeps_the_partial_output():
    proc = subprocess.Popen([sys.executable, "-m", "tmac.apps.cli", "run", "-p", "Write a long story about a dragon.",
                             "-n", "1500", "--context", "2048"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    first = ""
    deadline = time.time() + 300
    while len(first) < 40 and time.time() < deadline:  # wait until generation streams
        if select.select([proc.stdout], [], [], 1.0)[0]:
            first += os.read(proc.stdout.fileno(), 4096).decode()
    assert len(first) >= 40, "no tokens streamed"
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "generated:" in err  # the stats line of what was generated
    generated = int(err.split("generated: ")[1].split()[0])
    assert 0 < generated < 1500
    assert len(first + rest) >= 40 and "interrupted" not in err.splitlines()[-1]


@pytest.mark.slow
def test_bench_kernels_table_json_and_plot(tmp_path):
    png = tmp_path / "kernels.png"
    r = tmac("bench", "--shape", "256x512", "--bits", "2,4,6", "--threads", "1", "--json", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    got = {row["candidate"]: row for row in out["rows"]}
    assert {"torch fp32", "torch bf16", "torch int4wo", "tmac W2", "tmac W4", "tmac W6"} <= set(got)
    assert all(row["value"] > 0 and row["extra"]["GB/s"] > 0 and row["what"] == "256x512" for row in got.values())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    r = tmac("bench", "--shape", "256x512", "--bits", "2", "--threads", "1")
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and "vs torch fp32" in lines[0] and any("tmac W2" in line for line in lines[2:])
    r = tmac("bench", "--shape", "256x512", "--bits", "1,2", "--threads", "1", "--cold", "--json")
    assert r.returncode == 0, r.stderr
    got = {row["candidate"]: row for row in json.loads(r.stdout)["rows"]}
    assert {"torch fp32", "torch int4wo", "tmac W1", "tmac W2"} <= set(got)
    assert all(0 < got[c]["extra"]["% probe"] < 1000 for c in ("tmac W1", "tmac W2"))  # timed beside the probe
    assert "% probe" not in got["torch fp32"]["extra"] and got["torch fp32"]["value"] > 0


@pytest.mark.slow
def test_bench_end_to_end_on_the_default_model():
    r = tmac("bench", "--e2e", "--profile", "--bits", "2,own", "--head-bits", "float", "--threads", "1",
             "--prompt-tokens", "8", "--gen-tokens", "8", "--no-peer", "--json")
    assert r.returncode == 0, r.stderr
    own, row = sorted(json.loads(r.stdout)["rows"], key=lambda row: row["candidate"] != "tmac file's own")
    assert own["candidate"] == "tmac file's own" and own["value"] > 0  # the Q4_1 file as imported
    profiles = {p["phase"]: p for p in json.loads(r.stdout)["profiles"] if p["candidate"] == row["candidate"]}
    from tmac.execution.runtime import ON_POOL

    spent = profiles["decode"]["seconds"]  # every kind of call of the static decode step, the float head included
    assert {"lut_gemv (tables included)" + ON_POOL, "attend", "norm_in", "gated_act",
            "float projection (torch.mm)"} <= set(spent)  # (attention over 16 positions: serial)
    assert all(v > 0 for v in spent.values())
    parts = profiles["prefill"]["seconds"]  # the prompt's prefill plan (8 rows: the glue row by row)
    assert {"build_tables", "lut_gemm" + ON_POOL, "attend", "norm_in", "gated_act", "norm_final",
            "float projection (torch.mm)", "step"} <= set(parts)
    assert 0 < sum(v for k, v in parts.items() if k != "step") < parts["step"]
    assert row["candidate"] == "tmac W2, float head" and row["threads"] == 1 and row["value"] > 0
    assert row["extra"]["prefill tok/s"] > 0 and 20 < row["extra"]["model MiB"] < 400
    # measured in a process of its own: the model plus torch and the kernels, far below this test process's own
    assert row["extra"]["model MiB"] < row["extra"]["peak RSS MiB"] < 1500
    # bytes per token: 30 layers of 3.54 M weights at 2 bits + float16 scale and zero per 64 (33.2 MB; float32
    # parameters would make it 39.8), the fp32 head 49152 × 576 (113.2 MB); the embedding is not streamed
    assert 0.143 < row["extra"]["GB/s"] / row["value"] < 0.150
    # against the read probe timed before each generation
    extra = row["extra"]
    assert extra["probe GB/s"] > 1 and extra["% DRAM"] == pytest.approx(100 * extra["GB/s"] / extra["probe GB/s"])
    # the probe's bound: its bandwidth over the bytes a token reads
    assert extra["ceiling tok/s"] == pytest.approx(extra["probe GB/s"] / (extra["GB/s"] / row["value"]))


@pytest.mark.slow
def test_bench_errors_are_one_line():
    for args, needle in [(["bench", "--threads", "0"], "--threads"), (["bench", "--shape", "8x64", "--bits", "7"],
                                                                       "--bits"),
                         (["bench", "--shape", "8x64", "--bits", "own"], "--bits"), (["bench", "--bits", "2,x"], "--bits"),
                         (["bench", "m.gguf", "--shape", "8x64"], "not both"),
                         (["bench", "--e2e", "--shape", "8x64"], "not both"),
                         (["bench", "--cold"], "give --shape"),
                         (["bench", "--profile", "--shape", "8x64"], "not both"),
                         (["bench", "--gen-tokens", "2"], "--gen-tokens"), (["bench", "--rounds", "0"], "--rounds"),
                         (["bench", "--shape", "128x100"], "K=100 must be a multiple of 32")]:
        r = tmac(*args)
        assert r.returncode == 1 and needle in r.stderr.strip().splitlines()[-1] and "Traceback" not in r.stderr, args


@pytest.mark.slow
def test_bench_shows_a_shape_a_peer_cannot_run_as_a_dash():
    """torch's int4 kernel needs out features in multiples of 16: 100x128 is timed for the others, and its row is a
    dash with a note, not the end of the benchmark."""
    r = tmac("bench", "--shape", "100x128", "--bits", "2", "--threads", "1")
    assert r.returncode == 0, r.stderr
    rows = {" ".join(line.split()[1:3]): line for line in r.stdout.splitlines() if line.startswith("100x128")}
    assert "—" in rows["torch int4wo"] and "—" not in rows["tmac W2"] and "—" not in rows["torch fp32"]
    assert "note: torch int4wo cannot run 100x128" in r.stdout


@pytest.mark.slow
def test_compile_for_a_model_gives_every_kernel_it_runs(tmp_path):
    """`tmac compile --model` without --bits compiles the kernels of the file's exact formats (SmolLM2: Q4_1
    layers, with float16 zeros and, for the two tensors whose zeros are not all float16 values, float32 ones, and
    a Q8_0 head) and the decode glue for both KV cache dtypes; running from that directory with an empty cache then
    compiles nothing, with either cache."""
    r = tmac("compile", "--model", smollm2_path(), "-o", str(tmp_path / "k"))
    assert r.returncode == 0, r.stderr
    specs = [e["spec"] for e in json.load(open(tmp_path / "k" / "manifest.json"))["kernels"]]
    # (a format may take two tilings: blocks halve their rows where that divides a matrix, docs/decisions.md)
    assert sorted({(s["bits"], s["k"], s["has_zeros"], s["zero_dtype"]) for s in specs if "bits" in s}) == [
        (4, 576, True, "float16"), (4, 576, True, "float32"), (4, 1536, True, "float16"), (4, 1536, True, "float32"),
        (8, 576, False, "float32")]
    glue = [s for s in specs if "bits" not in s]  # and the decode glue of its shape, for each KV dtype and for the
    # table as the GGUF holds it (its blocks) and as its packed copy holds it
    assert sorted((s["dim"], s["n_heads"], s["n_kv_heads"], s["ffn_dim"], s["kv_dtype"]) for s in glue) == [
        (576, 9, 3, 1536, "float16")] * 2 + [(576, 9, 3, 1536, "float32")] * 2
    assert len({json.dumps(s, sort_keys=True) for s in glue}) == 4
    env = dict(os.environ, TMAC_KERNEL_DIR=str(tmp_path / "k"), TMAC_CACHE_DIR=str(tmp_path / "empty-cache"))
    for kv in ("float16", "float32"):
        r = tmac("run", "-p", "Hi", "-n", "4", "--json", "--kv-dtype", kv, env=env)
        assert r.returncode == 0 and "compiling" not in r.stderr, r.stderr
        assert len(json.loads(r.stdout)["generated_ids"]) > 0
    for mapped in (False, True):  # with the packed copy: written behind the run, then mapped
        r = tmac("run", "-p", "Hi", "-n", "4", "--json", env={**env, "TMAC_MODEL_CACHE": "1"})
        assert r.returncode == 0 and "compiling" not in r.stderr, r.stderr
        out = json.loads(r.stdout)
        assert (out["packed_copy"], out["packing_copy"]) == (mapped, not mapped)
    # requantized: every projection at 2 bits, the head still the file's own (Q8_0)
    r = tmac("compile", "--model", smollm2_path(), "--bits", "2", "-o", str(tmp_path / "k2"))
    assert r.returncode == 0, r.stderr
    specs = [e["spec"] for e in json.load(open(tmp_path / "k2" / "manifest.json"))["kernels"]]
    assert sorted({(s["bits"], s["k"]) for s in specs if "bits" in s}) == [(2, 576), (2, 1536), (8, 576)]
    r = tmac("run", "--bits", "2", "-p", "Hi", "-n", "4", "--json", env=dict(env, TMAC_KERNEL_DIR=str(tmp_path / "k2")))
    assert r.returncode == 0 and "compiling" not in r.stderr, r.stderr


@pytest.mark.slow
def test_compile_for_a_ternary_model_covers_rows_sharing_a_scale(tmp_path):
    """A TQ2_0 file of a converted BitNet model (one scale repeated in every block) loads per row, as ternary
    triples where the CPU has 64-entry lookups (2-bit planes elsewhere: ``uses_triples``): `tmac compile --model`
    builds the kernels the loaded model runs, so running from its directory compiles nothing."""
    from tmac.kernels import best_isa
    from tmac.models.family.llama import LlamaConfig
    from tmac.models.files.synthetic import write_random_gguf

    cfg = LlamaConfig(dim=768, n_layers=1, n_heads=12, n_kv_heads=4, vocab_size=300, ffn_dim=1536,
                      context_length=64)
    model = str(tmp_path / "t.gguf")
    write_random_gguf(model, cfg, lambda name: "Q8_0" if name.startswith("token_embd") else "TQ2_0")
    r = tmac("compile", "--model", model, "-o", str(tmp_path / "k"))
    assert r.returncode == 0, r.stderr
    specs = [e["spec"] for e in json.load(open(tmp_path / "k" / "manifest.json"))["kernels"]]
    triples = best_isa().wide_lookup
    assert {(s["k"], s["group_size"], s["triples"]) for s in specs if "bits" in s and s["bits"] == 2} == {
        (768, 768, triples), (1536, 1536, triples)}  # one scale a row: every layer loads per row
    env = dict(os.environ, TMAC_KERNEL_DIR=str(tmp_path / "k"), TMAC_CACHE_DIR=str(tmp_path / "empty-cache"))
    r = tmac("run", model, "-p", "hello", "-n", "4", "--json", env=env)
    assert r.returncode == 0 and "compiling" not in r.stderr, r.stderr
    assert len(json.loads(r.stdout)["generated_ids"]) > 0


def test_unexpected_errors_name_their_type():
    from tmac.apps.cli import describe
    from tmac.base.errors import ModelFormatError

    assert describe(KeyError(6)).startswith("KeyError: 6 (unexpected")
    assert describe(ModelFormatError("m.gguf: bad field")) == "m.gguf: bad field"
    assert describe(FileNotFoundError("no such model file or directory: x")) == "no such model file or directory: x"


def test_info_json_and_debug_everywhere():
    r = tmac("info", "--json", "--debug")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    from tmac.kernels import best_isa

    assert info["kernel_isa"] == best_isa().name and info["architecture"] in ("x86_64", "arm64")
    assert tmac("compile", "--debug", "--shape", "64x128", "--bits", "9").returncode == 2  # parsed, then refused


@pytest.mark.slow
def test_convert_checks_the_output_path_first(tmp_path):
    r = tmac("convert", smollm2_path(), "-o", "/nonexistent/dir/x.tmac")
    assert r.returncode == 1 and "/nonexistent/dir" in r.stderr and "does not exist" in r.stderr
    assert "loading" not in r.stderr  # refused before converting anything
    for args, said in ((["--arch", "x86_64", "--isa", "neon"], "--isa neon is for arm64, not --arch x86_64"),
                       (["--isa", "sse9"], "unknown ISA 'sse9'"), (["--arch", "riscv"], "riscv")):
        r = tmac("convert", smollm2_path(), "-o", str(tmp_path / "x.tmac"), *args)
        assert r.returncode == 1 and said in r.stderr and "loading" not in r.stderr, r.stderr


@pytest.mark.slow
def test_run_ignore_eos_generates_every_token():
    r = tmac("run", "-p", "Say hi.", "-n", "40", "--ignore-eos", "--json", "--threads", "1")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["generated_ids"]) == 40 and out["stop_reason"] == "length"
    help_text = tmac("run", "--help").stdout
    assert "1, 2, 3, 4, 5, 6, 8 bits" in " ".join(help_text.split())


@pytest.mark.slow
def test_run_compiles_its_kernels_without_a_system_compiler(tmp_path):
    """A first run on a machine with no C compiler on PATH links its kernels with zig cc (the ziglang wheel)."""
    env = dict(os.environ, PATH=str(tmp_path), TMAC_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TMAC_CC", None)
    r = tmac("run", "-p", "Hi", "-n", "2", "--json", env=env)
    assert r.returncode == 0, r.stderr
    assert "ahead, while loading" in r.stderr and len(json.loads(r.stdout)["generated_ids"]) == 2


@pytest.mark.slow
def test_a_first_run_compiles_its_kernels_ahead_in_a_child_process(tmp_path):
    """With an empty kernel cache, `tmac run` names each kernel as the load meets it and a child process compiles
    them while the load goes on: each once, none in the run's own process (it never imports the compiler), the
    same set `tmac compile --model` builds; a second run compiles nothing and says the same."""
    import re

    env = dict(os.environ, TMAC_CACHE_DIR=str(tmp_path / "cache"))
    first = tmac("run", "-p", "Hi", "-n", "4", "--json", "--temperature", "0", env=env)
    assert first.returncode == 0, first.stderr
    ahead = re.findall(r"compiled kernel (\S+) ahead, while loading", first.stderr)
    assert ahead and len(set(ahead)) == len(ahead) and "compiling kernel" not in first.stderr, first.stderr
    listed = tmac("compile", "-o", str(tmp_path / "kernels"), env=env)
    assert listed.returncode == 0, listed.stderr
    assert set(ahead) <= {f[:-3] for f in os.listdir(tmp_path / "kernels") if f.endswith(".so")}
    second = tmac("run", "-p", "Hi", "-n", "4", "--json", "--temperature", "0", env=env)
    assert second.returncode == 0 and "compil" not in second.stderr, second.stderr
    assert json.loads(second.stdout)["generated_ids"] == json.loads(first.stdout)["generated_ids"]


@pytest.mark.slow
def test_compile_takes_every_source_load_model_takes(tmp_path):
    """--model reads a Hugging Face directory and a .tmac file as `tmac run` would: their kernels, then running from
    the directory compiles nothing."""
    import torch
    import transformers

    hf_dir = tmp_path / "hf"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64)).save_pretrained(hf_dir)
    r = tmac("compile", "--model", str(hf_dir), "--bits", "2", "-o", str(tmp_path / "k-hf"))
    assert r.returncode == 0, r.stderr
    specs = [e["spec"] for e in json.load(open(tmp_path / "k-hf" / "manifest.json"))["kernels"]]
    assert sorted((s["bits"], s["k"]) for s in specs if "bits" in s) == [(2, 128), (2, 256), (8, 128)]
    converted = tmp_path / "m.tmac"
    assert tmac("convert", smollm2_path(), "--bits", "3", "-o", str(converted)).returncode == 0
    r = tmac("compile", "--model", str(converted), "-o", str(tmp_path / "k-tmac"))
    assert r.returncode == 0, r.stderr
    env = dict(os.environ, TMAC_KERNEL_DIR=str(tmp_path / "k-tmac"), TMAC_CACHE_DIR=str(tmp_path / "empty-cache"))
    r = tmac("run", str(converted), "-p", "Hi", "-n", "3", "--json", env=env)
    assert r.returncode == 0 and "compiling" not in r.stderr, r.stderr


@pytest.mark.slow
def test_context_beyond_the_model_warns_and_beyond_memory_is_refused():
    r = tmac("run", "-p", "Hi", "-n", "2", "--context", "9000", "--json")  # SmolLM2 was trained on 8192
    assert r.returncode == 0, r.stderr
    assert "longer than the 8192 positions the model was trained for" in r.stderr
    r = tmac("run", "-p", "Hi", "-n", "2", "--context", "100000000")
    assert r.returncode == 1 and "GiB of memory available" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("after", [0.3, 2.0])  # (earlier, Python itself is still starting)
def test_ctrl_c_during_start_up_is_one_line(after):
    """Whether Ctrl-C comes while the command imports, loads or compiles: "interrupted" and exit 130 (a warm start
    can be over in two seconds: then it comes while the long answer is generated, which ends with its stats line)."""
    tmac_command = os.path.join(os.path.dirname(sys.executable), "tmac")
    proc = subprocess.Popen([tmac_command, "run", "-p", "Hi", "-n", "4000", "--ignore-eos"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    time.sleep(after)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert last == "interrupted" or (after > 1 and last.startswith("prompt: ") and "generated: " in last), err


def test_debug_shows_the_error_a_message_was_made_from(tmp_path):
    """A clear one-line error for a person; with --debug the traceback, including the exception tmac's message
    replaced (``raise … from None``): here the JSON decoder's, behind "config.json: malformed"."""
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64,')
    (tmp_path / "model.safetensors").write_bytes(b"")
    plain = subprocess.run([sys.executable, "-m", "tmac", "run", str(tmp_path), "-p", "hi"], capture_output=True,
                           text=True, timeout=300)
    assert plain.returncode == 1 and "Traceback" not in plain.stderr and "config.json" in plain.stderr, plain.stderr
    debug = subprocess.run([sys.executable, "-m", "tmac", "--debug", "run", str(tmp_path), "-p", "hi"],
                           capture_output=True, text=True, timeout=300)
    assert debug.returncode != 0 and "JSONDecodeError" in debug.stderr and "config.json" in debug.stderr, debug.stderr


@pytest.mark.unit
@pytest.mark.parametrize("args, said", [
    (["serve", "--port", "0"], "--port must be in 1..65535"),
    (["serve", "--api-key", " key"], "spaces at its ends"),
    (["serve", "-c", "0"], "--context must be a positive number"),
    (["serve", "--max-body", "10"], "--max-body must be at least"),
    (["run", "--threads", "0", "-p", "hi"], "--threads must be >= 1"),
    (["run", "--temperature", "-1", "-p", "hi"], "temperature must be"),
    (["run", "/no/such/model.gguf", "-p", "hi"], "no such model file or directory"),
])
def test_a_wrong_option_or_path_is_said_before_torch_or_fastapi_is_imported(args, said):
    code = ("import sys; from tmac.apps.cli import main; rc = main(sys.argv[1:]); "
            "print(rc, [m for m in ('torch', 'fastapi', 'uvicorn', 'tvm') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
    assert said in r.stderr and r.stdout.split(" ", 1)[1].strip() == "[]", (r.stdout, r.stderr)
    assert r.stdout.split(" ", 1)[0] != "0"


GC_STATES = r"""
import gc, json, sys
import tmac.apps.process as process

states = []
real = process.freeze_imports


def freeze_imports():
    states.append([gc.isenabled(), "torch" in sys.modules])
    real()
    states.append([gc.isenabled(), gc.get_freeze_count() > 0])


process.freeze_imports = freeze_imports
sys.argv = ["tmac", *sys.argv[1:]]
from tmac.apps.console import main

code = main()
print(json.dumps({"code": code, "states": states, "enabled": gc.isenabled()}))
"""


@pytest.mark.parametrize("command", ["run", "info"])
def test_the_command_line_collects_garbage_once_its_imports_are_done(command):
    """Garbage collection is off while the command line imports (each full collection walks torch's objects and
    frees next to nothing), then on for the rest of the process, the imports' objects frozen out of its reach."""
    args = ["run", smollm2_path(), "-p", "Hi", "-n", "2", "--temperature", "0"] if command == "run" else ["info"]
    r = subprocess.run([sys.executable, "-c", GC_STATES, *args], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["code"] == 0 and seen["enabled"] is True
    before, after = seen["states"]  # once
    assert before[0] is False and after == [True, True]
    if command == "run":  # off until torch and the model's modules are imported, on before the model loads
        assert before[1] is True
