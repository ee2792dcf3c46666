"""benchmarks/conversation.py on the tiny models: its arms reuse what they should, its files and --resume."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.fixture
def conversation_study(tmp_path, monkeypatch):
    """A small SQuAD file (three questions per paragraph, several articles) in place of ../shared/data."""
    import conversation
    import tasks

    articles = [
        {
            "paragraphs": [
                {
                    "context": f"Article {a} paragraph {p}. The bridge {a}-{p} opened in {1800 + 10 * a + p} "
                    f"and was built by company {a}{p} with stone from quarry {p}.",
                    "qas": [
                        {"question": f"When did bridge {a}-{p} open?", "answers": [{"text": f"{1800 + 10 * a + p}"}]},
                        {"question": f"Who built bridge {a}-{p}?", "answers": [{"text": f"company {a}{p}"}]},
                        {"question": "Where did the stone come from?", "answers": [{"text": f"quarry {p}"}]},
                    ],
                }
                for p in range(3)
            ]
        }
        for a in range(4)
    ]
    (tmp_path / "data" / "squad").mkdir(parents=True)
    (tmp_path / "data" / "squad" / "dev-v1.1.reconstructed.json").write_text(json.dumps({"data": articles}))
    monkeypatch.setattr(tasks, "DATA", tmp_path / "data")
    return conversation


def test_speed_arms_reuse_only_where_they_should(conversation_study, tiny_model, tiny_draft, tokenizer, tmp_path):
    args = conversation_study.defaults(
        conversation_study.parser().parse_args(
            [
                "speed",
                "--conversations",
                "1",
                "--questions",
                "3",
                "--document-tokens",
                "150",
                "--keep-rates",
                "0.3",
                "--answer-tokens",
                "3",
                "--out",
                str(tmp_path / "speed"),
            ]
        )
    )
    report = conversation_study.run(args, models=(tiny_model, tokenizer, tiny_draft))
    turns = report["conversations"][0]["turns"]
    assert [("full" in t) for t in turns] == [True, False, True]  # the uncached full prefill: first and last turn
    for turn in turns[1:]:
        stable, reselect = turn["stable@0.3"], turn["reselect@0.3"]
        assert stable["reused_spans"] > 0 and stable["draft_ms"] == 0 and stable["main_cached_tokens"] > 0
        assert reselect["reused_spans"] == 0 and reselect["draft_ms"] > 0 and not reselect["main_cached_tokens"]
        assert turn["full-cached"]["main_cached_tokens"] > 0
    assert turns[-1]["memory"]["stable@0.3"]["memo"] > 0 and turns[-1]["memory"]["reselect@0.3"]["main_cache"] == 0
    markdown = (tmp_path / "speed.md").read_text()
    assert "reselect@0.3 / stable@0.3" in markdown and "selection memo" in markdown


def test_quality_shares_turn_one_and_resumes(conversation_study, tiny_model, tiny_draft, tokenizer, tmp_path):
    argv = [
        "quality",
        "--questions",
        "2",
        "--documents",
        "3",
        "--keep-rates",
        "0.3",
        "--answer-tokens",
        "2",
        "--out",
        str(tmp_path / "quality"),
    ]
    parse = conversation_study.parser().parse_args
    first = conversation_study.run(
        conversation_study.defaults(parse([*argv, "--conversations", "1"])), models=(tiny_model, tokenizer, tiny_draft)
    )
    turn_1, turn_2 = first["conversations"][0]["turns"]
    assert (
        turn_1["reselect@0.3"]["shared_with_frozen"]
        and turn_1["reselect@0.3"]["answer"] == turn_1["frozen@0.3"]["answer"]
    )
    assert turn_2["frozen@0.3"]["reused_spans"] > 0 and turn_2["reselect@0.3"]["reused_spans"] == 0
    resumed = conversation_study.run(
        conversation_study.defaults(parse([*argv, "--conversations", "2", "--resume"])),
        models=(tiny_model, tokenizer, tiny_draft),
    )
    assert len(resumed["conversations"]) == 2 and resumed["conversations"][0] == first["conversations"][0]
    later = resumed["summary"]["0.3"]["later_turns"]
    assert later["n_conversations"] == 2 and later["n_turns"] == 2
    with pytest.raises(SystemExit):
        conversation_study.run(
            conversation_study.defaults(parse([*argv, "--conversations", "2", "--resume", "--seed", "5"])),
            models=(tiny_model, tokenizer, tiny_draft),
        )
