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
