"""Model directories built to exhaust the machine or hang it: each load ends with ModelFormatError naming the file,
or loads with the hostile part made harmless — never a signal, a hang or unbounded memory."""
import json
import os
import shutil

import pytest
import torch
import transformers

import tmac


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, smollm2_tokenizer_json):
    path = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True)).save_pretrained(path)
    (path / "tokenizer.json").write_text(smollm2_tokenizer_json)
    return path


@pytest.fixture(scope="module")
def smollm2_tokenizer_json():
    from conftest import smollm2_path

    return tmac.load_model(smollm2_path(), context=16).tokenizer.backend.to_str()


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_padding_and_truncation_in_tokenizer_json_are_dropped(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "m")
    spec = json.loads((d / "tokenizer.json").read_text())
    spec["padding"] = {"strategy": {"Fixed": 100_000_000}, "direction": "Right", "pad_to_multiple_of": None,
                       "pad_id": 0, "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    spec["truncation"] = {"direction": "Right", "max_length": 1, "strategy": "LongestFirst", "stride": 0}
    (d / "tokenizer.json").write_text(json.dumps(spec))
    tok = tmac.load_model(d, context=16).tokenizer
    assert len(tok.encode("Hello world, hello")) == 4  # neither padded to 10^8 tokens nor truncated to 1


@pytest.mark.parametrize("normalizer", [
    {"type": "Sequence", "normalizers": [{"type": "Replace", "pattern": {"String": ""}, "content": "x" * 1000}] * 4},
    {"type": "Replace", "pattern": {"String": "a"}, "content": "y" * 100_000},
    {"type": "Prepend", "prepend": "z" * 100_000}])
def test_normalizers_that_grow_text_without_bound_are_refused(hf_dir, tmp_path, normalizer):
    d = _copy(hf_dir, tmp_path / "m")
    spec = json.loads((d / "tokenizer.json").read_text())
    spec["normalizer"] = normalizer
    (d / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(tmac.ModelFormatError, match="tokenizer.json: normalizer"):
        tmac.load_model(d, context=16)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors", "tokenizer_config.json"])
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "/dev/urandom"])
def test_special_files_in_place_of_model_files_are_refused(hf_dir, tmp_path, name, kind):
    d = _copy(hf_dir, tmp_path / "m")
    if (d / name).exists():
        os.unlink(d / name)
    if kind == "fifo":
        os.mkfifo(d / name)
    else:
        os.symlink(kind, d / name)
    with pytest.raises(tmac.ModelFormatError, match=f"{name}.*not a regular file"):
        tmac.load_model(d, context=16)


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "tokenizer.json"])
def test_deeply_nested_json_is_malformed_not_a_recursion_error(hf_dir, tmp_path, name):
    d = _copy(hf_dir, tmp_path / "m")
    (d / name).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(tmac.ModelFormatError, match=name):
        tmac.load_model(d, context=16)
