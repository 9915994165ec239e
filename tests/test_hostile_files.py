"""Model directories built to exhaust the machine or hang it: each load ends with ModelFormatError naming the file,
or loads with the hostile part made harmless — never a signal, a hang or unbounded memory."""
import base64
import json
import os
import shutil
import zlib

import pytest
import torch
import transformers

import tmac

pytestmark = pytest.mark.unit  # needs no compiler (make unit)


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


@pytest.fixture(scope="module")
def tmac_file(tmp_path_factory):
    from tmac.models.family.llama import LlamaConfig
    from tmac.models.files.synthetic import write_random_gguf
    from tmac.models.files.tmac_file import save_model

    d = tmp_path_factory.mktemp("tmacfile")
    write_random_gguf(str(d / "m.gguf"), LlamaConfig(vocab_size=512, dim=256, n_layers=1, n_heads=4, n_kv_heads=2,
                                                      ffn_dim=512, context_length=64), "Q4_0")
    save_model(tmac.load_model(str(d / "m.gguf"), context=16), str(d / "m.tmac"))
    return d / "m.tmac"


def _rewrite(src, dst, edit_info=None, edit_extra=None):
    """A copy of a .tmac file with its model metadata or every layer's extra state edited."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if edit_info:
        info = json.loads(meta["tmac_model"])
        edit_info(info)
        meta["tmac_model"] = json.dumps(info)
    if edit_extra:
        state = json.loads(meta["tmac"])
        for extra in state["extra_state"].values():
            if isinstance(extra, dict) and "spec" in extra:
                edit_extra(extra)
        meta["tmac"] = json.dumps(state)
    save_file(tensors, str(dst), metadata=meta)
    return dst


LIES = {"spec.quads": (None, lambda e: e["spec"].update(quads=True)),
        "spec.group_size 0": (None, lambda e: e["spec"].update(group_size=0)),
        "spec.k_chunk": (None, lambda e: e["spec"].update(k_chunk=e["spec"]["k_chunk"] // 2)),
        "bos_id -1": (lambda i: i["tokenizer"].update(bos_id=-1), None),
        "bos_id 2**64": (lambda i: i["tokenizer"].update(bos_id=2 ** 64), None),
        "chat_template 5": (lambda i: i["tokenizer"].update(chat_template=5), None),
        "rope_theta 1e29": (lambda i: i["config"].update(rope_theta=10 ** 29), None),
        "stop_ids scalar": (lambda i: i["tokenizer"].update(stop_ids=7), None),
        "tokenizer deflate bomb": (lambda i: i["tokenizer"].update(json_z64=base64.b64encode(zlib.compress(
            b" " * (300 << 20), 9)).decode()), None),
        "tokenizer deflate bomb, base85 (older files)": (lambda i: (i["tokenizer"].pop("json_z64"), i["tokenizer"].update(
            json_z85=base64.b85encode(zlib.compress(b" " * (300 << 20), 9)).decode())), None),
        "tokenizer not base64": (lambda i: i["tokenizer"].update(json_z64="%%%%"), None),
        "file_quantization not a type": (lambda i: i.update(file_quantization="Q4_0\x1b[2J"), None)}


def test_a_tokenizer_packed_in_base85_by_older_files_still_loads(tmac_file, tmp_path):
    def to_base85(info):
        packed = info["tokenizer"].pop("json_z64")
        info["tokenizer"]["json_z85"] = base64.b85encode(base64.b64decode(packed)).decode()
    older = _rewrite(tmac_file, tmp_path / "older.tmac", to_base85)
    text = "The lighthouse keeper climbed the stairs."
    assert tmac.load_model(str(older)).tokenizer.encode(text) == tmac.load_model(str(tmac_file)).tokenizer.encode(text)


@pytest.mark.parametrize("lie", LIES)
def test_tmac_file_metadata_lies_are_caught(tmac_file, tmp_path, lie):
    """Fields of the wrong type or range, and a packed layout its spec no longer describes (a K chunk changed
    without repacking: it loaded and computed garbage), fail the load naming the file."""
    edit_info, edit_extra = LIES[lie]
    bad = _rewrite(tmac_file, tmp_path / "bad.tmac", edit_info, edit_extra)
    with pytest.raises(tmac.ModelFormatError, match="bad.tmac"):
        tmac.load_model(str(bad))
    assert tmac.load_model(str(_rewrite(tmac_file, tmp_path / "same.tmac"))) is not None  # the copy itself loads
