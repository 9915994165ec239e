"""Tokenizer: Hugging Face ``tokenizers`` built from GGUF metadata or a ``tokenizer.json``, plus the chat template.

From GGUF, a byte-level BPE (``tokenizer.ggml.model == "gpt2"``) is rebuilt from the vocabulary and merges,
with the pre-tokenizer llama.cpp uses for ``tokenizer.ggml.pre`` (the table below), so ids equal llama.cpp's.
Control and user-defined tokens become special added tokens: they are matched whole in the text, as llama.cpp
does when parsing special tokens. Chat templates render in jinja2's immutable sandbox: a template is data
from a model file and must not execute anything.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from tmac.errors import ModelFormatError

from .jsonfile import read_json

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
CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types that are special


@dataclass
class Tokenizer:
    backend: object  # tokenizers.Tokenizer
    bos_id: int | None
    eos_id: int | None
    add_bos: bool = False
    chat_template: str | None = None
    stop_ids: frozenset[int] = field(default_factory=frozenset)  # end-of-generation tokens

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
        return _compile_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self._text(self.bos_id), eos_token=self._text(self.eos_id))

    def _text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")

    # ---- construction ----------------------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict, source: str = "GGUF") -> "Tokenizer":
        from tokenizers import AddedToken, Regex
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers

        model = meta.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise ModelFormatError(f"{source}: tokenizer.ggml.model={model!r} is not supported; supported: "
                                   f"'gpt2' (byte-level BPE)")
        pre = meta.get("tokenizer.ggml.pre", "gpt2")
        if pre not in PRE_TOKENIZERS:
            raise ModelFormatError(f"{source}: tokenizer.ggml.pre={pre!r} is not supported; supported: "
                                   f"{sorted(PRE_TOKENIZERS)}")
        tokens = meta.get("tokenizer.ggml.tokens")
        merges = meta.get("tokenizer.ggml.merges")
        if not isinstance(tokens, list) or not tokens or not isinstance(merges, list):
            raise ModelFormatError(f"{source}: tokenizer.ggml.tokens / tokenizer.ggml.merges missing or malformed")
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(types) != len(tokens):
            raise ModelFormatError(f"{source}: {len(types)} token types for {len(tokens)} tokens")
        vocab = {t: i for i, t in enumerate(tokens)}
        pairs = []
        for merge in merges:
            left, sep, right = merge.partition(" ")
            if not sep:
                raise ModelFormatError(f"{source}: malformed BPE merge {merge[:40]!r}")
            pairs.append((left, right))
        try:
            backend = HFTokenizer(models.BPE(vocab, pairs, fuse_unk=False, ignore_merges=False))
        except Exception as e:  # tokenizers raises a bare Exception, e.g. for a merge of unknown tokens
            raise ModelFormatError(f"{source}: tokenizer.ggml.merges: {e}") from None
        splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in PRE_TOKENIZERS[pre]]
        backend.pre_tokenizer = pre_tokenizers.Sequence(splits + [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                            use_regex=False)])
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)])
        bos, eos = _token_id(meta, "bos", len(tokens), source), _token_id(meta, "eos", len(tokens), source)
        eot = _token_id(meta, "eot", len(tokens), source)
        stop = {i for i in (eos, eot) if i is not None}
        template = meta.get("tokenizer.chat_template")
        return cls(backend, bos, eos, bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                   template if isinstance(template, str) else None, frozenset(stop))

    @classmethod
    def from_hf_dir(cls, path: str) -> "Tokenizer":
        """From ``tokenizer.json`` (+ ``tokenizer_config.json`` for BOS/EOS flags and the chat template)."""
        from tokenizers import Tokenizer as HFTokenizer

        file = os.path.join(path, "tokenizer.json")
        try:
            backend = HFTokenizer.from_file(file)
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise ModelFormatError(f"{file}: cannot read tokenizer ({e})") from None
        config = read_json(os.path.join(path, "tokenizer_config.json"), missing_ok=True)

        def special(name):
            tok = config.get(name)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            return backend.token_to_id(tok) if isinstance(tok, str) else None

        bos, eos = special("bos_token"), special("eos_token")
        template = config.get("chat_template")
        return cls(backend, bos, eos, bool(config.get("add_bos_token", False)),
                   template if isinstance(template, str) else None, frozenset({eos} - {None}))


def _token_id(meta: dict, name: str, vocab: int, source: str) -> int | None:
    value = meta.get(f"tokenizer.ggml.{name}_token_id")
    if value is None:
        return None
    if type(value) is not int or not 0 <= value < vocab:
        raise ModelFormatError(f"{source}: tokenizer.ggml.{name}_token_id={value!r} is not a token id < {vocab}")
    return value


def _compile_template(source: str):
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ModelFormatError(f"chat template does not compile: {e}") from None
