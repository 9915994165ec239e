"""The command line habits llama.cpp and ollama users bring: a prompt piped in or read from a file, ``-m`` and
``-c``, a mistyped flag answered with the nearest one, chat's ``/help``, ``/bye`` and ``/quit`` (unknown commands
refused, not sent to the model), a piped chat's output the answers alone, a reader that leaves early (``| head``),
one line saying which precision runs, output files with the user's umask, progress as lines in a log."""
import io
import json
import os
import subprocess
import sys

import pytest

from conftest import smollm2_path
from tmac.apps import cli


def tmac(*args, **kw):
    return subprocess.run([sys.executable, "-m", "tmac.apps.cli", *args], capture_output=True, text=True, timeout=600, **kw)


def run_json(capsys, monkeypatch, *args, stdin=None) -> dict:
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    assert cli.main(["run", *args, "-n", "6", "--json", "--temperature", "0", "-c", "256"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_prompt_comes_from_p_a_file_or_standard_input(capsys, monkeypatch, tmp_path):
    question = "What is the capital of France?"
    given = run_json(capsys, monkeypatch, "-p", question)
    (tmp_path / "q.txt").write_text(question)
    for args, stdin in (((["-f", str(tmp_path / "q.txt")]), None), ([], question), (["-p", "-"], question),
                        (["-f", "-"], question)):
        got = run_json(capsys, monkeypatch, *args, stdin=stdin)
        assert got["prompt_ids"] == given["prompt_ids"] and got["generated_ids"] == given["generated_ids"], args
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert cli.main(["run", "-n", "2"]) == 1
    assert "the prompt is empty" in capsys.readouterr().err
    assert cli.main(["run", "-p", "x", "-f", str(tmp_path / "q.txt")]) == 1
    assert "not both" in capsys.readouterr().err


def test_m_names_the_model_and_c_the_context(capsys, monkeypatch):
    by_flag = run_json(capsys, monkeypatch, "-m", smollm2_path(), "-p", "Hi")
    by_position = run_json(capsys, monkeypatch, smollm2_path(), "-p", "Hi")
    assert by_flag["generated_ids"] == by_position["generated_ids"]
    with pytest.raises(SystemExit):
        cli.main(["run", "a.gguf", "-m", "b.gguf", "-p", "Hi"])
    assert "two models given" in capsys.readouterr().err
    assert cli.main(["run", "-p", "x " * 400, "-c", "64", "-n", "2"]) == 1
    assert "context of 64 tokens" in capsys.readouterr().err
    for command in (["perplexity", "-c", "64", "--help"], ["compile", "-m", "x.gguf", "--help"],
                    ["tune", "-m", "x.gguf", "--help"], ["serve", "-c", "64", "--help"]):
        with pytest.raises(SystemExit) as exit:
            cli.main(command)
        assert exit.value.code == 0, command


def test_a_mistyped_flag_gets_the_subcommands_usage_and_the_nearest(capsys):
    with pytest.raises(SystemExit) as exit:
        cli.main(["run", "-p", "hi", "--temprature", "0.5"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "usage: tmac run" in err and "did you mean --temperature?" in err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--max-bach", "2"])
    assert "usage: tmac serve" in (err := capsys.readouterr().err) and "did you mean --max-batch?" in err


@pytest.mark.slow
def test_chat_commands_and_a_piped_chat(tmp_path):
    r = tmac("chat", "-n", "8", "--temperature", "0", "-c", "256",
             input="/help\n/what\nWhat is the capital of France?\n/quit\nnever read\n")
    assert r.returncode == 0, r.stderr
    assert "/reset" in r.stderr and "/bye" in r.stderr  # the list of commands
    assert "unknown command /what" in r.stderr
    assert r.stderr.count("peak RSS") == 1  # one answer: the unknown command went nowhere, /quit ended it
    assert "> " not in r.stdout and r.stdout.strip()  # the answer alone on standard output
    r = tmac("chat", "-n", "4", "-c", "256", input="Hi\n/bye\n")
    assert r.returncode == 0 and r.stderr.count("peak RSS") == 1


@pytest.mark.slow
def test_a_reader_leaving_early_ends_the_run_quietly():
    proc = subprocess.Popen(f"{sys.executable} -m tmac.apps.cli run -p 'Write a long story.' -n 400 --ignore-eos "
                            f"| head -c 5", shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            executable="/bin/bash")
    out, err = proc.communicate(timeout=300)
    assert len(out) == 5 and "Traceback" not in err and "Exception ignored" not in err, err
    status = subprocess.run(f"set -o pipefail; {sys.executable} -m tmac.apps.cli run -p 'Write a long story.' -n 400 "
                            f"--ignore-eos | head -c 5 > /dev/null", shell=True, executable="/bin/bash",
                            capture_output=True, text=True, timeout=300)
    assert status.returncode != 0 and "Traceback" not in status.stderr


def test_a_converted_file_says_its_gguf_types_without_reading_the_gguf(tmp_path, capsys, monkeypatch):
    """A .tmac file (and a packed copy) keeps its source's types: `tmac run` names them without the GGUF at hand
    (reading a GGUF's metadata, its vocabulary among it, was a quarter of a second of each start)."""
    from tmac.apps import cli_generate
    from tmac.models.files.convert import convert

    mix = os.path.join(os.path.dirname(__file__), "data", "mixes", "Q4_K_M.gguf")
    out = str(tmp_path / "mix.tmac")
    convert(mix, out, progress=False)

    def unread(path):
        raise AssertionError(f"{path} read again")
    monkeypatch.setattr(cli_generate, "_file_quantization", unread)
    assert cli.main(["run", out, "-p", "Hi", "-n", "1", "-c", "64"]) == 0
    assert "running the file's Q4_K+Q6_K weights exactly" in capsys.readouterr().err


def test_each_run_says_which_precision_runs(capsys, monkeypatch):
    run_json(capsys, monkeypatch, "-p", "Hi")
    capsys.readouterr()
    assert cli.main(["run", "-p", "Hi", "-n", "1", "-c", "64"]) == 0
    assert "running the file's Q4_1 weights exactly" in capsys.readouterr().err
    assert cli.main(["run", "-p", "Hi", "-n", "1", "-c", "64", "--bits", "2"]) == 0
    err = capsys.readouterr().err
    assert "requantized to 2 bits from the file's Q4_1" in err and "expect nonsense" in err


def test_a_float_model_says_it_runs_unquantized(tmp_path, capsys):
    import torch
    import transformers

    import tmac

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64)).save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text(tmac.load_model(smollm2_path(), context=16).tokenizer.backend.to_str())
    assert cli.main(["run", str(tmp_path), "-p", "Hi", "-n", "1", "--no-chat"]) == 0
    assert "running the float weights as they are (float32): slow; --bits 4" in capsys.readouterr().err
    assert cli.main(["convert", str(tmp_path), "-o", str(tmp_path / "f.tmac")]) == 0
    assert "--bits 4 quantizes them" in capsys.readouterr().out


def test_output_files_get_the_users_umask(tmp_path):
    import torch

    import tmac

    layer = torch.nn.Sequential(torch.nn.Linear(64, 64))
    tmac.quantize_model(layer, bits=4, group_size=32)
    old = os.umask(0o022)
    try:
        tmac.save(layer, tmp_path / "a.safetensors")
        os.umask(0o077)
        tmac.save(layer, tmp_path / "b.safetensors")
    finally:
        os.umask(old)
    assert (tmp_path / "a.safetensors").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "b.safetensors").stat().st_mode & 0o777 == 0o600


def test_progress_in_a_log_is_lines_not_frames():
    from tmac.base.progress import Progress

    log = io.StringIO()
    with Progress("scoring", 3, True, stream=log) as bar:
        for i in range(3):
            bar.advance(f"window {i}")
    text = log.getvalue()
    assert "\r" not in text and text.endswith("\n") and text.splitlines()[-1].startswith("scoring: 3/3")
    quiet = io.StringIO()
    with Progress("scoring", 3, None, stream=quiet) as bar:  # a library's default: a terminal only
        bar.advance()
    assert quiet.getvalue() == ""
