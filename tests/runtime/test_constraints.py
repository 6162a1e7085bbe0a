"""Constraints without a model: specs and their errors (runtime/constraints.py), the grammar state over the model's
vocabulary, the one processing function (sampling.process_logits), and what a grammar does to proposals
(runtime/proposers/constrained.py)."""
import json
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from specrt.runtime.constraints import ConstraintError, ConstraintSpec, GrammarCompiler
from specrt.runtime.proposers import EMPTY, Proposal
from specrt.runtime.proposers.constrained import forced, prune
from specrt.runtime.sampling import SamplingError, SamplingParams, check_logit_bias, penalize, process_logits
from specrt.trees import compile_tree
from tiny import make_tokenizer

A, B, C, D, E = 1, 2, 3, 4, 5  # the tiny character tokenizer: id i is "abcde..."[i - 1]; id 0 is <eos> (special)


@pytest.fixture(scope="module")
def chars(tmp_path_factory):
    """The tests' character tokenizer (16 ids, a Fuse decoder llguidance cannot read itself)."""
    out = tmp_path_factory.mktemp("chars")
    make_tokenizer(out, 16)
    return Tokenizer.from_file(str(out / "tokenizer.json"))


@pytest.fixture(scope="module")
def bytelevel():
    """A byte-level BPE tokenizer (GPT-2 / SmolLM2 style, read by llguidance itself), EOS <|endoftext|> = 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ['{"name": "Bob", "age": 42}', '{"name": "Alice", "age": 7, "tags": ["x", "y"]}', "yes no maybe "] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    return tok


def ids(allowed) -> list:
    return None if allowed is None else np.flatnonzero(allowed).tolist()


# ---- specs and compile errors -----------------------------------------------------------------------
@pytest.mark.parametrize("kind,value,message", [
    ("xml", "<a/>", "kind must be one of"), ("regex", "", "non-empty string"), ("grammar", 3, "non-empty string"),
    ("choice", [], "non-empty list"), ("choice", ["a", 1], "non-empty list"), ("json_schema", "{}", "dict"),
    ("json_object", {}, "takes no value")], ids=str)
def test_bad_specs_are_refused(kind, value, message):
    with pytest.raises(ConstraintError, match=message):
        ConstraintSpec(kind, value)


@pytest.mark.parametrize("spec,message", [
    (ConstraintSpec("regex", "(ab"), "unclosed group"),
    (ConstraintSpec("json_schema", {"type": "foo"}), "Invalid type"),
    (ConstraintSpec("grammar", 'start: a\nb: "x"'), "unknown name"),
    (ConstraintSpec("grammar", 'root ::= yes" | "no"'), "GBNF")], ids=str)
def test_invalid_constraints_name_the_problem(chars, spec, message):
    with pytest.raises(ConstraintError, match=message) as e:
        GrammarCompiler(chars, 16).compile(spec)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400


def test_compile_budget(chars):
    with pytest.raises(ConstraintError, match="over the 0 s budget"):
        GrammarCompiler(chars, 16).compile(ConstraintSpec("regex", "[a-e]+"), max_seconds=0)


def test_compile_is_thread_safe(bytelevel):
    compiler = GrammarCompiler(bytelevel, 300, {0})
    specs = [ConstraintSpec("json_schema", {"type": "object", "properties": {f"k{i}": {"type": "integer"}},
                                            "required": [f"k{i}"]}) for i in range(8)]
    with ThreadPoolExecutor(4) as pool:
        grammars = list(pool.map(compiler.compile, specs))
    for i, g in enumerate(grammars):
        assert bytelevel.decode(g.matcher().forced()).startswith('{"k%d":' % i)


# ---- the grammar state over the model's vocabulary ---------------------------------------------------------
@pytest.mark.parametrize("eos", [[0], []], ids=["model-eos", "no-eos"])
def test_prefixes_do_not_move_the_committed_state(chars, eos):
    """Masks over a model vocabulary (20) larger than the tokenizer's (16): ids 16..19 never allowed; the
    grammar's end is the model's EOS id, or nothing when the model has none."""
    m = GrammarCompiler(chars, 20, eos).compile(ConstraintSpec("regex", "(ab|ba)c*")).matcher()
    end = eos
    assert ids(m.allowed(())) == [A, B] and m.forced() == []
    assert ids(m.allowed((A,))) == [B] and ids(m.allowed((B,))) == [A]
    assert ids(m.allowed((A, B))) == end + [C] and ids(m.allowed((A, B, C))) == end + [C]
    assert ids(m.allowed((A, C))) == []  # a prefix the grammar cannot reach allows nothing
    assert ids(m.allowed(())) == [A, B]  # the committed state never moved
    m.advance([A])
    assert m.forced() == [B] and ids(m.allowed(())) == [B] and ids(m.allowed((B,))) == end + [C]
    m.advance([B, C])
    assert ids(m.allowed(())) == end + [C] and not m.exhausted
    masks = m.masks([(), (C,), (C, C)])
    assert masks.shape == (3, 20) and not masks[:, 16:].any()


def test_a_complete_grammar_ends_through_eos_or_exhausts(chars):
    with_eos = GrammarCompiler(chars, 16, [0]).compile(ConstraintSpec("regex", "abc")).matcher()
    without = GrammarCompiler(chars, 16, []).compile(ConstraintSpec("regex", "abc")).matcher()
    for m in (with_eos, without):
        assert m.forced() == [A, B, C]
        m.advance([A, B, C])
    assert ids(with_eos.allowed(())) == [0] and not with_eos.exhausted
    assert ids(without.allowed(())) == [] and without.exhausted


def test_emitting_a_forbidden_token_is_a_bug_not_a_state(chars):
    m = GrammarCompiler(chars, 16, [0]).compile(ConstraintSpec("regex", "ab")).matcher()
    with pytest.raises(RuntimeError, match="against the grammar"):
        m.advance([C])


def test_json_schema_on_a_byte_level_tokenizer(bytelevel):
    """Keys and separators of a schema are forced tokens; any walk through the allowed tokens is valid JSON of
    the schema, ended by the model's EOS."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    g = GrammarCompiler(bytelevel, 320, {0}).compile(ConstraintSpec("json_schema", schema))
    assert bytelevel.decode(g.matcher().forced()) == '{"name":'  # (then ' "' or ' "B' ...: two tokenizations)
    rng = np.random.default_rng(0)
    for _ in range(5):
        m, out = g.matcher(), []
        while not out or out[-1] != 0:
            tok = m.forced()[:1] or [int(rng.choice(np.flatnonzero(m.allowed(()))))]
            out += tok
            if tok != [0]:
                m.advance(tok)
            assert len(out) < 400
        value = json.loads(bytelevel.decode(out[:-1]))
        assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    assert not g.matcher().allowed(())[300:].any()  # ids past the tokenizer's never


def test_choice_json_object_and_gbnf(bytelevel):
    compiler = GrammarCompiler(bytelevel, 300, {0})
    choice = compiler.compile(ConstraintSpec("choice", ["yes", "no"])).matcher()
    firsts = {bytelevel.decode([t]) for t in ids(choice.allowed(()))}
    assert firsts and all("yes".startswith(f) or "no".startswith(f) for f in firsts)
    gbnf = compiler.compile(ConstraintSpec("grammar", 'root ::= "yes" | "no"')).matcher()
    lark = compiler.compile(ConstraintSpec("grammar", 'start: "yes" | "no"')).matcher()
    assert ids(gbnf.allowed(())) == ids(lark.allowed(())) == ids(choice.allowed(()))
    obj = compiler.compile(ConstraintSpec("json_object")).matcher()
    assert {bytelevel.decode([t]) for t in ids(obj.allowed(()))} <= {"{", '{"'}


# ---- process_logits: penalties, logit_bias, min_tokens, the grammar's mask -----------------------------------
def row_of(params, seq, prompt_len, end_ids=(0,), matcher=None):
    return SimpleNamespace(params=params, seq=list(seq), prompt_len=prompt_len, end_ids=set(end_ids), matcher=matcher)


def test_nothing_to_do_returns_the_logits_themselves():
    logits = np.zeros((2, 8), np.float32)
    assert process_logits(logits, row_of(SamplingParams(temperature=1.0), [1, 2], 1)) is logits


def test_bias_min_tokens_and_mask_per_position(chars):
    """Position i's history is seq + prefixes[i]: min_tokens counts it, the grammar's mask follows it."""
    m = GrammarCompiler(chars, 16, [0]).compile(ConstraintSpec("regex", "[a-e]*")).matcher()
    m.advance([A])
    params = SamplingParams(temperature=1.0, logit_bias={C: 5.0, D: -100}, min_tokens=3, presence_penalty=1.0)
    row = row_of(params, [7, 7, A], 2, matcher=m)  # one token generated
    logits = np.random.default_rng(0).normal(size=(3, 16)).astype(np.float32)
    prefixes = [[], [B], [B, C]]
    got = process_logits(logits, row, prefixes)
    want = penalize(logits, params, row.seq, 2, prefixes)
    want[:, C] += 5.0
    want[:, D] -= 100
    want[:, 6:] = -np.inf  # outside [a-e]
    want[:2, 0] = -np.inf  # EOS before 3 tokens: positions 0 and 1 (1 and 2 tokens generated), not 2
    np.testing.assert_allclose(got, want)


def test_a_complete_grammar_wins_over_min_tokens(chars):
    m = GrammarCompiler(chars, 16, [0]).compile(ConstraintSpec("regex", "ab")).matcher()
    m.advance([A])
    row = row_of(SamplingParams(min_tokens=5, max_new_tokens=8), [9, A], 1, matcher=m)
    x = process_logits(np.zeros((2, 16), np.float32), row, [[], [B]])
    assert np.flatnonzero(np.isfinite(x[0])).tolist() == [B]  # min_tokens alone
    assert np.flatnonzero(np.isfinite(x[1])).tolist() == [0]  # after "ab" only EOS: the grammar wins


@pytest.mark.parametrize("bad,message", [({-1: 1.0}, "integers >= 0"), ({True: 1.0}, "integers >= 0"),
                                         ({3: 101}, r"\[-100, 100\]"), ({"3": 1.0}, "integers >= 0"),
                                         ("x", "map token ids")], ids=str)
def test_bad_logit_bias_is_refused(bad, message):
    with pytest.raises(SamplingError, match=message):
        SamplingParams(logit_bias=bad)


def test_logit_bias_and_min_tokens_values():
    p = SamplingParams(logit_bias={5: 1, 2: -3.5}, min_tokens=2, max_new_tokens=4)
    assert p.logit_bias == ((2, -3.5), (5, 1.0)) and hash(p)
    with pytest.raises(SamplingError, match="outside the vocabulary"):
        check_logit_bias(p.logit_bias, vocab_size=5)
    with pytest.raises(SamplingError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_new_tokens=4)


# ---- what a grammar does to proposals ---------------------------------------------------------------------------
@pytest.fixture
def ab_c(chars):
    return GrammarCompiler(chars, 16, [0]).compile(ConstraintSpec("regex", "(ab|ba)c*")).matcher()


def test_a_chain_is_cut_at_its_first_forbidden_token(ab_c):
    q = np.full((4, 16), 1 / 16)
    p = prune(Proposal(np.array([A, B, C, A]), q), ab_c)
    assert p.tokens.tolist() == [A, B, C] and p.q.shape == (3, 16)
    assert prune(Proposal(np.array([C, A])), ab_c).tokens.tolist() == []
    whole = Proposal(np.array([B, A, C]))
    assert prune(whole, ab_c) is whole and prune(whole, None) is whole


def test_a_tree_loses_forbidden_nodes_and_their_subtrees(ab_c):
    tree = compile_tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])  # nodes 1..7 in this order
    tokens = np.array([A, C, B, B, C, A, C])  # a, c(x), b | a->b, a->c(x), c->a(x: parent gone) | a->b->c
    p = prune(Proposal(tokens, None, tree), ab_c)
    assert [list(c) for c in p.tree.choices] == [[0], [2], [0, 0], [0, 0, 0]]
    assert p.tokens.tolist() == [A, B, B, C] and p.tree.parents.tolist() == [-1, 0, 0, 1, 3]
    assert prune(Proposal(np.array([C, C]), None, compile_tree([[0], [1]])), ab_c) is EMPTY


def test_forced_tokens_are_a_chain_of_point_masses(chars):
    m = GrammarCompiler(chars, 16, [0]).compile(ConstraintSpec("regex", "abcd(e|a)")).matcher()
    p = forced(m, 3)
    assert p.tokens.tolist() == [A, B, C] and p.q is None and p.forced
    assert forced(m, 0) is None
    m.advance([A, B, C, D])
    assert forced(m, 3) is None  # two continuations: nothing forced
