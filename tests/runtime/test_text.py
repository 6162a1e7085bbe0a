from specrt.runtime.text import StopMatcher


def test_stop_matcher_holds_back_possible_prefix():
    m = StopMatcher(["END"])
    assert m.feed("abcE") == "ab"  # the last len("END") - 1 chars are held back
    assert m.feed("N") == "c"
    assert not m.hit
    assert m.feed("Dxyz") == ""  # "END" completed: nothing of it, nor after it, is emitted
    assert m.hit and m.flush() == ""


def test_stop_matcher_split_across_deltas_and_flush():
    m = StopMatcher(["\n\n"])
    out = m.feed("line1\n") + m.feed("\nline2")
    assert out == "line1" and m.hit
    m = StopMatcher(["zz"])
    assert m.feed("abz") + m.flush() == "abz" and not m.hit


def test_no_stops_passthrough():
    m = StopMatcher([])
    assert m.feed("abc") == "abc" and m.flush() == ""


def byte_level_tokenizer():
    """A byte-level BPE with no merges: every UTF-8 byte is its own token (a 2-byte character spans 2 tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def test_detokenizer_deltas_add_up_to_decode_and_hold_split_characters():
    from specrt.runtime.text import IncrementalDetokenizer

    tok = byte_level_tokenizer()
    text = "déjà vu — 日本 ok"
    ids = tok.encode(text).ids
    d = IncrementalDetokenizer(tok)
    deltas = [d.add(i) for i in ids]
    assert "".join(deltas) + d.flush() == tok.decode(ids) == text
    first = ids.index(tok.encode("é").ids[0])
    assert deltas[first] == "" and deltas[first + 1] == "é"  # held until its second byte arrives


def test_detokenizer_flush_returns_an_incomplete_tail():
    from specrt.runtime.text import IncrementalDetokenizer

    tok = byte_level_tokenizer()
    d = IncrementalDetokenizer(tok)
    ids = tok.encode("aé").ids
    assert d.add(ids[0]) == "a" and d.add(ids[1]) == ""  # the first byte of é
    assert d.flush() == tok.decode(ids[1:2])  # what decode makes of it (a replacement character)
