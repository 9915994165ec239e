"""What a new user meets first: the CLI's version, help and info, the README's examples, the messages that say
what to do next — each checked against the thing it describes."""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import tmac
from conftest import smollm2_path
from tmac.apps import cli
from tmac.kernels import best_isa, isa_by_name

README = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"tmac {tmac.__version__}"


def test_info_json_has_one_key_per_fact_and_null_for_what_is_unset(capsys, monkeypatch):
    monkeypatch.delenv("TMAC_KERNEL_DIR", raising=False)
    monkeypatch.delenv("TMAC_ISA", raising=False)
    assert cli.main(["info", "--json"]) == 0
    pairs = json.loads(capsys.readouterr().out, object_pairs_hook=lambda kv: kv)
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)) and all(k == k.lower() and " " not in k and "-" not in k for k in keys)
    info = dict(pairs)
    assert info["kernel_dir"] is None and info["kernel_isa"] == best_isa().name and info["kernel_isa_from"] == "cpu"
    assert isinstance(info["simd_features"], list) and isinstance(info["threads"], int)


def test_tmac_isa_picks_the_kernels_or_says_what_this_cpu_runs(monkeypatch):
    runnable = [i for i in tmac.kernels.isas_for(best_isa().arch) if i.features <= tmac.base.cpu.cpu_features()]
    for isa in runnable:
        monkeypatch.setenv("TMAC_ISA", isa.name.replace("_", "-").upper())
        assert best_isa() is isa
    other = "neon" if best_isa().arch == "x86_64" else "avx2"
    monkeypatch.setenv("TMAC_ISA", other)
    with pytest.raises(ValueError, match=f"TMAC_ISA='{other}': this CPU cannot execute {other} .* it can run: "):
        best_isa()
    monkeypatch.setenv("TMAC_ISA", "sse9")
    with pytest.raises(ValueError, match="TMAC_ISA='sse9': unknown ISA"):
        best_isa()


@pytest.mark.parametrize("command", ["run", "chat"])
def test_run_and_chat_help_name_every_model_source_and_the_defaults(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    from tmac.models.run.sampling import OPTIONS

    for phrase in ("GGUF file", "Hugging Face directory", ".tmac file", "ORG/NAME", "(default: float16)",
                   "0: greedy", "(default: 0.8)", "(default: 40)", "(default: 0.95)", "(default: 0.05)",
                   "-n N, --max-tokens N", "--repetition-penalty", "-m MODEL", "-c CONTEXT"):
        assert phrase in text
    for name, f in OPTIONS.items():  # every option, by its own name
        assert f"--{name.replace('_', '-')}" in text or not f.metadata["cli"]


def test_tune_chooses_a_group_size_that_divides_each_k():
    args = cli.build_parser().parse_args(["tune", "--k", "576,4096", "--bits", "4"])
    work = cli.tune_work(args)
    assert [(fmt.group_size, k) for fmt, k in work] == [(64, 576), (128, 4096)]
    with pytest.raises(ValueError, match="no group size divides it"):
        cli.tune_work(cli.build_parser().parse_args(["tune", "--k", "200", "--bits", "4"]))


def test_compile_says_how_to_run_what_it_compiled_with_the_same_options():
    args = argparse.Namespace(model=None, bits=2, group_size=None, head_bits=None, shape=None)
    line = cli._compile_next_step(args, isa_by_name("neon_dotprod"), "tmac-kernels-neon_dotprod")
    assert "scp -r tmac-kernels-neon_dotprod" in line
    assert "TMAC_KERNEL_DIR=~/tmac-kernels-neon_dotprod tmac run --bits 2 -p" in line
    args.bits, args.model, args.model_name = None, "/cache/x.gguf", "acme/x"
    assert "tmac run acme/x -p" in cli._compile_next_step(args, isa_by_name("neon_dotprod"), "k")


def test_a_kernel_directory_of_another_architecture_is_one_warning_line(tmp_path, monkeypatch, capsys):
    from tmac.quant import cache

    cache.write_manifest(str(tmp_path), isa_by_name("neon" if best_isa().arch == "x86_64" else "avx2"), [])
    monkeypatch.setenv("TMAC_KERNEL_DIR", str(tmp_path))
    assert cli.main(["run", smollm2_path(), "-p", "Hi", "-n", "2", "--no-chat"]) == 0
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if "warning" in line.lower()]
    assert len(warning) == 1 and warning[0].startswith(f"tmac: warning: kernel directory {tmp_path} holds kernels")
    assert "UserWarning" not in err and "warnings.warn" not in err


def test_the_peer_build_flags_follow_the_cpu_as_docs_llama_cpp_says():
    from tmac.apps.bench import peer_cmake_args

    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "llama-cpp.md")).read()
    avx2_example = set(re.search(r'CMAKE_ARGS="([^"]+)"', doc).group(1).replace("\\\n", " ").split())
    assert set(peer_cmake_args(frozenset({"avx2"})).split()) == avx2_example  # the document's AVX2-only line
    ice_lake = peer_cmake_args(frozenset({"avx2", "avx512bw", "avx512vbmi", "avx512vnni", "avx512bf16"}))
    assert "-DGGML_AVX512_VBMI=ON" in ice_lake and "-DGGML_AVX_VNNI=OFF" in ice_lake and "AMX_INT8=OFF" in ice_lake
    no_vbmi = peer_cmake_args(frozenset({"avx2", "avx512bw", "avx512vnni"}))
    assert "-DGGML_AVX512_VBMI=OFF" in no_vbmi and "-DGGML_AVX512_VNNI=ON" in no_vbmi
    assert "-DGGML_AVX_VNNI=ON" in peer_cmake_args(frozenset({"avx2", "avxvnni"}))


def test_a_transformers_5_directory_keeps_its_chat_template_in_chat_template_jinja(tmp_path):
    import transformers

    backend = tmac.load_model(smollm2_path(), context=16).tokenizer.backend
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").exists()
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    from tmac.models.text.tokenizer import Tokenizer

    ours = Tokenizer.from_hf_dir(str(tmp_path))
    messages = [{"role": "user", "content": "Hi there"}]
    assert ours.render_chat(messages) == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _readme_block(after: str) -> list[str]:
    block = README[README.index(after):]
    block = block[block.index("```sh") + 5:]
    return [line.split("#")[0].strip() for line in block[:block.index("```")].strip().splitlines()]


@pytest.mark.slow
def test_the_readme_raspberry_pi_example_runs_the_default_model_packed_and_compiled_ahead(tmp_path):
    """The README's Pi example, on this machine's architecture: the file `tmac convert --arch` packs and the kernels
    `tmac compile --model` writes for it are all that `tmac run` needs (nothing repacks, nothing compiles), and it
    generates what the default model generates."""
    convert_line, compile_line, _, run_line = _readme_block("**Raspberry Pi, arm64 Linux.**")
    assert convert_line.startswith("tmac convert x.gguf --arch arm64 -o x.tmac")
    assert compile_line == "tmac compile --isa neon_dotprod --model x.tmac"
    shutil.copy(smollm2_path(), tmp_path / "x.gguf")
    isa = best_isa().name
    env = dict(os.environ, TMAC_CACHE_DIR=str(tmp_path / "empty-cache"))
    for line in (convert_line.replace("arm64", best_isa().arch), compile_line.replace("neon_dotprod", isa)):
        r = subprocess.run([sys.executable, "-m", "tmac.apps.cli", *line.split()[1:]], capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=600)
        assert r.returncode == 0, r.stderr
    variable, command = run_line.split(" ", 1)
    assert variable == "TMAC_KERNEL_DIR=~/tmac-kernels-neon_dotprod"
    run = command.split()[2:]  # after "tmac run"
    r = subprocess.run([sys.executable, "-m", "tmac.apps.cli", "run", *[a.strip('"') for a in run], "-n", "16",
                        "--json", "--temperature", "0"], capture_output=True, text=True, cwd=tmp_path,
                       env=dict(env, TMAC_KERNEL_DIR=str(tmp_path / f"tmac-kernels-{isa}")), timeout=600)
    assert r.returncode == 0 and "compiling" not in r.stderr and "packed for" not in r.stderr, r.stderr
    model = tmac.load_model(smollm2_path(), progress=False)
    got = json.loads(r.stdout)
    assert got["generated_ids"] == tmac.Session(model).generate(got["prompt_ids"], max_new_tokens=16, temperature=0)
