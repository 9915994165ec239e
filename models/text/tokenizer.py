"""Tokenizer: Hugging Face ``tokenizers`` built from GGUF metadata or a ``tokenizer.json``, plus the chat template.

From GGUF, a byte-level BPE (``tokenizer.ggml.model == "gpt2"``) is rebuilt from the vocabulary and merges,
with the pre-tokenizer llama.cpp uses for ``tokenizer.ggml.pre`` (the table below), and a SentencePiece BPE
(``"llama"``: Llama 2, Gemma, Phi-3, BitNet) from the pieces and their scores, so ids equal llama.cpp's.
Control and user-defined tokens become special added tokens: they are matched whole in the text, as llama.cpp
does when parsing special tokens. Chat templates render in jinja2's immutable sandbox: a template is data
from a model file and must not execute anything.
"""

from __future__ import annotations

import base64
import functools
import json
import math
import os
import zlib
from dataclasses import dataclass, field

from tmac.base import files
from tmac.base.errors import ModelFormatError

from tmac.models.text.chat_template import TemplateRaised, compile_template
from tmac.models.files.jsonfile import read_json

# llama.cpp's pre-tokenizer regexes (llama-vocab.cpp), by the names GGUF files use for them
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
           r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {  # name → the regexes applied in turn (each splits the pieces of the previous one)
    "gpt2": (_GPT2,), "gpt-2": (_GPT2,), "mpt": (_GPT2,), "olmo": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2), "starcoder": (r"\p{N}", _GPT2), "refact": (r"\p{N}", _GPT2),
    "codeshell": (r"\p{N}", _GPT2), "command-r": (r"\p{N}", _GPT2),
    "llama3": (_LLAMA3,), "llama-bpe": (_LLAMA3,), "llama-v3": (_LLAMA3,), "falcon3": (_LLAMA3,),
    "qwen2": (_QWEN2,), "deepseek-r1-qwen": (_QWEN2,),
}
NORMAL, CONTROL, USER_DEFINED = 1, 3, 4  # llama.cpp's token types (control and user-defined ones are special)
VOCABULARIES = {"gpt2": "byte-level BPE", "llama": "SentencePiece BPE"}  # tokenizer.ggml.model
SPACE = "\u2581"  # SentencePiece's visible space


@dataclass
class Tokenizer:
    backend: object  # tokenizers.Tokenizer
    bos_id: int | None
    eos_id: int | None
    add_bos: bool = False
    chat_template: str | None = None
    stop_ids: frozenset[int] = field(default_factory=frozenset)  # end-of-generation tokens
    template_source: str = "the model"  # where the chat template comes from, for its errors

    @functools.cached_property
    def longest_token(self) -> int:
        """Characters of the vocabulary's longest token (in its byte-level spelling: at least its text's). Read a
        token at a time: the vocabulary as one dict is 50k strings at once, 8 MiB that stayed in Python's heap."""
        ids = range(self.backend.get_vocab_size(with_added_tokens=True))
        return max((len(t) for t in map(self.backend.id_to_token, ids) if t is not None), default=1)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are recognized. BOS is prepended when
        ``add_bos`` (default: what the model's metadata asks for)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation, rendered with the model's chat template in a jinja2 sandbox."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use raw prompts (--no-chat)")
        try:
            return compile_template(self.chat_template)(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self._text(self.bos_id), eos_token=self._text(self.eos_id))
        except ModelFormatError as e:
            raise ModelFormatError(f"{self.template_source}: {e}") from None
        except TemplateRaised as e:
            raise ValueError(f"{self.template_source}: the chat template refuses these messages: {e}") from None

    def _text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")

    # ---- construction ----------------------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict, source: str = "GGUF", vocab_size: int | None = None) -> "Tokenizer":
        """The tokenizer a GGUF's metadata describes; ``vocab_size``: the model's token rows, which it may not
        exceed (a token past them could only crash or be garbage)."""
        from tokenizers import AddedToken

        model = meta.get("tokenizer.ggml.model")
        if not isinstance(model, str) or model not in VOCABULARIES:
            raise ModelFormatError(f"{source}: tokenizer.ggml.model={model!r:.60} is not supported; supported: "
                                   + ", ".join(f"{k!r} ({v})" for k, v in VOCABULARIES.items()))
        tokens = meta.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise ModelFormatError(f"{source}: tokenizer.ggml.tokens missing or not an array of strings")
        check_vocab(len(tokens), vocab_size, f"{source}: tokenizer.ggml.tokens")
        if not all(isinstance(t, str) for t in tokens):
            raise ModelFormatError(f"{source}: tokenizer.ggml.tokens missing or not an array of strings")
        types = meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))
        if not isinstance(types, list) or not all(type(t) is int for t in types):
            raise ModelFormatError(f"{source}: tokenizer.ggml.token_type is not an array of integers")
        if len(types) != len(tokens):
            raise ModelFormatError(f"{source}: {len(types)} token types for {len(tokens)} tokens")
        spm = model == "llama"
        backend = _spm_backend(meta, tokens, types, source) if spm else _bpe_backend(meta, tokens, source)
        special = [t for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)]
        if any(len(t) > MAX_ADDED_TOKEN for t in special):
            raise ModelFormatError(f"{source}: a special token of tokenizer.ggml.tokens is over {MAX_ADDED_TOKEN} "
                                   f"characters long")
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        # llama.cpp's defaults for a SentencePiece vocabulary whose file names none: BOS 1 and EOS 2, BOS added
        bos = _token_id(meta, "bos", len(tokens), source, 1 if spm else None)
        eos = _token_id(meta, "eos", len(tokens), source, 2 if spm else None)
        eot = _token_id(meta, "eot", len(tokens), source)
        stop = {i for i in (eos, eot) if i is not None}
        template = meta.get("tokenizer.chat_template")
        return cls(backend, bos, eos, bool(meta.get("tokenizer.ggml.add_bos_token", spm)),
                   template if isinstance(template, str) else None, frozenset(stop), source)

    @classmethod
    def from_hf_dir(cls, path: str, vocab_size: int | None = None) -> "Tokenizer":
        """From ``tokenizer.json`` (+ ``tokenizer_config.json`` for BOS/EOS flags and the chat template)."""
        file = os.path.join(path, "tokenizer.json")
        try:
            text = files.read_regular(file, MAX_TOKENIZER_BYTES)
        except (OSError, ValueError) as e:
            raise ModelFormatError(f"{file}: cannot read tokenizer ({e})") from None
        backend = hf_backend(text, file)
        check_vocab(backend.get_vocab_size(with_added_tokens=True), vocab_size, file)
        config_file = os.path.join(path, "tokenizer_config.json")
        config = read_json(config_file, missing_ok=True)

        def special(name):
            tok = config.get(name)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            return backend.token_to_id(tok) if isinstance(tok, str) else None

        bos, eos = special("bos_token"), special("eos_token")
        template, source = config.get("chat_template"), config_file
        template_file = os.path.join(path, "chat_template.jinja")  # where transformers 5 saves it
        if not isinstance(template, str) and os.path.lexists(template_file):
            try:
                template = files.read_regular(template_file, MAX_TEMPLATE_BYTES).decode()
            except (OSError, ValueError, UnicodeDecodeError) as e:
                raise ModelFormatError(f"{template_file}: cannot read the chat template ({e})") from None
            source = template_file
        return cls(backend, bos, eos, bool(config.get("add_bos_token", False)),
                   template if isinstance(template, str) else None, frozenset({eos} - {None}), source)


def check_vocab(tokens: int, vocab_size: int | None, where: str) -> None:
    if vocab_size is not None and tokens > vocab_size:
        raise ModelFormatError(f"{where} holds {tokens} tokens, more than the model's {vocab_size} token rows "
                               f"(embedding and head): the tokenizer is not this model's")


MAX_TOKENIZER_BYTES = 256 << 20
MAX_TEMPLATE_BYTES = 1 << 20  # real chat templates are a few KiB
MAX_REPLACEMENT = 256  # characters a normalizer may put in (a Replace's content, a Prepend)
# characters of a special token: they are matched whole in every text, and building the matcher for a token of
# megabytes takes hundreds of MB (real ones are tens of characters)
MAX_ADDED_TOKEN = 4096
# characters of a SentencePiece piece that merging can form: finding its halves costs its length squared, and
# real pieces are short (SentencePiece's trainer caps them at 16 characters unless told otherwise)
MAX_JOINED_PIECE = 64


def hf_backend(text: str | bytes, where: str):
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` text, made safe to run on any prompt: padding and
    truncation (which tmac never uses; a fixed padding of 10^8 tokens would take gigabytes) are dropped, and
    normalizers that could grow a text without bound (an empty pattern replaced, long replacements) refused. The
    text is parsed by ``tokenizers`` alone: parsed in Python too, a 50k-token vocabulary was 50 MiB of objects for a
    moment."""
    from tokenizers import Tokenizer as HFTokenizer

    try:
        backend = HFTokenizer.from_str(text.decode() if isinstance(text, bytes) else text)
        backend.no_padding()
        backend.no_truncation()
        normalizer = backend.normalizer
        spec = None if normalizer is None else json.loads(normalizer.__getstate__())
        added = list(backend.get_added_tokens_decoder().items())
    except Exception as e:  # tokenizers raises a bare Exception for malformed files
        raise ModelFormatError(f"{where}: cannot read tokenizer ({type(e).__name__}: {e})") from None
    _check_normalizer(spec, where)
    long = [(i, t.content) for i, t in added if len(t.content) > MAX_ADDED_TOKEN]
    if long:
        raise ModelFormatError(f"{where}: added token {long[0][0]} is {len(long[0][1])} characters long (at most "
                               f"{MAX_ADDED_TOKEN})")
    return backend


def _check_normalizer(node, where: str) -> None:
    if isinstance(node, list):
        for n in node:
            _check_normalizer(n, where)
    elif isinstance(node, dict):
        kind = node.get("type")
        if kind == "Replace":
            pattern = node.get("pattern")
            found = next(iter(pattern.values()), None) if isinstance(pattern, dict) else None
            content = node.get("content")
            if not isinstance(found, str) or not found or not isinstance(content, str) or \
                    len(content) > MAX_REPLACEMENT:
                raise ModelFormatError(f"{where}: normalizer Replace({found!r:.40} -> {len(str(content))} chars) "
                                       f"could grow a text without bound")
        elif kind == "Prepend" and len(str(node.get("prepend", ""))) > MAX_REPLACEMENT:
            raise ModelFormatError(f"{where}: normalizer Prepend of {len(str(node.get('prepend')))} characters")
        for key in ("normalizers", "normalizer"):
            _check_normalizer(node.get(key), where)


def _bpe_backend(meta: dict, tokens: list[str], source: str):
    """Byte-level BPE from the vocabulary and merges, pre-tokenized as llama.cpp does for ``tokenizer.ggml.pre``."""
    from tokenizers import Regex, decoders, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre", "gpt2")
    if not isinstance(pre, str) or pre not in PRE_TOKENIZERS:
        raise ModelFormatError(f"{source}: tokenizer.ggml.pre={pre!r} is not supported; supported: "
                               f"{sorted(PRE_TOKENIZERS)}")
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise ModelFormatError(f"{source}: tokenizer.ggml.merges missing or not an array of strings")
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ModelFormatError(f"{source}: malformed BPE merge {merge[:40]!r}")
        pairs.append((left, right))
    backend = _bpe_model({t: i for i, t in enumerate(tokens)}, pairs, source)
    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in PRE_TOKENIZERS[pre]]
    backend.pre_tokenizer = pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                        use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _spm_backend(meta: dict, tokens: list[str], types: list[int], source: str):
    """SentencePiece BPE as llama.cpp runs it: spaces become U+2581 (one prefixed to each text between special
    tokens when ``tokenizer.ggml.add_space_prefix``, default true), then the adjacent pair whose joined piece has
    the highest score merges first, and characters no piece holds fall back to ``<0xXX>`` byte tokens. Each piece
    joinable from two others becomes a merge ranked by its score, so a BPE model runs the same algorithm."""
    from tokenizers import decoders, normalizers

    scores = meta.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens) or \
            not all(type(x) in (int, float) and math.isfinite(x) for x in scores):
        raise ModelFormatError(f"{source}: tokenizer.ggml.scores must be a finite number for each of the "
                               f"{len(tokens)} tokens of a SentencePiece vocabulary")
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # llama.cpp keeps a repeated piece's first id
    joined = []
    for i, t in enumerate(tokens):
        if types[i] in (NORMAL, USER_DEFINED) and vocab[t] == i and len(t) <= MAX_JOINED_PIECE:
            joined += [(-scores[i], i, k) for k in range(1, len(t)) if t[:k] in vocab and t[k:] in vocab]
    joined.sort()
    pairs = [(tokens[i][:k], tokens[i][k:]) for _, i, k in joined]
    unk = _token_id(meta, "unknown", len(tokens), source, 0)
    backend = _bpe_model(vocab, pairs, source, unk_token=tokens[unk], byte_fallback=True)
    space = meta.get("tokenizer.ggml.add_space_prefix", True)
    if type(space) is not bool:
        raise ModelFormatError(f"{source}: tokenizer.ggml.add_space_prefix={space!r:.40} is not a boolean")
    escape = normalizers.Replace(" ", SPACE)
    backend.normalizer = normalizers.Sequence([escape, normalizers.Prepend(SPACE)]) if space else escape
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + ([decoders.Strip(" ", 1, 0)] if space else []))
    return backend


def _bpe_model(vocab: dict, pairs: list, source: str, **options):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    try:
        return HFTokenizer(models.BPE(vocab, pairs, fuse_unk=False, ignore_merges=False, **options))
    except Exception as e:  # tokenizers raises a bare Exception, e.g. for a merge of unknown tokens
        raise ModelFormatError(f"{source}: tokenizer.ggml.merges: {e}") from None


def _token_id(meta: dict, name: str, vocab: int, source: str, default: int | None = None) -> int | None:
    value = meta.get(f"tokenizer.ggml.{name}_token_id")
    if value is None:
        return default if default is not None and default < vocab else None
    if type(value) is not int or not 0 <= value < vocab:
        raise ModelFormatError(f"{source}: tokenizer.ggml.{name}_token_id={value!r} is not a token id < {vocab}")
    return value


# ---- a tokenizer.json inside a .tmac file's metadata ----------------------------------------------------------

def pack_text(text: str) -> str:
    """``text`` deflated and in base64: a tokenizer.json is a third of its size, and needs no escaping in the JSON
    strings that hold it (the plain text, quoted twice over, took more room than a tied table saves). (Files
    written before held base85, ``json_z85``: a little smaller, but Python decodes it a hundred times slower — a
    third of a second of every start.) Level 3: a 1.5 MB tokenizer.json in 0.07 s, 10 % larger than level 9's
    0.7 s (a first run writes one)."""
    return base64.b64encode(zlib.compress(text.encode(), 3)).decode("ascii")


def _b64decode(text: str) -> bytes:
    return base64.b64decode(text, validate=True)


PACKED_TEXT_KEYS = {"json_z64": _b64decode, "json_z85": base64.b85decode}  # (the key names the encoding)


def unpack_text(packed: str, what: str, decode=_b64decode) -> str:
    """The text ``pack_text`` packed, inflated to at most ``MAX_TOKENIZER_BYTES`` (a small deflate stream can
    expand a thousandfold)."""
    try:
        inflater = zlib.decompressobj()
        raw = inflater.decompress(decode(packed), MAX_TOKENIZER_BYTES)
        if inflater.unconsumed_tail or not inflater.eof:
            raise ValueError(f"more than {MAX_TOKENIZER_BYTES} bytes inflated, or a truncated stream")
        return raw.decode()
    except (ValueError, zlib.error, UnicodeDecodeError) as e:
        raise ValueError(f"{what}: not a packed text ({e})") from None


def tokenizer_from_info(tok: dict, path: str) -> Tokenizer:
    """The tokenizer a ``.tmac`` file's metadata holds (``tmac.models.files.tmac_file``), checked."""
    key = next((k for k in (*PACKED_TEXT_KEYS, "json") if isinstance(tok, dict) and k in tok), None)
    if key is None or not isinstance(tok[key], str):
        raise ValueError("tokenizer: not an object with the tokenizer.json text")
    text = unpack_text(tok[key], "tokenizer", PACKED_TEXT_KEYS[key]) if key in PACKED_TEXT_KEYS else tok[key]
    backend = hf_backend(text, "tokenizer")
    vocab = backend.get_vocab_size(with_added_tokens=True)

    def token(name, value):
        if value is not None and (type(value) is not int or not 0 <= value < vocab):
            raise ValueError(f"tokenizer {name}={value!r:.40} is not a token id below {vocab}")
        return value

    stop, template = tok["stop_ids"], tok["chat_template"]
    if not isinstance(stop, list) or len(stop) > vocab:
        raise ValueError(f"tokenizer stop_ids={stop!r:.40} is not a list of token ids")
    if template is not None and not isinstance(template, str) or type(tok["add_bos"]) is not bool:
        raise ValueError("tokenizer chat_template must be a string or null, add_bos a boolean")
    return Tokenizer(backend, token("bos_id", tok["bos_id"]), token("eos_id", tok["eos_id"]), tok["add_bos"],
                     template, frozenset(token("stop_ids", i) for i in stop), path)

