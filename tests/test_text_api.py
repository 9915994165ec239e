"""Text in, text out: ``Session.generate("...")`` and ``Session.chat(messages)``, streamed or whole, checked against
the id-level API and the tokenizer they wrap (the default model, SmolLM2-135M-Instruct, whose turns end with the
special token <|im_end|>)."""
import pytest

import tmac
from conftest import smollm2_path
from tmac.models.text.stream import TextStream, check_prompt_size

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def model():
    return tmac.load_model(smollm2_path(), context=512, progress=False)


def test_chat_answers_in_text_without_the_end_of_turn_token(model):
    session = tmac.Session(model)
    tok = model.tokenizer
    ids = tmac.Session(model).generate(tok.encode(tok.render_chat(QUESTION)), max_new_tokens=48, temperature=0)
    assert ids[-1] in tok.stop_ids  # the model ends its turn within 48 tokens, with the special token
    answer = session.chat(QUESTION, max_new_tokens=48, temperature=0)
    assert answer == tok.decode(ids[:-1]) and "<|im_end|>" not in answer and "Paris" in answer
    assert session.stats["stop_reason"] == "eos"
    # streamed: the same text, in more than one piece
    pieces = list(tmac.Session(model).chat(QUESTION, max_new_tokens=48, stream=True, temperature=0))
    assert len(pieces) > 1 and "".join(pieces) == answer


def test_generate_from_text_is_the_decoded_ids(model):
    tok = model.tokenizer
    prompt = "The three primary colors are"
    ids = tmac.Session(model).generate(tok.encode(prompt), max_new_tokens=12, ignore_eos=True, temperature=0)
    text = tmac.Session(model).generate(prompt, max_new_tokens=12, ignore_eos=True, temperature=0)
    assert isinstance(text, str) and text == tok.decode(ids, skip_special=True)
    streamed = tmac.Session(model).generate(prompt, max_new_tokens=12, ignore_eos=True, temperature=0, stream=True)
    assert not isinstance(streamed, (str, list)) and "".join(streamed) == text
    assert list(tmac.Session(model).generate(tok.encode(prompt), max_new_tokens=12, ignore_eos=True, temperature=0,
                                             stream=True)) == ids


def test_stop_string_ends_the_text_before_it(model):
    tok = model.tokenizer
    full = tmac.Session(model).chat(QUESTION, max_new_tokens=48, temperature=0)
    stop = "Paris"
    assert stop in full
    cut = tmac.Session(model).chat(QUESTION, max_new_tokens=48, stop=stop, temperature=0)
    assert cut == full[:full.index(stop)]
    session = tmac.Session(model)
    assert "".join(session.chat(QUESTION, max_new_tokens=48, stop=[stop], stream=True, temperature=0)) == cut
    assert session.stats["stop_reason"] == "stop"
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        tmac.Session(model).chat(QUESTION, stop="")
    with pytest.raises(ValueError, match="max_tokens"):  # checked at the call, before any piece is asked for
        tmac.Session(model).chat(QUESTION, max_new_tokens=-1, stream=True)
    assert tok.decode(tok.encode(cut)) == cut


def test_chat_continues_a_conversation_with_only_the_new_turn_prefilled(model):
    session = tmac.Session(model)
    first = session.chat(QUESTION, max_new_tokens=32, temperature=0)
    turns = QUESTION + [{"role": "assistant", "content": first}, {"role": "user", "content": "And of Italy?"}]
    second = session.chat(turns, max_new_tokens=32, temperature=0)
    assert second and session.stats["prefill_tokens"] < session.stats["prompt_tokens"]
    assert second == tmac.Session(model).chat(turns, max_new_tokens=32, temperature=0)  # the same as from scratch


class _Bytes:
    """A tokenizer whose ids are bytes (256: a special token), to test what TextStream releases."""

    def decode(self, ids, skip_special=False):
        data = bytes(i for i in ids if i < 256)
        return data.decode("utf-8", errors="replace") + ("" if skip_special else "<end>" * ids.count(256))


def test_text_stream_holds_back_half_characters_and_forming_stop_strings():
    stream = TextStream(_Bytes(), stop=("STOP",))
    pieces = [stream.push(b) for b in "ab é".encode()]
    assert pieces == ["a", "b", " ", "", "é"]  # é's first byte is held until its second
    assert [stream.push(b) for b in b"ST"] == ["", ""]  # maybe the start of STOP
    assert stream.push(ord("x")) == "STx"  # it was not
    assert [stream.push(b) for b in b"STOP!"] == ["", "", "", "", ""] and stream.stopped
    assert stream.finish() == "" and stream.text() == "ab éSTx"
    plain = TextStream(_Bytes())
    assert [plain.push(t) for t in (104, 105, 256)] == ["h", "i", ""] and plain.finish() == ""


def test_two_sessions_on_one_model_interleaved_token_by_token_each_give_what_they_give_alone(model):
    """Each Session owns a Sequence (its KV cache and tokens): two streams on one model, advanced in turns, do not
    disturb each other; the first session uses the model's own cache, the second one of its own."""
    tok = model.tokenizer
    prompts = [tok.encode(tok.render_chat([{"role": "user", "content": q}]))
               for q in ("What is the capital of France?", "Name three colors.")]
    alone = [tmac.Session(model).generate(p, max_new_tokens=12, ignore_eos=True, temperature=0) for p in prompts]
    first, second = tmac.Session(model), tmac.Session(model)
    streams = [first.generate(prompts[0], max_new_tokens=12, ignore_eos=True, temperature=0, stream=True),
               second.generate(prompts[1], max_new_tokens=12, ignore_eos=True, temperature=0, stream=True)]
    together = [[], []]
    for _ in range(12):
        for i, stream in enumerate(streams):
            together[i].append(next(stream))
    assert together == alone and first.sequence.k is not second.sequence.k
    # and each continues its own conversation: only the new turn is prefilled
    again = first.generate(prompts[0] + together[0] + tok.encode(" And Italy?"),
            max_new_tokens=4, ignore_eos=True, temperature=0)
    assert first.stats["prefill_tokens"] < 8 and len(again) == 4


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_it_is_tokenized(model):
    """At least one character a token and at most the vocabulary's longest: a prompt of more characters than the
    context times the longest cannot fit and is refused; one of no more characters than the context fits whatever
    the vocabulary holds, so its size is known without walking the vocabulary."""
    tok = model.tokenizer
    longest = max(len(tok.backend.id_to_token(i)) for i in range(tok.vocab_size))
    assert tok.longest_token == longest
    with pytest.raises(ValueError, match=f"more than a context of 8 tokens can hold .at most {8 * longest},"):
        check_prompt_size(tok, 8 * longest + 1, 8)
    check_prompt_size(tok, 8 * longest, 8)

    class Unwalked:  # (the vocabulary's longest asked for: the test fails)
        @property
        def longest_token(self):
            raise AssertionError("the vocabulary was walked for a prompt that fits any tokenization")

    check_prompt_size(Unwalked(), 8, 8)
