"""Incremental detokenization: the released text is the whole answer decoded at once, cut at the first stop
string, and each token costs a decode of a short window (not of the whole answer)."""

from __future__ import annotations

import random

import pytest

from specprefill_rag.decode.detokenize import IncrementalText
from specprefill_rag.testing import build_family_tokenizer


def whole_text(tokenizer, token_ids, visible):
    """The reference: runs between visible markers decoded at once, each marker as its text."""
    pieces, run = [], []
    for token in token_ids:
        if token in visible:
            pieces += [tokenizer.decode(run, skip_special_tokens=True), visible[token]]
            run = []
        else:
            run.append(token)
    return "".join([*pieces, tokenizer.decode(run, skip_special_tokens=True)])


def stream(tokenizer, token_ids, stop=(), visible=None):
    """Push every token (until a stop); the deltas, the finish text and how many tokens were pushed."""
    text = IncrementalText(tokenizer, stop, visible)
    deltas = []
    for pushed, token in enumerate(token_ids, 1):
        deltas.append(text.push(token))
        if text.stopped:
            return deltas, text.finish(), pushed
    return deltas, text.finish(), len(token_ids)


def expected_stop(tokenizer, token_ids, stop, visible):
    """(tokens pushed, final text) by the reference: the first prefix whose text holds a stop string."""
    for count in range(1, len(token_ids) + 1):
        text = whole_text(tokenizer, token_ids[:count], visible)
        cuts = [i for i in (text.find(s) for s in stop) if i >= 0]
        if cuts and not text.endswith("\ufffd"):
            return count, text[: min(cuts)]
    return len(token_ids), whole_text(tokenizer, token_ids, visible)


@pytest.fixture(scope="module")
def tokenizer():
    return build_family_tokenizer("chatml")


def test_random_tokens_give_the_whole_decode(tokenizer):
    """Random ids, special tokens and raw bytes among them (byte-level BPE: incomplete UTF-8 characters)."""
    rng = random.Random(0)
    for _ in range(60):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 40))]
        deltas, tail, _ = stream(tokenizer, ids)
        assert "".join(deltas) + tail == whole_text(tokenizer, ids, {})


def test_characters_split_across_tokens_are_released_whole(tokenizer):
    answer = "Paris: héllo, 世界 🎉 and ≥ 3 km²."
    ids = tokenizer.encode(answer, add_special_tokens=False)
    deltas, tail, _ = stream(tokenizer, ids)
    assert "".join(deltas) + tail == answer
    assert not any("\ufffd" in delta for delta in deltas)
    assert len(ids) > len(answer.encode()) // 4  # the multi-byte characters really span several tokens


def test_stop_strings_cut_where_the_whole_text_would(tokenizer):
    rng = random.Random(1)
    words = ["the bridge", " opened", " in 1883", "\n\nQuestion:", " END", " 世界", " fox"]
    for _ in range(40):
        answer = "".join(rng.choice(words) for _ in range(rng.randrange(2, 12)))
        ids = tokenizer.encode(answer, add_special_tokens=False)
        stop = tuple(rng.sample(["Question:", "END", "界 f", "1883", "\n\n"], 2))
        deltas, tail, pushed = stream(tokenizer, ids, stop)
        assert (pushed, "".join(deltas) + tail) == expected_stop(tokenizer, ids, stop, {})


def test_text_that_could_become_a_stop_string_is_held_back(tokenizer):
    text = IncrementalText(tokenizer, ("STOP",))
    released = "".join(text.push(t) for t in tokenizer.encode("fox ST", add_special_tokens=False))
    assert released == "fox " and not text.stopped
    assert text.finish() == "ST"


def test_visible_markers_are_text_and_split_the_decoding(tokenizer):
    marker = tokenizer.convert_tokens_to_ids("<|im_start|>")
    visible = {marker: "[CALLS]"}
    before = tokenizer.encode("The fox é", add_special_tokens=False)
    after = tokenizer.encode(" jumps 世界", add_special_tokens=False)
    ids = [*before[:-1], marker, *after]  # the marker cuts a character short: its bytes decode as they stand
    deltas, tail, _ = stream(tokenizer, ids, visible=visible)
    assert "".join(deltas) + tail == whole_text(tokenizer, ids, visible)
    assert "[CALLS]" in "".join(deltas)


class CountingTokenizer:
    """A tokenizer that counts the token ids it is asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, token_ids, **kwargs):
        self.decoded += len(token_ids)
        return self.tokenizer.decode(token_ids, **kwargs)


def test_each_token_decodes_a_short_window(tokenizer):
    """A 2,000-token answer: the ids decoded grow linearly (the whole answer each time would be ~2 million)."""
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 200, add_special_tokens=False)[:2000]
    counting = CountingTokenizer(tokenizer)
    deltas, tail, _ = stream(counting, ids, stop=("never there",))
    assert "".join(deltas) + tail == tokenizer.decode(ids)
    assert counting.decoded < 8 * len(ids)


def test_a_marker_that_is_also_text_appears_once():
    """Qwen's ``<tool_call>`` is an added token that decodes as its own text too."""
    qwen = build_family_tokenizer("qwen3")
    marker = qwen.convert_tokens_to_ids("<tool_call>")
    ids = qwen.encode('Look.\n<tool_call>\n{"name": "f"}', add_special_tokens=False)
    deltas, tail, _ = stream(qwen, ids, visible={marker: "<tool_call>"})
    assert "".join(deltas) + tail == 'Look.\n<tool_call>\n{"name": "f"}'
