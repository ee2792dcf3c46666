"""What a byte-bounded cache keeps: least recently used first out, with TinyLFU admission (issue #44)."""

import pytest
import torch
from torch import nn

from specprefill_rag.draft.document_cache import PREFIX_ENTRY, DocumentKey, DocumentKVCache
from specprefill_rag.kvcache.admission import MIN_SAMPLE, FrequencySketch, KeptEntries
from specprefill_rag.kvcache.prefix_cache import DraftIdentity


def looked_up(kept, key, times=1):
    for _ in range(times):
        kept.looked_up(key)


def test_the_sketch_never_counts_fewer_lookups_and_halves():
    sketch = FrequencySketch(width=64)  # small: collisions happen, and may only raise a count
    counts = {f"doc-{i}": i % 7 for i in range(40)}
    for key, count in counts.items():
        for _ in range(count):
            sketch.add(key)
    assert all(sketch.estimate(key) >= count for key, count in counts.items())
    wide = FrequencySketch()
    for _ in range(20):
        wide.add("popular")
    wide.add("once")
    assert wide.estimate("popular") == wide.limit == 15 and wide.estimate("once") == 1
    assert wide.estimate("never") == 0
    wide.halve()
    assert wide.estimate("popular") == 7 and wide.estimate("once") == 0


def test_the_sketch_rows_collide_independently():
    """Two keys sharing a slot in one row almost never share one in another: the rows are what keep a count-min
    sketch from over-counting. Keys shaped like a ``DocumentKey`` (nested tuples), of ints so their hashes do not
    depend on the process's hash seed; hashing ``(row, key)`` put 152 of 343 such pairs in the same slot of every
    row."""
    sketch = FrequencySketch()
    keys = [((1, 2), None, i, i * 31) for i in range(4000)]
    slots = [sketch._slots(key) for key in keys]
    by_first_row: dict[int, list[int]] = {}
    for index, row_slots in enumerate(slots):
        by_first_row.setdefault(row_slots[0], []).append(index)
    pairs = [(a, b) for same in by_first_row.values() for i, a in enumerate(same) for b in same[i + 1 :]]
    assert len(pairs) > 100  # about 4000^2 / 2 / 16384 = 488 expected: the first row does collide
    again = [(a, b) for a, b in pairs if any(slots[a][row] == slots[b][row] for row in (1, 2, 3))]
    assert len(again) <= 2  # independent rows: about 488 x 3 / 16384 = 0.09 expected
    with pytest.raises(ValueError, match="1 to 8 rows"):
        FrequencySketch(depth=9)


def test_without_admission_the_least_recently_used_leave():
    kept = KeptEntries(300, admission=False)
    for key in "abc":
        assert kept.admit(key, 100) == []
    looked_up(kept, "a")  # now b is the oldest
    assert kept.admit("d", 150) == ["b", "c"]
    assert kept.keys() == ["a", "d"] and kept.nbytes == 250


def test_a_popular_entry_survives_a_scan_of_one_off_entries():
    lru, tinylfu = KeptEntries(300, admission=False), KeptEntries(300)
    for kept in (lru, tinylfu):
        for key in ("popular", "x", "y"):
            looked_up(kept, key, 3 if key == "popular" else 1)
            kept.admit(key, 100)
        for number in range(20):  # one-off documents, each looked up (a miss) and then offered
            looked_up(kept, f"once-{number}")
            kept.admit(f"once-{number}", 100)
    assert "popular" not in lru
    assert "popular" in tinylfu and tinylfu.nbytes <= 300


def test_an_entry_enters_only_if_asked_for_more_often_than_each_it_pushes_out():
    kept = KeptEntries(200)
    for key, times in (("rare", 1), ("frequent", 3)):
        looked_up(kept, key, times)
        kept.admit(key, 100)
    looked_up(kept, "new", 2)
    assert kept.admit("new", 200) is None  # would push out "frequent" too, asked for more often: stays out
    assert kept.keys() == ["rare", "frequent"] and kept.nbytes == 200
    assert kept.admit("new", 100) == ["rare"]  # only the oldest must leave, asked for less often
    assert kept.keys() == ["frequent", "new"]
    looked_up(kept, "tie", 3)
    assert kept.admit("tie", 100) is None  # as often as "frequent": a tie keeps what is held


def test_evict_false_and_always():
    kept = KeptEntries(200)
    looked_up(kept, "held", 5)
    kept.admit("held", 150)
    looked_up(kept, "hot", 9)
    assert kept.admit("hot", 100, evict=False) is None  # a warm-up never displaces
    assert kept.admit("prefix", 100, always=True) == ["held"]  # a prefix enters, asked for or not
    assert kept.admit("huge", 201, always=True) is None and kept.keys() == ["prefix"]


def test_counts_fade_so_the_cache_follows_a_change_of_popularity():
    kept = KeptEntries(100)
    looked_up(kept, "yesterday", 15)
    kept.admit("yesterday", 100)
    looked_up(kept, "today", 2)
    assert kept.admit("today", 100) is None
    for number in range(4 * MIN_SAMPLE):  # traffic elsewhere: four halvings
        looked_up(kept, f"other-{number % 50}")
    assert kept.sketch.estimate("yesterday") == 0
    looked_up(kept, "today", 2)
    assert kept.admit("today", 100) == ["yesterday"]


def _layers(tokens):
    return ((torch.zeros(1, 1, tokens, 4), torch.zeros(1, 1, tokens, 4)),)  # 32 bytes per token


def test_the_document_cache_keeps_what_returns_and_always_takes_a_prefix():
    model = nn.Linear(1, 1)
    draft = DraftIdentity.of(model, 1)
    store = DocumentKVCache(3 * 32 * 10)  # three entries of 10 tokens

    def key(name):
        return DocumentKey(draft, None, b"p", PREFIX_ENTRY if name == "prefix" else name.encode())

    def ask(name):  # what a request does: look the entry up, store it when missing
        ids = torch.arange(10)
        if store.lookup(key(name), ids) is None:
            store.store(model, key(name), ids, _layers(10))
            return False
        return True

    hits = [ask(name) for name in ["prefix", "popular", "popular", *[f"once-{i}" for i in range(6)], "popular"]]
    assert hits[-1] and store.nbytes <= store.max_bytes  # the one-off documents did not push it out
    for number in range(6):  # a new prompt prefix, never asked for before, still enters a full cache
        store.lookup(key(f"once-{number}"), torch.arange(10))
    store.store(model, DocumentKey(draft, None, b"q", PREFIX_ENTRY), torch.arange(10), _layers(10))
    assert store.lookup(DocumentKey(draft, None, b"q", PREFIX_ENTRY), torch.arange(10)) is not None
    lru = DocumentKVCache(3 * 32 * 10, admission=False)
    store = lru
    hits = [ask(name) for name in ["prefix", "popular", "popular", *[f"once-{i}" for i in range(6)], "popular"]]
    assert not hits[-1]  # least recently used alone: the scan pushed it out


def test_clear_forgets_the_keys_and_the_counts():
    kept = KeptEntries(100)
    looked_up(kept, "a", 3)
    kept.admit("a", 100)
    kept.clear()
    assert len(kept) == 0 and kept.nbytes == 0 and kept.sketch.estimate("a") == 0
