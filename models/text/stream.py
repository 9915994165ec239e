"""Generated ids as text while they come: never half a UTF-8 character, never a special token (the end of a turn),
and nothing from a stop string on (held back while one may be forming)."""

from __future__ import annotations


def check_prompt_size(tokenizer, chars: int, context: int) -> None:
    """Refuse a prompt of ``chars`` characters that cannot fit ``context`` tokens even if every token were the
    vocabulary's longest: it would only be tokenized (memory and time growing with it) to be refused after. A prompt
    of at most ``context`` characters fits whatever the longest is: the vocabulary is not walked for it."""
    if chars <= context:
        return
    most = context * tokenizer.longest_token
    if chars > most:
        raise ValueError(f"the prompt has {chars} characters, more than a context of {context} tokens can hold "
                         f"(at most {most}, at {tokenizer.longest_token} characters a token)")


def check_stop(stop) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings (one string is one stop)."""
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise TypeError(f"stop must be a string or a list of strings, got {stop!r:.60}")
    if any(not s for s in stop):
        raise ValueError("stop strings must not be empty (an empty one would stop before the first token)")
    return tuple(stop)


class TextStream:
    """Feed it token ids one at a time (``push``); each call returns the text that is final so far."""

    def __init__(self, tokenizer, stop=()):
        self.tokenizer, self.stop = tokenizer, check_stop(stop)
        self.ids: list[int] = []
        self.sent = 0  # characters of ``text()`` already returned

    def _text(self) -> tuple[str, bool]:
        """The text of the ids so far, cut before the first stop string, and whether one was found."""
        text = self.tokenizer.decode(self.ids, skip_special=True)
        cut = min((text.index(s) for s in self.stop if s in text), default=None)
        return (text, False) if cut is None else (text[:cut], True)

    def text(self) -> str:
        """The whole text of the ids so far, cut before the first stop string."""
        return self._text()[0]

    @property
    def stopped(self) -> bool:
        return self._text()[1]

    def push(self, token: int) -> str:
        self.ids.append(token)
        text, stopped = self._text()
        end = len(text) if stopped else len(text) - self._forming(text)
        while end > self.sent and text[end - 1] == "\ufffd":  # an incomplete UTF-8 sequence
            end -= 1
        piece = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece

    def _forming(self, text: str) -> int:
        """Characters at the end of ``text`` that may be the start of a stop string: the longest tail that begins
        one, found from where the stop's first character occurs in the tail (not by trying every length)."""
        longest = 0
        for s in self.stop:
            start = max(0, len(text) - len(s) + 1)
            at = text.find(s[0], start)
            while at != -1 and len(text) - at > longest:
                if s.startswith(text[at:]):
                    longest = len(text) - at
                    break
                at = text.find(s[0], at + 1)
        return longest

    def finish(self) -> str:
        """What is left once generation ended (a held-back tail that turned out not to be a stop string)."""
        text = self.text()
        piece = text[self.sent:]
        self.sent = len(text)
        return piece


def prompt_ids(tokenizer, messages: list[dict], context: int, chat: bool | None = None,
               system: str | None = None) -> list[int]:
    """The prompt's token ids: ``messages`` rendered with the chat template (``chat``: default, when the model has
    one; ``system`` put first where no system message is), else the last message's text alone."""
    check_prompt_size(tokenizer, sum(len(m["content"]) for m in messages), context)
    if not (chat if chat is not None else tokenizer.chat_template is not None):
        return tokenizer.encode(messages[-1]["content"])
    if system and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system}, *messages]
    return tokenizer.encode(tokenizer.render_chat(messages))


def fit_conversation(tokenizer, messages: list[dict], context: int, room: int, chat: bool | None = None,
                     system: str | None = None) -> tuple[list[int], int]:
    """The prompt ids of ``messages`` with room for ``room`` new tokens in ``context``, dropping the oldest exchanges
    (a user message and its answer) until they fit, as llama.cpp and ollama do; and how many were dropped.
    ``messages`` loses them too; ``system`` is added to the rendering each time, never dropped."""
    dropped = 0
    while True:
        ids = prompt_ids(tokenizer, messages, context, chat, system)
        if len(ids) + room <= context:
            return ids, dropped
        if len(messages) <= 1:
            raise ValueError(f"this message ({len(ids)} tokens with the template) and room for {room} new tokens "
                             f"exceed the context of {context} tokens")
        del messages[:2]
        dropped += 1
