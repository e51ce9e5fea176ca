"""Incremental detokenization: UTF-8 safety, context, stop strings."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.worker.engine_fakes import ByteTokenizer
from worker.engine.detokenizer import IncrementalDetokenizer

BYTES = ByteTokenizer()


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add([i]) for i in ids]


def test_multibyte_characters_are_held_until_complete():
    text = "a€b😀"
    deltas = stream(IncrementalDetokenizer(BYTES), list(text.encode()))
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[1:4] == ["", "", "€"]  # € is three bytes


@settings(max_examples=80, deadline=None)
@given(st.text(min_size=1, max_size=30))
def test_any_text_streams_back_exactly(text):
    detok = IncrementalDetokenizer(BYTES)
    assert "".join(stream(detok, list(text.encode()))) + detok.flush() == text


def test_unfinished_character_at_the_end_is_flushed_as_replacement():
    detok = IncrementalDetokenizer(BYTES)
    ids = list("ok€".encode())[:-1]
    assert "".join(stream(detok, ids)) == "ok"
    assert detok.flush() == "\ufffd"


def test_stop_string_across_tokens_cuts_the_text():
    detok = IncrementalDetokenizer(BYTES, stop=["END"])
    deltas = stream(detok, list(b"abcENxyENDtail"))
    assert "".join(deltas) == "abcENxy"
    assert deltas[3:5] == ["", ""]  # "E", "EN" held: could start "END"
    assert detok.stopped and detok.text == "abcENxy"
    assert detok.add([65]) == "" and detok.flush() == ""


def test_partial_stop_match_is_released_at_the_end():
    detok = IncrementalDetokenizer(BYTES, stop=["STOP"])
    assert "".join(stream(detok, list(b"hi ST"))) == "hi "
    assert detok.flush() == "ST" and not detok.stopped


def test_the_earliest_of_several_stop_strings_wins():
    detok = IncrementalDetokenizer(BYTES, stop=["xyz", "y"])
    assert "".join(stream(detok, list(b"abxyz"))) == "abx"


def _bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["hello world, héllo wörld! 你好世界 😀 emoji 🚀 rocket"] * 50
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=300,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    return tok


def test_with_a_byte_level_bpe_tokenizer_and_prompt_context():
    tok = _bpe()
    prompt = tok.encode("hello ").ids
    text = "world, 你好世界 😀 🚀 rocket héllo"
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    deltas = stream(detok, ids)
    assert "".join(deltas) + detok.flush() == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
