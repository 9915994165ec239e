"""SentencePiece vocabularies from GGUF (``tokenizer.ggml.model == "llama"``: Llama 2, Gemma, Phi-3, BitNet files).

The oracle is the ``sentencepiece`` library itself on a BPE model it trained, written out as llama.cpp's converter
writes one (pieces, scores, token types, the space-prefix flag). Around special tokens llama.cpp's own rule
applies: each text between two of them is tokenized on its own, with its space prefix."""
import math
import re

import pytest

import tmac
from families import CORPUS, sentencepiece_vocabulary
from tmac.base.errors import ModelFormatError
from tmac.models.text.tokenizer import Tokenizer, hf_backend

pytestmark = pytest.mark.unit  # needs no compiler (make unit)

WIDE = CORPUS + ("Über größer Straße café naïve déjà vu", "日本語のテキスト 한국어 текст ελληνικά",
                 "tabs\tand  double  spaces, digits 12345 67890", "line one\nline two\n\nline four")
TEXTS = ["hello world", "Hello World", "  two leading spaces", "trailing  ", "a\nb\n\nc", "\ttab", "x",
         "the quick brown fox jumps over the lazy dog", "naïve café, Straße", "日本語 and 한국어", "emoji 😀 here",
         "ünknöwn çhäracters ☃ ⌘", "12345 67890", " ", "a  b   c    d", "Beautiful is better than ugly."]


@pytest.fixture(scope="module", params=[True, False], ids=["space-prefix", "no-space-prefix"])
def vocabulary(request):
    sp, meta = sentencepiece_vocabulary(700, request.param, ("<|user|>",), WIDE)
    return sp, meta, Tokenizer.from_gguf_metadata(meta, "test.gguf")


def test_ids_equal_sentencepieces(vocabulary):
    sp, _, tok = vocabulary
    for text in TEXTS + list(WIDE):
        assert tok.encode(text, add_bos=False) == sp.encode(text), text


def test_characters_outside_the_vocabulary_fall_back_to_byte_tokens(vocabulary):
    sp, meta, tok = vocabulary
    ids = tok.encode("☃", add_bos=False)
    assert ids == sp.encode("☃")
    pieces = [meta["tokenizer.ggml.tokens"][i] for i in ids]
    assert [p for p in pieces if p.startswith("<0x")] == [f"<0x{b:02X}>" for b in "☃".encode()]


def test_text_decodes_back_as_sentencepiece_decodes_it(vocabulary):
    sp, _, tok = vocabulary
    for text in TEXTS:
        ids = tok.encode(text, add_bos=False)
        assert tok.decode(ids) == sp.decode(ids), text


def test_each_text_between_special_tokens_is_tokenized_on_its_own(vocabulary):
    sp, meta, tok = vocabulary
    user = meta["tokenizer.ggml.tokens"].index("<|user|>")
    eos = meta["tokenizer.ggml.eos_token_id"]
    ids = tok.encode("hello world<|user|>the fox</s> lazy dog", add_bos=False)
    assert ids == sp.encode("hello world") + [user] + sp.encode("the fox") + [eos] + sp.encode(" lazy dog")


def test_bos_is_added_as_the_file_asks(vocabulary):
    sp, meta, tok = vocabulary
    assert tok.add_bos and tok.encode("hi") == [meta["tokenizer.ggml.bos_token_id"]] + sp.encode("hi")
    no_bos = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.add_bos_token": False})
    assert no_bos.encode("hi") == sp.encode("hi")


def test_llama_cpps_defaults_hold_where_the_file_names_no_special_ids():
    sp, meta = sentencepiece_vocabulary(700, True, (), WIDE)
    bare = {k: v for k, v in meta.items() if not k.endswith(("_token_id", "add_bos_token", "add_space_prefix"))}
    tok = Tokenizer.from_gguf_metadata(bare)
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 2, True)  # llama.cpp: BOS 1, EOS 2, BOS added, space prefix
    assert tok.encode("hello world", add_bos=False) == sp.encode("hello world")


def test_the_tokenizer_survives_its_json_as_a_tmac_file_stores_it(vocabulary):
    sp, _, tok = vocabulary
    again = hf_backend(tok.backend.to_str(), "stored")
    for text in TEXTS:
        assert again.encode(text, add_special_tokens=False).ids == sp.encode(text), text


@pytest.mark.parametrize("field, value, says", [
    ("tokenizer.ggml.scores", None, "tokenizer.ggml.scores"),
    ("tokenizer.ggml.scores", [0.0], "tokenizer.ggml.scores"),
    ("tokenizer.ggml.scores", "nan", "tokenizer.ggml.scores"),
    ("tokenizer.ggml.add_space_prefix", "yes", "tokenizer.ggml.add_space_prefix"),
    ("tokenizer.ggml.unknown_token_id", 10 ** 6, "tokenizer.ggml.unknown_token_id"),
    ("tokenizer.ggml.model", "t5", "'llama' (SentencePiece BPE)"),
])
def test_a_malformed_vocabulary_is_named(field, value, says):
    _, meta = sentencepiece_vocabulary(700, True, (), WIDE)
    meta = dict(meta)
    if value == "nan":
        value = [math.nan] + meta[field][1:]
    if value is None:
        del meta[field]
    else:
        meta[field] = value
    with pytest.raises(ModelFormatError, match=f"bad.gguf: .*{re.escape(says)}"):
        Tokenizer.from_gguf_metadata(meta, "bad.gguf")


def test_a_sentencepiece_gguf_generates_from_text(tmp_path):
    from families import hf_model, write_gguf

    sp, _ = sentencepiece_vocabulary(300, True)
    path = tmp_path / "phi3.gguf"
    write_gguf(hf_model("phi3"), "phi3", path)
    model = tmac.load_model(str(path), progress=False)
    assert model.tokenizer.encode("hello world") == [1] + sp.encode("hello world")
    ids = tmac.Session(model).generate(model.tokenizer.encode("hello world"),
            max_new_tokens=4, ignore_eos=True, temperature=0)
    assert tmac.Session(model).generate("hello world", max_new_tokens=4, ignore_eos=True, temperature=0) == \
        model.tokenizer.decode(ids, skip_special=True) == sp.decode(ids)
