"""Sentence starts from a prompt's text and token offsets (chunking="sentences")."""

import re

import torch

from specprefill_rag.prompt.sentences import boundary_chars, sentence_starts


def words(text: str) -> torch.Tensor:
    """``[L, 2]`` offsets of a GPT-style tokenization: words and punctuation runs with their leading space, line
    breaks alone."""
    return torch.tensor([match.span() for match in re.finditer(r" ?\w+| ?[^\w\s]+|\s+", text)])


def test_a_sentence_starts_at_the_token_after_its_punctuation_or_line_break():
    text = 'It was found in 1799. "Who found it?" French soldiers (near Rashid.) Later\n\nA heading\nand more'
    offsets = words(text)
    starts = sentence_starts(text, offsets)
    first_words = [text[start:end].strip() for (start, end), is_start in zip(offsets.tolist(), starts) if is_start]
    assert first_words == ['"', "French", "Later", "A", "and"]


def test_decimals_and_inner_punctuation_are_not_ends():
    assert boundary_chars("Pi is 3.14 and e.g. that, or not; fine").tolist() == [19]  # "e.g." before a space
    assert boundary_chars("No end here").tolist() == []


def test_a_token_that_carries_the_punctuation_and_the_space_is_not_a_start_but_the_next_one_is():
    text = "One. Two"
    offsets = torch.tensor([[0, 3], [3, 5], [5, 8]])  # "One", ". ", "Two"
    assert sentence_starts(text, offsets).tolist() == [False, False, True]


def test_full_width_stops_end_sentences_without_a_space():
    text = "石碑は1799年に見つかった。「誰が？」フランス兵だ！"
    assert [text[end - 1] for end in boundary_chars(text).tolist()] == ["。", "」", "！"]
