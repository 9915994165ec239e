"""Models by Hugging Face repo id, offline: a hub cache laid out here as huggingface_hub lays it out
(models--ORG--NAME/refs/main → snapshots/COMMIT/...), read through huggingface_hub with HF_HUB_OFFLINE=1."""
import json
import os

import pytest
import torch
import transformers

import tmac
from conftest import smollm2_path
from tmac.apps import cli
from tmac.models.files.hub import is_repo_id, resolve

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _lay_out(cache, repo: str, files: dict) -> str:
    """A cached snapshot of ``repo`` holding ``files`` (name → a path to link to, or bytes)."""
    base = cache / ("models--" + repo.replace("/", "--"))
    snapshot = base / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(COMMIT)
    for name, content in files.items():
        target = snapshot / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.symlink_to(content)
    return str(snapshot)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _run_json(capsys, *args) -> dict:
    assert cli.main(["run", *args, "-n", "6", "--json", "--temperature", "0"]) == 0
    return json.loads(capsys.readouterr().out)


def test_repo_ids_and_paths_are_told_apart(tmp_path):
    assert is_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct") and is_repo_id("org/repo:sub/model-Q4_K_M.gguf")
    assert not is_repo_id("model.gguf") and not is_repo_id("/abs/path") and not is_repo_id("a/b/c")
    assert not is_repo_id("org/repo:weights.bin")  # only GGUFs are named inside a repo
    assert is_repo_id("org/repo:Q4_K_M") and not is_repo_id("org/repo:Q4 K")
    assert resolve(str(tmp_path)) == str(tmp_path)  # an existing path is itself


def test_run_a_gguf_of_a_cached_repo_offline(hub, capsys):
    _lay_out(hub, "acme/SmolLM2-GGUF", {"SmolLM2-135M-Instruct.Q4_1.gguf": smollm2_path()})
    by_name = _run_json(capsys, "acme/SmolLM2-GGUF:SmolLM2-135M-Instruct.Q4_1.gguf", "-p", "Hi")
    assert by_name["generated_ids"] == _run_json(capsys, smollm2_path(), "-p", "Hi")["generated_ids"]
    # the repo's only GGUF without naming it; tmac pull says where it is
    assert _run_json(capsys, "acme/SmolLM2-GGUF", "-p", "Hi")["generated_ids"] == by_name["generated_ids"]
    assert cli.main(["pull", "acme/SmolLM2-GGUF"]) == 0
    assert os.path.join("snapshots", COMMIT, "SmolLM2-135M-Instruct.Q4_1.gguf") in capsys.readouterr().out


def test_a_repo_of_several_ggufs_gives_q4_k_m_or_asks_for_a_name(hub):
    files = {f"m-{q}.gguf": b"GGUF" for q in ("Q2_K", "Q4_K_M", "Q8_0")}
    snapshot = _lay_out(hub, "acme/many", files)
    assert resolve("acme/many") == os.path.join(snapshot, "m-Q4_K_M.gguf")
    _lay_out(hub, "acme/odd", {"m-Q2_K.gguf": b"GGUF", "m-Q3_K_S.gguf": b"GGUF"})
    with pytest.raises(ValueError, match=r"holds 2 GGUF files; name one as acme/odd:FILE — m-Q2_K.gguf, m-Q3_K_S"):
        resolve("acme/odd")


def test_a_hugging_face_directory_repo_runs_by_name(hub, tmp_path, capsys):
    local = tmp_path / "tiny"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True)).save_pretrained(local)
    (local / "tokenizer.json").write_text(tmac.load_model(smollm2_path(), context=16).tokenizer.backend.to_str())
    files = {p.name: str(p) for p in local.iterdir()}
    files["pytorch_model.bin"] = b"a pickle, never read"
    _lay_out(hub, "acme/tiny", files)
    got = _run_json(capsys, "acme/tiny", "-p", "Hi", "--no-chat", "--bits", "4")
    assert got["generated_ids"] == _run_json(capsys, str(local), "-p", "Hi", "--no-chat", "--bits", "4")["generated_ids"]


def test_a_repo_not_in_the_cache_offline_says_how_to_get_it(hub, capsys):
    assert cli.main(["run", "acme/absent", "-p", "Hi"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not in the Hugging Face cache" in err and "HF_HUB_OFFLINE" in err
    assert "tmac pull acme/absent" in err and "unexpected" not in err
    with pytest.raises(FileNotFoundError, match="no such local file or directory acme/absent"):
        tmac.load_model("acme/absent")


def test_a_quantization_tag_picks_that_gguf_and_the_run_says_which(hub, capsys):
    files = {f"m-{q}.gguf": b"GGUF" for q in ("Q2_K", "Q4_K_M", "Q4_K_S", "IQ2_XXS")}
    files["m-Q8_0.gguf"] = smollm2_path()
    snapshot = _lay_out(hub, "acme/many", files)
    assert resolve("acme/many:Q4_K_S") == os.path.join(snapshot, "m-Q4_K_S.gguf")
    assert resolve("acme/many:q4_k_m") == os.path.join(snapshot, "m-Q4_K_M.gguf")  # any case
    with pytest.raises(FileNotFoundError, match="no Q5_K_M GGUF; it has IQ2_XXS, Q2_K, Q4_K_M, Q4_K_S, Q8_0"):
        resolve("acme/many:Q5_K_M")
    got = _run_json(capsys, "acme/many:Q8_0", "-p", "Hi")
    assert got["generated_ids"] == _run_json(capsys, smollm2_path(), "-p", "Hi")["generated_ids"]
    capsys.readouterr()
    assert cli.main(["run", "-m", "acme/many:Q8_0", "-p", "Hi", "-n", "1"]) == 0
    assert f"acme/many:Q8_0: m-Q8_0.gguf (snapshot {COMMIT[:12]})" in capsys.readouterr().err


def test_pull_without_the_hub_says_what_the_cache_has(hub, monkeypatch, capsys):
    from tmac.models.files import hub as hub_module

    _lay_out(hub, "acme/SmolLM2-GGUF", {"SmolLM2-135M-Instruct.Q4_1.gguf": smollm2_path()})
    monkeypatch.delenv("HF_HUB_OFFLINE")

    def unreachable(timeout=5.0):
        raise hub_module.HubUnreachable("huggingface.co: [Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(hub_module, "_check_reachable", unreachable)
    assert cli.main(["pull", "acme/SmolLM2-GGUF"]) == 0
    out = capsys.readouterr().out
    assert f"acme/SmolLM2-GGUF is in the cache: SmolLM2-135M-Instruct.Q4_1.gguf (snapshot {COMMIT[:12]})" in out
    assert "name resolution" in out and "tmac pull" not in out
    assert cli.main(["pull", "acme/absent"]) == 1  # not cached: the network's error is said
    assert "name resolution" in capsys.readouterr().err
