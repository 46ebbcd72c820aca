"""Oracle tests of the three token-F1 definitions (../shared/datasets/protocol/F1_DEFINITIONS.md).

Every expected number below was worked out by hand from the written definitions (the working is
in the comments), not by running the code under test.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tmem.eval.f1 import (
    F1_VARIANTS,
    f1_all,
    f1_mem0,
    f1_memos,
    f1_official,
    f1_score,
    mem0_tokens,
    memos_tokens,
    normalize_official,
    official_tokens,
)
from tmem.eval.nlp import measure, porter_stem, split_sentences, word_tokenize

# --------------------------------------------------------------------------- Porter stemmer (NLTK mode)

STEMS = [
    ("caresses", "caress"),  # 1a: sses -> ss
    ("ponies", "poni"),  # 1a: ies -> i (6 letters, not the 4-letter rule)
    ("ties", "tie"),  # NLTK: 4-letter -ies -> -ie
    ("cats", "cat"),  # 1a: s -> ''
    ("feed", "feed"),  # 1b: eed needs m(f) > 0; m = 0, and no ed-rule after it
    ("agreed", "agre"),  # 1b: agr+ee (m=1); 5a: agre has m=1 and agr-e is not cvc -> drop e
    ("hopping", "hop"),  # 1b: hopp (vowel in stem); double p -> hop
    ("falling", "fall"),  # 1b: double l is kept
    ("filing", "file"),  # 1b: fil has m=1 and is cvc -> +e
    ("sitting", "sit"),  # 1b: sitt -> sit
    ("happy", "happi"),  # 1c: y after consonant p -> i
    ("say", "say"),  # 1c: y after a vowel stays
    ("relational", "relat"),  # 2: ational -> ate (relate); 4: ate needs m>1 (rel m=1) no; 5a: relat m=2 -> drop e
    ("rational", "ration"),  # 2: ational matches but m(r)=0 -> stop; 4: al with m(ration)=2 -> ration
    ("hopefulness", "hope"),  # 2: fulness -> ful; 3: ful -> '' (m(hope)=1)
    ("adoption", "adopt"),  # 4: ion after t with m(adopt)=2
    ("likely", "like"),  # 1c: likeli; 2: eli -> e (m(lik)=1); 5a: lik is cvc -> keep e
    ("dying", "die"),  # NLTK irregular form
    ("cried", "cri"),  # NLTK: -ied on a long word -> -i
    ("died", "die"),  # NLTK: 4-letter -ied -> -ie
    ("sky", "sky"),  # NLTK irregular form
    ("by", "by"),  # NLTK: words of <= 2 letters are kept
    ("roll", "roll"),  # 5b: ll -> l needs m(rol) > 1; m = 1
    ("controll", "control"),  # 5b: m(control)=2 -> drop one l
    ("geology", "geolog"),  # 1c: geologi; 2 (NLTK): logi -> log, measure taken on "geol"
    ("yes", "ye"),  # 1a: s -> ''
]


@pytest.mark.parametrize(("word", "stem"), STEMS)
def test_porter_stem_matches_hand_worked_examples(word: str, stem: str) -> None:
    assert porter_stem(word) == stem


def test_measure_counts_vowel_consonant_pairs() -> None:
    # Porter's own examples: m=0 tr, ee, tree, y, by; m=1 trouble, oats, trees, ivy; m=2 troubles, private, oaten.
    assert [measure(w) for w in ("tr", "ee", "tree", "y", "by")] == [0, 0, 0, 0, 0]
    assert [measure(w) for w in ("trouble", "oats", "trees", "ivy")] == [1, 1, 1, 1]
    assert [measure(w) for w in ("troubles", "private", "oaten")] == [2, 2, 2]


# --------------------------------------------------------------------------- Treebank-style tokens


def test_word_tokenize_splits_punctuation_clitics_and_quotes() -> None:
    # Two sentences (period, then a capitalised word); the comma, final period, '!' and the
    # clitic n't stand alone; the opening " becomes `` and the closing one ''.
    assert word_tokenize('She said, "I can\'t go." Then she left!') == [
        "She", "said", ",", "``", "I", "ca", "n't", "go", ".", "''", "Then", "she", "left", "!",
    ]
    # 's is split off; a comma inside a number and a colon in a time stay; brackets stand alone.
    assert word_tokenize("caroline's 1,000 people at 10:30 (roughly)") == [
        "caroline", "'s", "1,000", "people", "at", "10:30", "(", "roughly", ")",
    ]


def test_sentences_do_not_break_after_abbreviations_or_initials() -> None:
    assert split_sentences("mr. smith went home. he slept.") == ["mr. smith went home.", "he slept."]
    assert word_tokenize("mr. smith went home. he slept.") == ["mr.", "smith", "went", "home", ".", "he", "slept", "."]
    assert word_tokenize("j. k. rowling") == ["j.", "k.", "rowling"]


# --------------------------------------------------------------------------- official LoCoMo


def test_official_normalisation_drops_commas_punctuation_articles_and_and() -> None:
    assert normalize_official("The cat, and a dog!") == "cat dog"
    assert official_tokens("Caroline's dogs") == ["carolin", "dog"]  # apostrophe removed, then stemmed


def test_official_f1_single_hop_hand_worked() -> None:
    # pred  "The cat sat on the mat."  -> "cat sat on mat" -> [cat, sat, on, mat]
    # gold  "A cat sitting on a mat"   -> "cat sitting on mat" -> [cat, sit, on, mat]
    # overlap 3 (cat, on, mat): P = 3/4, R = 3/4, F1 = 0.75
    assert f1_official("The cat sat on the mat.", "A cat sitting on a mat", "single-hop") == pytest.approx(0.75)


def test_official_f1_counts_repeats_as_a_multiset() -> None:
    # [pari, pari] vs [pari]: overlap min(2, 1) = 1; P = 1/2, R = 1 -> F1 = 2(1/2)/(3/2) = 2/3
    assert f1_official("Paris Paris", "Paris", "temporal") == pytest.approx(2 / 3)


def test_official_f1_multi_hop_averages_gold_parts() -> None:
    # gold parts ["painting", "swimming"], pred parts ["swimming"]:
    # painting: best F1 0 (paint vs swim); swimming: 1 -> mean 0.5
    assert f1_official("swimming", "painting, swimming", "multi-hop") == pytest.approx(0.5)
    # the same strings as one answer: [swim] vs [paint, swim]: P = 1, R = 1/2 -> 2/3
    assert f1_official("swimming", "painting, swimming", "single-hop") == pytest.approx(2 / 3)


def test_official_f1_open_domain_cuts_gold_at_semicolon() -> None:
    # gold "Likely yes; she enjoys art" -> "Likely yes" -> [like, ye]; pred [like, ye] -> 1.0
    assert f1_official("likely yes", "Likely yes; she enjoys art", "open-domain") == pytest.approx(1.0)
    # uncut: gold [like, ye, she, enjoy, art]: P = 1, R = 2/5 -> F1 = 0.8 / 1.4 = 4/7
    assert f1_official("likely yes", "Likely yes; she enjoys art", "single-hop") == pytest.approx(4 / 7)


def test_official_adversarial_checks_the_refusal_phrase() -> None:
    assert f1_official("Not mentioned in the conversation", "", "adversarial") == 1.0
    assert f1_official("No information available.", "", "adversarial") == 1.0
    assert f1_official("She went to Paris", "", "adversarial") == 0.0


# --------------------------------------------------------------------------- the three side by side


def test_three_variants_differ_on_the_same_answer() -> None:
    # pred "Caroline and Melanie", gold "Melanie, Caroline"
    # official: "and" and the comma go -> [carolin, melani] both sides -> 1.0
    # mem0:     {caroline, and, melanie} vs {melanie, caroline}: 2 shared; P = 2/3, R = 1 -> 0.8
    # memos:    {caroline, and, melanie} vs {melanie, ",", caroline}: P = 2/3, R = 2/3 -> 2/3
    scores = f1_all("Caroline and Melanie", "Melanie, Caroline", "single-hop")
    assert scores == {"official": pytest.approx(1.0), "mem0": pytest.approx(0.8), "memos": pytest.approx(2 / 3)}


def test_memos_keeps_punctuation_tokens_mem0_drops_commas() -> None:
    # pred "May 7, 2023" vs gold "7 May 2023"
    # memos: {may, 7, ",", 2023} vs {7, may, 2023}: P = 3/4, R = 1 -> 6/7
    # mem0:  the comma becomes a space -> {may, 7, 2023} both -> 1.0; official: commas deleted -> 1.0
    assert memos_tokens("May 7, 2023") == ["may", "7", ",", "2023"]
    assert f1_memos("May 7, 2023", "7 May 2023", "temporal") == pytest.approx(6 / 7)
    assert f1_mem0("May 7, 2023", "7 May 2023", "temporal") == pytest.approx(1.0)
    assert f1_official("May 7, 2023", "7 May 2023", "temporal") == pytest.approx(1.0)


def test_apostrophes_stay_in_mem0_tokens_and_split_in_memos() -> None:
    # mem0: [caroline's, dog] vs [caroline's, dog] ('.' -> space) -> 1.0
    # memos: [caroline, 's, dog] vs [caroline, 's, dog, .]: P = 1, R = 3/4 -> 6/7
    assert mem0_tokens("caroline's dog.") == ["caroline's", "dog"]
    assert f1_mem0("Caroline's dog", "caroline's dog.", "single-hop") == pytest.approx(1.0)
    assert f1_memos("Caroline's dog", "caroline's dog.", "single-hop") == pytest.approx(6 / 7)


def test_set_variants_ignore_repeats_and_empty_strings_score_zero() -> None:
    assert f1_mem0("the cat", "the the cat", "single-hop") == pytest.approx(1.0)
    assert f1_mem0("", "Paris", "single-hop") == 0.0
    assert f1_memos("", "Paris", "single-hop") == 0.0
    assert f1_official("", "Paris", "single-hop") == 0.0


def test_unscored_categories_return_none() -> None:
    assert f1_all("I remember your trip!", "", "cognitive") == {"official": None, "mem0": None, "memos": None}
    assert f1_mem0("Not mentioned", "", "adversarial") is None
    assert f1_memos("Not mentioned", "", "adversarial") is None
    with pytest.raises(ValueError, match="unknown F1 variant"):
        f1_score("a", "b", "single-hop", "bleu")  # type: ignore[arg-type]


WORDS = st.lists(st.sampled_from(["cat", "dog", "Paris", "may", "7", "2023", "the", "and", "ran", "running", ","]),
                 min_size=1, max_size=6).map(" ".join)


@given(pred=WORDS, gold=WORDS)
def test_scores_are_in_unit_interval_and_set_variants_symmetric(pred: str, gold: str) -> None:
    for variant in F1_VARIANTS:
        value = f1_score(pred, gold, "single-hop", variant)
        assert value is not None and 0.0 <= value <= 1.0
    for variant in ("mem0", "memos"):
        assert math.isclose(f1_score(pred, gold, "temporal", variant) or 0.0,  # type: ignore[arg-type]
                            f1_score(gold, pred, "temporal", variant) or 0.0)  # type: ignore[arg-type]


@given(text=WORDS)
def test_an_answer_equal_to_the_gold_scores_one_when_it_has_tokens(text: str) -> None:
    assert f1_mem0(text, text, "single-hop") == pytest.approx(1.0 if mem0_tokens(text) else 0.0)
    assert f1_memos(text, text, "single-hop") == pytest.approx(1.0)
    assert f1_official(text, text, "single-hop") == pytest.approx(1.0 if official_tokens(text) else 0.0)
