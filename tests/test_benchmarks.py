"""The benchmark helpers that a wrong number could hide behind: the LongLLMLingua shims and the tasks."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))


@torch.inference_mode()
def test_legacy_cache_model_continues_like_one_forward(tiny_model, tokenizer):
    from longllmlingua import LegacyCacheModel

    ids = torch.tensor([tokenizer("Paris is the capital of France. The bridge opened in 1883.")["input_ids"]])
    wrapped = LegacyCacheModel(tiny_model)
    head = wrapped(ids[:, :5], attention_mask=torch.ones_like(ids[:, :5]))
    assert isinstance(head.past_key_values, list) and len(head.past_key_values) == tiny_model.config.num_hidden_layers
    # llmlingua slices these lists itself: keep the first 4 cached tokens, then continue from token 4
    trimmed = [[k[:, :, :4], v[:, :, :4]] for k, v in head.past_key_values]
    tail = wrapped(ids[:, 4:], attention_mask=torch.ones_like(ids), past_key_values=trimmed)
    whole = tiny_model(input_ids=ids).logits
    torch.testing.assert_close(tail.logits, whole[:, 4:], rtol=1e-4, atol=1e-4)
    assert tail.past_key_values[0][0].shape[2] == ids.shape[1]


def test_offline_tiktoken_restores_the_environment(monkeypatch):
    from longllmlingua import offline_tiktoken

    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    with offline_tiktoken():
        import tiktoken

        assert tiktoken.encoding_for_model("gpt-3.5-turbo").encode("hello world")
    assert "TIKTOKEN_CACHE_DIR" not in os.environ


def test_longllmlingua_compresses_with_the_real_package(tiny_model_dir):
    from longllmlingua import LongLLMLingua

    documents = [
        " ".join(["The bridge opened in 1883 after thirteen years of work."] * 12),
        " ".join(["Paris is the capital of France and a large city."] * 12),
    ]
    compressed = LongLLMLingua(tiny_model_dir).compress(documents, "When did the bridge open?", rate=0.3)
    assert 0 < len(compressed) < 0.8 * sum(len(d) for d in documents)


@pytest.fixture
def task_data(tmp_path, monkeypatch):
    """Small files in the formats of ../shared/data (SQuAD, HotpotQA, NQ-open, LongBench), written here so
    the task loaders are tested without reading outside the repository."""
    import gzip
    import json

    import tasks

    facts = [(f"Topic{i}", f"What is the colour of object {i}?", f"colour{i}") for i in range(8)]
    squad = {
        "data": [
            {
                "paragraphs": [
                    {
                        "context": f"{topic} facts. Object {i} is {answer} all year round.",
                        "qas": [{"question": question, "answers": [{"text": answer}]}],
                    }
                ]
            }
            for i, (topic, question, answer) in enumerate(facts)
        ]
    }
    (tmp_path / "squad").mkdir()
    (tmp_path / "squad" / "dev-v1.1.reconstructed.json").write_text(json.dumps(squad))
    rows = [
        {
            "question": f"Which two topics mention object {i}?",
            "answer": f"colour{i}",
            "context": [[f"Title{i}-{j}", [f"Sentence {j} about object {i}. ", "More text."]] for j in range(10)],
            "supporting_facts": [[f"Title{i}-2", 0], [f"Title{i}-7", 1]],
        }
        for i in range(6)
    ]
    (tmp_path / "hotpotqa").mkdir()
    (tmp_path / "hotpotqa" / "hotpotqa_train_distractor_100.json").write_text(json.dumps(rows))
    (tmp_path / "lost_in_the_middle").mkdir()
    with gzip.open(tmp_path / "lost_in_the_middle" / "nq-open-oracle.jsonl.gz", "wt") as lines:
        for topic, question, answer in facts:
            lines.write(
                json.dumps(
                    {
                        "question": question,
                        "answers": [answer],
                        "ctxs": [{"title": topic, "text": f"The object is {answer}."}],
                    }
                )
                + "\n"
            )
    prompts = tmp_path / "longbench" / "prompt_configs"
    prompts.mkdir(parents=True)
    prompts.joinpath("dataset2prompt.json").write_text(
        json.dumps({task: f"{task}: read {{context}} and answer {{input}}" for task in tasks.LONGBENCH_TASKS})
    )
    for task in tasks.LONGBENCH_TASKS:
        passages = [f"Passage {k}:\nText {k} of {task}.\n" for k in range(1, 4)]
        context = "".join(passages) if task == "hotpotqa" else f"{task} text."
        records = [
            {"context": context, "input": f"Question {i} on {task}?", "answers": ["x"], "dataset": task}
            for i in range(6)
        ]
        (tmp_path / "longbench" / f"{task}.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    monkeypatch.setattr(tasks, "DATA", tmp_path)
    return tasks


def test_squad_and_nq_put_the_answer_in_the_gold_document(task_data):
    for sample in task_data.squad(5, 4, seed=0) + task_data.nq(5, 4, seed=0):
        assert len(sample["documents"]) == 4
        gold = sample["documents"][sample["gold_documents"][0]].lower()
        assert any(answer.lower() in gold for answer in sample["answers"])


def test_hotpotqa_marks_both_gold_paragraphs(task_data):
    for sample in task_data.hotpotqa(5, seed=0):
        assert len(sample["documents"]) == 10 and sample["gold_documents"] == [2, 7]


def test_samples_do_not_depend_on_how_many_are_drawn(task_data, tokenizer):
    """A study grows by resuming with a larger --samples: sample i must be the same prompt at every count."""
    draws = {
        "squad": lambda n: task_data.squad(n, 4, seed=3),
        "hotpotqa": lambda n: task_data.hotpotqa(n, seed=3),
        "nq": lambda n: task_data.nq(n, 4, seed=3),
        "longbench": lambda n: task_data.longbench(n, tokenizer, max_tokens=200, seed=3),
    }
    for task, draw in draws.items():
        assert draw(2) == draw(5)[:2], task
    with pytest.raises(ValueError, match="7 samples asked for, but the HotpotQA file has only 6"):
        task_data.hotpotqa(7, seed=0)  # not silently fewer


def test_longbench_keeps_the_official_prompt_and_splits_passages(task_data, tokenizer):
    samples = task_data.longbench(30, tokenizer, max_tokens=4000, seed=0)
    assert {s["dataset"] for s in samples} == set(task_data.LONGBENCH_TASKS)
    for sample in samples:
        assert "{context}" in sample["prompt"] and sample["question"] in sample["prompt"]
        assert len(tokenizer("".join(sample["documents"]))["input_ids"]) <= 4010  # middle-truncated, re-tokenized
    assert any(len(s["documents"]) > 1 for s in samples if s["dataset"] == "hotpotqa")


def test_peak_memory_counts_each_run_after_the_heap_is_trimmed():
    from ttft_lengths import peak_memory_mb

    survivors = []

    def allocate() -> None:
        blocks = [torch.ones(16 * 1024) for _ in range(1024)]  # 1024 blocks of 64 kB: heap, not mmap
        survivors.append(blocks[-1])  # pins the freed heap below it, as a cached tensor would
        del blocks

    peaks = peak_memory_mb({"first": allocate, "second": allocate, "nothing": lambda: None})
    # without the trim, the second run would fit in heap the first one freed and show ~0 MB
    assert peaks["first"] > 56 and peaks["second"] > 56
    assert peaks["nothing"] < 16


def test_ttft_shape_path_runs_without_a_tokenizer(monkeypatch):
    """The GPU study's code path (random-weight shapes, random ids, backend only), on CPU at a tiny size."""
    import ttft

    tiny = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=2048,
    )
    monkeypatch.setitem(ttft.SHAPES, "tiny", tiny)
    draft, main = ttft.shape_model("tiny", torch.bfloat16, "cpu"), ttft.shape_model("tiny", torch.bfloat16, "cpu")
    assert next(main.parameters()).dtype == torch.bfloat16
    assert main.model.rotary_emb.inv_freq.dtype == torch.float32
    args = argparse.Namespace(device="cpu", look_ahead=2, keep_rate=0.1, repeats=1)
    row = ttft.run_length(ttft.timing_engine(main, None, draft), draft, None, 1024, args)
    assert row["prompt_tokens"] == 1024 and 96 < row["kept_tokens"] < 1024
    median = {name: timing["median"] for name, timing in row["timings_ms"].items()}
    assert row["bound"] == pytest.approx(1 / (row["kept_share"] + median["draft_scoring"] / median["main_full"]))


def method_args(*methods: str):
    """``quality.make_methods``'s arguments for ``methods``, every other option at its default."""
    return argparse.Namespace(
        methods=list(methods),
        self_layers=[],
        self_windows=[],
        extra_drafts=[],
        seed=0,
        auto_floors=[0.1],
        auto_ceilings=[0.5],
    )


def _run(samples: list[int], method: str, keep_rate: float, seed: int = 0) -> dict:
    def record(sample: int, name: str, rate: float, value: float) -> dict:
        return {
            "sample": sample,
            "method": name,
            "keep_rate": rate,
            "contains": value,
            "logprob": -value,
            "answer_kept": value,
            "gold_document_kept": 1.0,
            "kept_share": rate,
        }

    records = []
    for sample in samples:
        records += [record(sample, "full", 1.0, 1.0), record(sample, method, keep_rate, float(sample % 2))]
    settings = {"task": "niah", "seed": seed, "documents": 5, "length": 1500, "max_new_tokens": 16}
    return {"task": "niah", "samples": len(samples), "records": records, "settings": settings}


def test_merge_joins_runs_on_the_same_samples_and_keeps_full_once():
    from merge import merge
    from quality import summarise

    merged = merge(
        [_run([0, 1], "specprefill", 0.1), _run([0, 1, 2, 3], "specprefill", 0.2), _run([2, 3], "specprefill", 0.1)]
    )
    assert merged["samples"] == 4
    rows = {(r["method"], r["keep_rate"]): r for r in summarise(merged, "contains")}
    assert rows[("full", 1.0)]["n"] == 4
    assert rows[("specprefill", 0.1)]["n"] == 4 and rows[("specprefill", 0.1)]["retention"] == 0.5


def test_merge_refuses_other_samples_and_duplicates():
    from merge import MergeError, merge

    with pytest.raises(MergeError, match="seed"):
        merge([_run([0], "specprefill", 0.1), _run([1], "specprefill", 0.2, seed=1)])
    again = _run([0], "specprefill", 0.1)
    assert merge([_run([0], "specprefill", 0.1), again])["samples"] == 1  # a re-run that agrees is kept once
    again["records"][1]["logprob"] += 0.5
    with pytest.raises(MergeError, match="different results for sample 0, specprefill at keep 0.1"):
        merge([_run([0], "specprefill", 0.1), again])


def test_retention_compares_each_row_with_full_on_its_own_samples():
    from quality import summarise

    report = _run([0, 1, 2, 3], "specprefill", 0.1)
    for record in report["records"]:  # full answers right only on the samples the row did not run
        if record["method"] == "full":
            record["contains"] = float(record["sample"] >= 2)
    report["records"] = [r for r in report["records"] if r["method"] == "full" or r["sample"] >= 2]
    row = {r["method"]: r for r in summarise(report, "contains")}["specprefill"]
    assert row["n"] == 2 and row["retention"] == 0.5  # sample 3 of samples 2 and 3, not of all four


def test_failed_samples_are_left_out_of_the_rows_and_listed():
    from quality import markdown, summarise

    report = _run([0, 1, 2], "longllmlingua", 0.1)
    report["records"] = [r for r in report["records"] if not (r["method"] == "longllmlingua" and r["sample"] == 1)]
    report["records"].append(
        {"sample": 1, "method": "longllmlingua", "keep_rate": 0.1, "failed": "llmlingua: AssertionError"}
    )
    row = {r["method"]: r for r in summarise(report, "contains")}["longllmlingua"]
    assert row["n"] == 2 and row["score"] == 0.0  # samples 0 and 2
    assert "longllmlingua at keep 0.1 on sample(s) 1: llmlingua: AssertionError." in markdown(report, "contains")


def test_mapping_study_counts_the_document_characters_kept_tokens_cover(tokenizer):
    from mapping import kept_characters

    from specprefill_rag.prompt.render import build_rag_layout

    layout = build_rag_layout(tokenizer, "When?", ["the quick brown fox", "Paris is the capital of France"])
    documents = torch.nonzero(layout.document_index >= 0).flatten()
    assert kept_characters(layout, torch.arange(len(layout))).all()
    first_document = documents[layout.document_index[documents] == 0]
    covered = kept_characters(layout, first_document)
    assert covered.tolist() == [True] * len("the quick brown fox") + [False] * len("Paris is the capital of France")


def test_draft_cache_summary_reads_the_hits_against_the_bound():
    from draft_cache import summarize

    def question(cold_draft, warm_draft, warm_ttft):
        return {
            "prompt_tokens": 1000,
            "cache_bytes": 2**20,
            "cold": {"draft_ms": cold_draft, "ttft_ms": 2 * cold_draft, "kept_tokens": 100},
            "warm": {"draft_ms": warm_draft, "ttft_ms": warm_ttft, "kept_tokens": 100},
        }

    rows = [question(1000, 1000, 2000), question(1000, 50, 1000), question(1000, 100, 1200), question(1000, 80, 1100)]
    summary = summarize(rows, full_ms=10_000)
    assert summary["warm_over_cold_draft"] == {"median": 0.08, "min": 0.05, "max": 0.1, "n": 3}  # the miss left out
    assert summary["warm_bound"] == pytest.approx(1 / (0.1 + 80 / 10_000))
    assert summary["warm_speedup"] == pytest.approx(10_000 / 1100)
    assert summary["cache_mb"] == 1.0


def test_auto_tuning_reads_the_fixed_curve_at_autos_kept_share():
    from auto_tuning import interpolate, tuning_rows

    assert interpolate([(0.1, 0.0), (0.3, 1.0)], 0.2) == pytest.approx(0.5)
    assert interpolate([(0.1, 0.0), (0.3, 1.0)], 0.4) is None  # outside the measured rates: no comparison
    report = _run([0, 1], "specprefill", 0.1)
    for record in report["records"]:
        record["kept_share"] = 0.1 if record["method"] == "specprefill" else 1.0
    auto = [
        {**r, "method": "specprefill-auto", "keep_rate": 0.8, "kept_share": 0.55, "contains": 1.0}
        for r in report["records"]
        if r["method"] == "specprefill"
    ]
    report["records"] += auto
    (row,) = tuning_rows(report, "contains")
    # the fixed curve runs from (0.1, 0.5) to full (1.0, 1.0): 0.75 at 0.55; auto scores 1.0
    assert row["fixed_at_share"] == pytest.approx(0.75) and row["margin"] == pytest.approx(0.25)


def test_held_out_pairs_auto_with_the_fixed_rate_per_sample():
    from auto_tuning import held_out

    report = _run([0, 1, 2, 3], "specprefill", 0.25)  # fixed: contains 0, 1, 0, 1
    report["records"] += [
        {**r, "method": "specprefill-auto", "keep_rate": 0.8, "contains": 1.0}
        for r in report["records"]
        if r["method"] == "specprefill"
    ]
    assert "contains: +0.500 (+0.000 to +1.000)" in held_out(report, ["contains"])
    report["records"].append({**report["records"][1], "keep_rate": 0.3})
    with pytest.raises(SystemExit, match="one fixed specprefill rate"):
        held_out(report, ["contains"])


def test_ttft_lengths_bound_counts_the_tokens_kept_whole(monkeypatch, tiny_model, tiny_draft, tokenizer):
    """The bound divides by what the main model prefills: documents at keep_rate plus the instructions, question
    and template kept whole, so the share exceeds keep_rate; the paper's keep-rate bound is reported beside it."""
    import ttft_lengths
    from sentence_filter import SentenceFilter

    from specprefill_rag import SpecPrefillEngine

    text = (Path(__file__).parent.parent / "examples" / "documents" / "brooklyn_bridge.txt").read_text()
    monkeypatch.setattr(ttft_lengths, "documents_of", lambda _tokenizer, _length: [text[:600], text[600:1200]])
    engine, window = (
        SpecPrefillEngine.from_models(
            tiny_model,
            tokenizer,
            tiny_draft,
            draft_tokenizer=tokenizer,
            min_prompt_tokens=0,
            draft_cache_mb=0,
            draft_queries=queries,
        )
        for queries in ("look_ahead", "window")
    )
    args = argparse.Namespace(keep_rate=0.1, repeats=1, self_layers=1, filter_share=0.5)
    sentence_filter = SentenceFilter(tokenizer, KeywordEmbedder())
    row = ttft_lengths.run_length(engine, window, None, sentence_filter, 0, args, probe_memory=False)
    assert set(row["kept_tokens"]) == {"specprefill", "specprefill-window", "self-1"}
    assert set(row["speedup"]) == {
        "specprefill",
        "specprefill-window",
        "self-1",
        "embeddings-filter",
        "embeddings-filter50-specprefill",
    }
    assert row["kept_share"] == row["kept_tokens"]["specprefill"] / row["prompt_tokens"]
    assert row["kept_tokens"]["specprefill"] >= row["prompt_tokens"] - row["document_tokens"]
    assert row["kept_share"] > args.keep_rate
    median = {name: timing["median"] for name, timing in row["timings_ms"].items()}
    draft_share = median["draft_scoring"] / median["full"]
    assert row["bound"] == pytest.approx(1 / (row["kept_share"] + draft_share))
    assert row["bound_at_keep_rate"] == pytest.approx(1 / (args.keep_rate + draft_share))
    assert row["bound_at_keep_rate"] > row["bound"]


def _headline_study(task: str, scores: dict[str, list[float]]) -> dict:
    """A quality report: method -> per-sample scores at keep 0.1 (full at 1.0)."""
    records = [
        {
            "sample": i,
            "method": method,
            "keep_rate": 1.0 if method == "full" else 0.1,
            "contains": value,
            "logprob": -1.0,
            "answer_kept": value,
            "gold_document_kept": 1.0,
            "kept_share": 0.1,
        }
        for method, values in scores.items()
        for i, value in enumerate(values)
    ]
    settings = {"task": task, "max_new_tokens": 16}
    return {"task": task, "samples": len(scores["full"]), "records": records, "settings": settings}


def test_headline_reads_each_study_and_the_ttft_row_of_its_keep_rate():
    from headline import paired_table, quality_table

    studies = {
        "niah": [
            _headline_study(
                "niah",
                {
                    "full": [1, 1, 1, 1],
                    "specprefill": [1, 1, 1, 1],
                    "specprefill-layers24": [1, 0, 1, 1],  # the window, by the name quality.py records
                    "self": [1, 1, 1, 0],
                    "longllmlingua": [0, 0, 0, 0],
                },
            )
        ],
        "squad": [
            _headline_study(
                "squad", {"full": [1, 1, 0, 1], "specprefill": [1, 0, 0, 1], "longllmlingua": [1, 1, 0, 0]}
            ),
            # a method run later on the same samples: its row against its own study's full prefill; the second
            # study's full and specprefill rows are not read (the first study ran them)
            _headline_study(
                "squad", {"full": [1, 1, 1, 1], "specprefill": [0, 0, 0, 0], "embeddings-filter": [1, 0, 1, 0]}
            ),
        ],
    }
    ttft = {
        "keep_rate": 0.1,
        "results": [
            {"length": 2048, "bound": 3.0, "speedup": {"specprefill": 9.9}},
            {"length": 4096, "bound": 2.0, "speedup": {"specprefill": 1.8, "specprefill-window": 2.1, "self-11": 1.9}},
        ],
    }
    table = quality_table(studies, [ttft], 4096, [0.1, 0.3]).splitlines()
    specprefill = next(line for line in table if line.startswith("| specprefill | 0.1 |"))
    assert "| 1.00, 100% (100%-100%) | 0.50, 67% " in specprefill and "1.80x (bound 2.00x)" in specprefill
    assert not any(line.startswith("| specprefill | 0.3 |") for line in table)  # no study ran keep 0.3
    assert next(line for line in table if line.startswith("| full |")).endswith("| 1.00x |")
    # self: the ttft run's self-<layers> row, without the bound (it is the --draft model's); not run on squad
    self_row = next(line for line in table if line.startswith("| self | 0.1 |"))
    assert self_row.endswith("| 0.75, 75% (25%-100%) | not run | 1.90x |")
    # the window: its own TTFT arm (not specprefill's, whose name it extends) and its recorded quality name
    window_row = next(line for line in table if line.startswith("| specprefill-window | 0.1 |"))
    assert window_row.endswith("| 0.75, 75% (25%-100%) | not run | 2.10x |")
    window_paired = paired_table(studies, "specprefill", ["specprefill-window"]).splitlines()
    assert window_paired[2].startswith("| specprefill - specprefill-window | niah | 0.1 | 4 | +0.250")
    filter_row = next(line for line in table if line.startswith("| embeddings-filter | 0.1 |"))
    assert filter_row.startswith("| embeddings-filter | 0.1 | not run | 0.50, 50% ")
    paired = paired_table(studies, "specprefill", ["self", "longllmlingua"]).splitlines()
    assert paired[2] == "| specprefill - self | niah | 0.1 | 4 | +0.250 (+0.00 to +0.75) | +0.000 (+0.00 to +0.00) |"
    assert paired[3].startswith("| specprefill - longllmlingua | niah | 0.1 | 4 | **+1.000 (+1.00 to +1.00)** |")
    assert paired[4].startswith("| specprefill - longllmlingua | squad | 0.1 | 4 | +0.000")  # no self on squad
    assert len(paired) == 5
    # a method of a later study against the first study's specprefill (1, 0, 0, 1 against 1, 0, 1, 0)
    later = paired_table(studies, "specprefill", ["embeddings-filter"]).splitlines()
    assert later[2].startswith("| specprefill - embeddings-filter | squad | 0.1 | 4 | +0.000")
    assert len(later) == 3


def test_resume_compares_only_the_settings_that_shape_the_methods_run(tmp_path):
    """A run saved before the auto options existed resumes when auto is not among its methods, and not otherwise."""
    import json

    from quality import AUTO, resumed_report

    settings = {
        "task": "niah",
        "samples": 30,
        "documents": 5,
        "length": 4000,
        "seed": 0,
        "main": "m",
        "draft": "d",
        "keep_rates": [0.1, 0.3],
        "methods": ["specprefill", "random"],
        "max_new_tokens": 16,
    }
    records = [{"sample": 0, "method": "full", "keep_rate": 1.0}]
    (tmp_path / "study.json").write_text(json.dumps({"samples": 1, "settings": settings, "records": records}))

    def resume(**changes) -> list[dict]:
        args = argparse.Namespace(
            **{
                **settings,
                "resume": True,
                "auto_shares": [0.8],
                "auto_floors": [0.1],
                "auto_ceilings": [0.5],
                "sampler": 1,
                **changes,
            }
        )
        return resumed_report(args, tmp_path / "study")["records"]

    assert resume() == records
    with pytest.raises(SystemExit, match="keep_rates"):
        resume(keep_rates=[0.1])
    with pytest.raises(SystemExit, match=r"\['samples'\].*may grow, not shrink"):
        resume(samples=20)
    with pytest.raises(SystemExit, match=r"\['sampler'\]"):  # saved before the sampler changed: other samples
        resume(sampler=2)
    assert resume(samples=40) == records
    settings["methods"] = ["specprefill", AUTO]  # the same run with auto: its saved run has no auto settings
    (tmp_path / "study.json").write_text(json.dumps({"samples": 1, "settings": settings, "records": records}))
    with pytest.raises(SystemExit, match=r"\['auto_shares', 'auto_floors', 'auto_ceilings'\]"):
        resume()


def test_resume_refuses_when_the_earlier_samples_are_not_drawn_first():
    from quality import check_resumed_samples

    drawn = ["a", "b", "c", "d"]
    check_resumed_samples({"sample_digests": ["a", "b"]}, drawn, drawn_at=lambda n: pytest.fail("digests were saved"))
    with pytest.raises(SystemExit, match="sample 1 is not the one the earlier run evaluated.*--samples 2"):
        check_resumed_samples({"sample_digests": ["a", "x"]}, drawn, drawn_at=lambda n: [])
    # saved before digests were kept: compared with this sampler's draw at the count the earlier run asked for
    check_resumed_samples({"settings": {"samples": 3}}, drawn, drawn_at=lambda n: drawn[:n])
    with pytest.raises(SystemExit, match="sample 0"):
        check_resumed_samples({"settings": {"samples": 3}}, drawn, drawn_at=lambda n: ["z", "b", "c"][:n])


def test_merge_refuses_runs_of_another_sampler():
    from merge import MergeError, merge

    newer = _run([1], "specprefill", 0.2)
    newer["settings"]["sampler"] = 2
    with pytest.raises(MergeError, match="sampler"):
        merge([_run([0], "specprefill", 0.1), newer])


def test_merge_keeps_the_settings_of_one_study_split_over_runs(tmp_path):
    """Samples 0-1 in one process and 2-3 in another: the merged study resumes like one run."""
    import json

    from merge import MergeError, merge
    from quality import resumed_report

    settings = {
        "task": "niah",
        "seed": 0,
        "documents": 5,
        "length": 1500,
        "max_new_tokens": 16,
        "main": "m",
        "draft": "d",
        "keep_rates": [0.1],
        "methods": ["specprefill"],
        "sampler": 1,
        "samples": 4,
    }
    head, tail = _run([0, 1], "specprefill", 0.1), _run([2, 3], "specprefill", 0.1)
    head["settings"] = settings | {"out": "study"}
    tail["settings"] = settings | {"only_samples": [2, 3], "out": "tail"}
    head["sample_digests"], tail["sample_digests"] = ["a", "b"], ["a", "b", "c", "d"]
    merged = merge([head, tail])
    assert merged["settings"] == settings | {"only_samples": None} and merged["sample_digests"] == ["a", "b", "c", "d"]
    (tmp_path / "study.json").write_text(json.dumps(merged))
    args = argparse.Namespace(**settings, resume=True)
    assert resumed_report(args, tmp_path / "study")["records"] == merged["records"]

    tail["sample_digests"] = ["a", "x", "c", "d"]
    with pytest.raises(MergeError, match="drew different samples"):
        merge([head, tail])
    tail["settings"] = settings | {"keep_rates": [0.3]}  # another study on the same samples: only those settings
    tail["sample_digests"] = ["a", "b", "c", "d"]
    assert set(merge([head, tail])["settings"]) == {"task", "seed", "documents", "length", "max_new_tokens", "sampler"}


def test_agentic_study_runs_its_loop_on_a_tiny_model_and_resumes(task_data, tmp_path, monkeypatch):
    """benchmarks/agentic.py end to end on a tiny random Qwen-format model: it never calls the tool on its own,
    so with --force-search the forced search (tool_choice="required") is what runs; the files have every field,
    and --resume adds a question without asking the saved one again. Without it (auto throughout) nothing is
    forced: a step 1 without a call is the answer."""
    import json

    import agentic

    from specprefill_rag import SpecPrefillEngine
    from specprefill_rag.testing import build_family_tokenizer, build_model

    tokenizer = build_family_tokenizer("qwen3")
    tokenizer.chat_template = (Path(__file__).parent / "fixtures" / "chat_templates" / "qwen2_5.jinja").read_text()
    engine = SpecPrefillEngine.from_models(
        build_model(tokenizer, layers=2), tokenizer, build_model(tokenizer, layers=1, seed=1), min_prompt_tokens=0
    )
    # a random model writes a free string forever: an enum query lets the forced call end within its tokens
    search = json.loads(json.dumps(agentic.SEARCH))
    search["function"]["parameters"]["properties"]["query"] = {"enum": ["object", "topic"]}
    monkeypatch.setattr(agentic, "SEARCH", search)
    out = tmp_path / "agentic"
    argv = ["--out", str(out), "--max-new-tokens", "48", "--answer-tokens", "2", "--top-k", "2", "--max-steps", "2"]
    argv += ["--keep-rates", "1", "0.1", "--force-search"]
    report = agentic.main(["--questions", "1", *argv], engine=engine)
    saved = json.loads(Path(f"{out}.json").read_text())
    assert saved["records"] == report["records"] and [r["question"] for r in saved["records"]] == [0]
    assert {"machine", "torch_dtype", "versions", "min_prompt_tokens", "auto_min_prompt_tokens"} <= set(saved["meta"])
    assert saved["meta"]["tool_format"] == "hermes"  # what --reparse reads the stored turns with
    assert saved["sessions"][0]["load_start"] and saved["sessions"][0]["load_end"]
    (record,) = saved["records"]
    assert set(record["runs"]) == {"1", "0.1"} and record["load_before"] and record["load_after"]
    for run in record["runs"].values():
        assert {"correct", "parse_failures", "steps", "natural_call", "forced", "answer", "searches"} <= set(run)
        assert run["steps"] == 2 and run["forced"] and not run["forced_failed"] and run["parse_failures"] == 0
        assert [t["tool_choice"] for t in run["turns"]] == ["auto", "required", "none"]
        assert [s["query"] for s in run["searches"]] and all(len(s["returned"]) == 2 for s in run["searches"])
        for turn in run["turns"]:
            assert {"ttft_ms", "prompt_tokens", "kept_share", "compressed", "uncompressed_reason", "raw"} <= set(turn)
    answering = {key: run["turns"][-1] for key, run in record["runs"].items()}
    assert answering["1"]["uncompressed_reason"] == "keep_all"
    assert answering["0.1"]["compressed"] and answering["0.1"]["keep_rate"] < 1 and answering["0.1"]["document_tokens"]
    table = Path(f"{out}.md").read_text()
    assert "| keep | n | correct |" in table and "| 2 | none | 0.1 | 1 |" in table

    auto = agentic.main(["--questions", "1", *argv[:-1], "--out", str(tmp_path / "auto")], engine=engine)
    for run in auto["records"][0]["runs"].values():
        choices = [t["tool_choice"] for t in run["turns"]]
        assert not run["forced"] and "required" not in choices and choices[0] == "auto"
        assert run["natural_call"] or (choices == ["auto"] and run["n_searches"] == 0 and run["steps"] == 1)

    asked = []
    monkeypatch.setattr(
        agentic, "run_agent", lambda _e, sample, _r, _a, _f=None: asked.append(sample) or record["runs"]["1"]
    )
    agentic.main(["--questions", "2", "--resume", *argv], engine=engine)
    assert len(asked) == 2  # question 1 at both keep rates; question 0 came from the file
    resumed = json.loads(Path(f"{out}.json").read_text())
    assert [r["question"] for r in resumed["records"]] == [0, 1] and len(resumed["sessions"]) == 2


def test_agentic_reparse_reads_stored_outputs_with_todays_parser():
    """--report --reparse: a stored answer that was a cut search call becomes an invalid call and an empty
    answer (scored again); a turn whose valid calls would change is an error, since the loop would have
    differed."""
    import agentic
    import pytest

    cut = '{"name": "search", "arguments": {"query": "Paris is the capital'

    def turn(raw, calls=(), choice="auto"):
        return {"step": 1, "tool_choice": choice, "raw": raw, "text": raw, "tool_calls": list(calls),
                "invalid_tool_calls": []}  # fmt: skip

    def report(*turns):
        run = {"answer": turns[-1]["text"], "correct": 1.0, "parse_failures": 0, "turns": list(turns)}
        return {"records": [{"question": 0, "answers": ["Paris"], "runs": {"1": run}}]}

    (run,) = agentic.reparsed(report(turn(cut)))["records"][0]["runs"].values()
    assert run["answer"] == "" and run["correct"] == 0.0 and run["parse_failures"] == 1
    assert run["turns"][0]["invalid_tool_calls"][0]["error"] == "unterminated"
    prose = report(turn("It is Lyon."))
    assert agentic.reparsed(prose)["records"][0]["runs"]["1"]["correct"] == 0.0  # scored again: 'Paris' absent
    kept = report(turn("The answer is Paris."))
    assert agentic.reparsed(kept)["records"][0]["runs"]["1"] | {"turns": []} == {
        "answer": "The answer is Paris.", "correct": 1.0, "parse_failures": 0, "turns": []}  # fmt: skip
    with pytest.raises(ValueError, match="calls of step 1 changed"):
        agentic.reparsed(report(turn('{"name": "search", "arguments": {"query": "x"}}')))


def test_agent_kept_shows_the_tool_results_kept_text():
    """benchmarks/agent_kept.py on a tiny Qwen-format model: keep 1 keeps the whole tool result; keep 0.3 keeps
    fewer tokens, and the text it shows is the tool result's own (no template text)."""
    import agent_kept

    from specprefill_rag import SpecPrefillEngine
    from specprefill_rag.testing import build_family_tokenizer, build_model

    tokenizer = build_family_tokenizer("qwen3")
    tokenizer.chat_template = (Path(__file__).parent / "fixtures" / "chat_templates" / "qwen2_5.jinja").read_text()
    main, draft = (
        build_model(tokenizer, layers=2, max_positions=4096),
        build_model(tokenizer, layers=1, seed=1, max_positions=4096),
    )
    engine = SpecPrefillEngine.from_models(main, tokenizer, draft, min_prompt_tokens=0)
    result = " ".join(f"Sentence {i} says the stone was found in {1700 + i}." for i in range(15))
    chat = agent_kept.messages(result)
    retriever = type("Retriever", (), {"vectorstore": _Store([])})()
    tools = agent_kept.offered(agent_kept.Tool({"langchain": retriever}, k=1))
    assert tools[0]["function"]["name"] == "retrieve_context"  # the name the call in the messages gives
    kept, total, text = agent_kept.kept_document_text(engine, chat, tools, 1.0)
    assert kept == total and text.strip() == result
    kept, total, text = agent_kept.kept_document_text(engine, chat, tools, 0.3)
    assert kept < total and 0 < len(text) < len(result) and "<tool_response>" not in text


def test_agentic_search_ranks_by_bm25_and_breaks_ties_by_order():
    from agentic import bm25_rank, query_of

    paragraphs = ["Paris is the capital of France.", "The bridge opened in 1883.", "A bridge over the river Seine."]
    assert bm25_rank("when did the bridge open", paragraphs)[:2] == [1, 2]
    assert bm25_rank("nothing matches", paragraphs) == [0, 1, 2]
    assert query_of({"query": "x"}) == "x" and query_of({"q": "y"}) == "y"


def test_document_cache_report_pairs_each_repair_with_joint_on_shared_samples(tmp_path):
    from document_cache_report import rows_of

    def record(sample, method, keep, contains, answer_kept=1):
        return {"sample": sample, "method": method, "keep_rate": keep, "contains": contains, "answer_kept": answer_kept}

    records = [record(s, "full", 1, 1) for s in range(4)]
    records += [record(s, "specprefill", 0.1, 1) for s in range(4)]
    records += [record(s, "specprefill-documents", 0.1, int(s != 0)) for s in range(4)]
    records += [record(s, "specprefill-documents-naive", 0.1, int(s >= 2)) for s in range(3)]  # sample 3 missing
    run = tmp_path / "task.json"
    run.write_text(json.dumps({"settings": {"keep_rates": [0.1]}, "records": records}))

    blend, naive = rows_of(run)
    cells = [cell.strip() for cell in blend.strip("|").split("|")]
    assert cells[:7] == ["task", "0.1", "blend", "4", "1.00", "1.00", "0.75"]
    assert cells[7].startswith("**-0.250**")
    cells = [cell.strip() for cell in naive.strip("|").split("|")]
    assert cells[:7] == ["task", "0.1", "naive", "3", "1.00", "1.00", "0.33"]
    assert cells[7].startswith("**-0.667**")


def test_document_cache_report_pools_the_paired_samples_of_every_run(tmp_path):
    from document_cache_report import pooled_rows

    def record(sample, method, keep, contains):
        return {"sample": sample, "method": method, "keep_rate": keep, "contains": contains, "answer_kept": 1}

    runs = []
    for name, cached in (("a", [0, 1, 1]), ("b", [1, 1])):
        records = [record(s, "full", 1, 1) for s in range(len(cached))]
        records += [record(s, "specprefill", 0.1, 1) for s in range(len(cached))]
        records += [record(s, "specprefill-documents", 0.1, c) for s, c in enumerate(cached)]
        run = tmp_path / f"{name}.json"
        run.write_text(json.dumps({"settings": {"keep_rates": [0.1]}, "records": records}))
        runs.append(run)

    (row,) = pooled_rows(runs)
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[:7] == ["pooled (a, b)", "0.1", "blend", "5", "1.00", "1.00", "0.80"]
    assert cells[7].startswith("**-0.200**")


def test_document_cache_report_labels_query_repairs_by_their_share(tmp_path):
    from document_cache_report import rows_of

    def record(sample, method, contains):
        return {"sample": sample, "method": method, "keep_rate": 0.1, "contains": contains, "answer_kept": 1}

    records = [record(s, "full", 1) for s in range(2)] + [record(s, "specprefill", 1) for s in range(2)]
    records += [record(s, "specprefill-documents-query10", s) for s in range(2)]
    records += [record(s, "specprefill-documents-query", 1) for s in range(2)]
    records += [record(s, "specprefill-la4", 1 - s) for s in range(2)]  # joint scoring at look-ahead 4, no cache
    records += [record(s, "specprefill-layers24", 1) for s in range(2)]  # the draft's 24 layers, window queries
    records += [record(s, "specprefill-layers24-documents-naive", 1) for s in range(2)]  # the same, cached
    records += [record(s, "specprefill-layers24-documents-epic", 1) for s in range(2)]  # EPIC's first tokens
    run = tmp_path / "task.json"
    run.write_text(json.dumps({"settings": {"keep_rates": [0.1]}, "records": records}))
    rows = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows_of(run)]
    assert [row[2] for row in rows] == [
        "query 15%",
        "query 10%",
        "no cache, look-ahead 4",
        "no cache, first 24 layers, prompt-window queries",
        "epic, first 24 layers, prompt-window queries",
        "naive, first 24 layers, prompt-window queries",
    ]
    assert rows[2][6] == "0.50"  # its own correctness, against joint's 1.00


def test_a_quality_method_names_the_query_repair_and_its_share(tiny_model, tiny_draft, tokenizer, monkeypatch):
    """``--methods specprefill-documents-query10`` scores from the document cache with the query repair at 10%."""

    import quality

    from specprefill_rag import SpecPrefillEngine
    from specprefill_rag.draft import assembly
    from specprefill_rag.testing import random_documents

    assert quality.query_repair("specprefill-documents-query") == quality.DocumentRepair("query")
    with pytest.raises(ValueError, match="query<NN>"):
        quality.query_repair("specprefill-documents-query1")
    seen, original = [], assembly._recomputed
    monkeypatch.setattr(assembly, "_recomputed", lambda *a: seen.append(a[-1]) or original(*a))
    engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, tiny_draft, min_prompt_tokens=0, look_ahead=2)
    name = "specprefill-documents-query10"
    args = method_args(name)
    methods = quality.make_methods(engine, args)
    layout = engine.layout("When?", random_documents(2, 40, seed=1))
    prefill = methods[name]({}, layout, 0.3)
    assert 0 < prefill.kept.numel() < len(layout)
    assert seen == [quality.DocumentRepair("query", share=0.1)]


def test_a_quality_method_scores_a_layer_draft_from_the_document_cache(tiny_model, tiny_draft, tokenizer, monkeypatch):
    """``--methods specprefill-layers<N>-documents[-naive|-epic]``: the draft's first N layers (window queries)
    scored from the per-document cache, every document a hit, with blend repair, none, or EPIC's first tokens."""
    import quality

    from specprefill_rag import SpecPrefillEngine
    from specprefill_rag.draft import assembly
    from specprefill_rag.kvcache.prefix_cache import DraftIdentity
    from specprefill_rag.testing import random_documents

    with pytest.raises(ValueError, match="layers<N>-documents"):
        quality.layers_document_draft(None, "specprefill-layers2")  # type: ignore[arg-type]
    seen, original = [], assembly.assemble_prompt_kv
    monkeypatch.setattr(
        "specprefill_rag.draft.model.assemble_prompt_kv", lambda *a, **k: seen.append(a[5]) or original(*a, **k)
    )
    engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, tiny_draft, min_prompt_tokens=0)
    names = [
        "specprefill-layers1-documents",
        "specprefill-layers1-documents-naive",
        "specprefill-layers1-documents-epic",
    ]
    methods = quality.make_methods(engine, method_args(*names))
    layout = engine.layout("When?", random_documents(2, 40, seed=1))
    for name in names:
        prefill = methods[name]({}, layout, 0.3)
        assert 0 < prefill.kept.numel() < len(layout)
    assert [repair.kind for repair in seen] == ["blend", "naive", "epic"]
    entries = engine.draft.document_cache._entries  # the store is shared by the process's drafts: this one's entries
    mine = [key for key in entries if key.draft == DraftIdentity.of(tiny_draft, 1)]
    assert len(mine) == 3  # the prefix and both documents, encoded by the 1 layer run


def test_reversed_documents_moves_only_the_documents():
    import quality

    from specprefill_rag.draft.assembly import DocumentSpans

    ids = torch.arange(100, 130)
    spans = DocumentSpans(torch.tensor([[5, 9], [11, 18], [20, 22]]), prefix_length=3)
    moved, where = quality.reversed_documents(ids, spans)
    assert moved.numel() == ids.numel() and where.prefix_length == 3
    texts = [ids[start:end].tolist() for start, end in spans.spans.tolist()]
    assert [moved[start:end].tolist() for start, end in where.spans.tolist()] == texts[::-1]
    assert where.spans.tolist() == [[5, 7], [9, 16], [18, 22]]  # the gaps (3-5, 9-11, 18-20) stay as long
    assert moved[:5].tolist() == ids[:5].tolist() and moved[22:].tolist() == ids[22:].tolist()
    assert moved[7:9].tolist() == ids[9:11].tolist() and moved[16:18].tolist() == ids[18:20].tolist()


def test_the_in_context_quality_method_stores_documents_from_another_prompt(tiny_model, tokenizer, monkeypatch):
    """``--methods specprefill-documents-in-context``: the documents are stored from the reversed prompt's
    pass (first sight in context), then the layout is scored with every document a hit, on the method's own
    store (the engine's stays empty)."""

    import quality

    from specprefill_rag import SpecPrefillEngine
    from specprefill_rag.draft import assembly, paths
    from specprefill_rag.testing import random_documents

    engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, tiny_model, min_prompt_tokens=0, look_ahead=2)
    name = "specprefill-documents-in-context"
    args = method_args(name)
    scored, original = [], paths.draft_score

    def recorded(*args):
        scored.append(original(*args))
        return scored[-1]

    monkeypatch.setattr(quality, "draft_score", recorded)
    monkeypatch.setattr(paths, "draft_score", recorded)  # what score_layout calls
    in_context, assemble = [], assembly._assembled_in_context
    monkeypatch.setattr(assembly, "_assembled_in_context", lambda *a: in_context.append(1) or assemble(*a))
    assert engine.document_cache is not None
    held = len(engine.document_cache)  # the process's shared store: other tests' entries may be there
    methods = quality.make_methods(engine, args)
    layout = engine.layout("When?", random_documents(3, 40, seed=1))
    prefill = methods[name]({}, layout, 0.3)
    assert 0 < prefill.kept.numel() < len(layout)
    # the reversed prompt: every document a first sight; then the layout: every document a hit
    assert [score.documents_cached for score in scored] == [0, 3] and len(in_context) == 2
    assert len(engine.document_cache) == held  # the method's own store took them


def test_a_quality_method_runs_the_draft_to_its_first_layers(tiny_model, tokenizer):
    """``--methods specprefill-layers<N>`` scores as ``draft_layers=N`` builds the draft: its first N layers."""

    import quality

    from specprefill_rag import SpecPrefillEngine
    from specprefill_rag.testing import build_model, random_documents

    deep = build_model(tokenizer, layers=3, seed=2, initializer_range=0.2)
    engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, deep, min_prompt_tokens=0, look_ahead=2)
    args = method_args("specprefill-layers2")
    layout = engine.layout("When?", random_documents(2, 40, seed=1))
    kept = quality.make_methods(engine, args)["specprefill-layers2"]({}, layout, 0.3).kept
    built = SpecPrefillEngine.from_models(tiny_model, tokenizer, deep, min_prompt_tokens=0, draft_layers=2)
    importance = built.draft_scoring.importance(layout)
    expected = quality.select_kept(importance, layout.document_index, keep_rate=0.3, chunk_size=32)
    assert kept.tolist() == expected.tolist()
    assert not quality.LAYERS_METHOD.fullmatch("specprefill-layers0")


def test_a_look_ahead_method_keeps_what_an_engine_with_that_look_ahead_keeps(tokenizer, tiny_model):
    """``--methods specprefill-la<N>`` (and its ``-sentences`` form): the engine's draft with look-ahead N, as an
    engine built with ``look_ahead=N`` scores; la1 is always offered."""

    import quality

    from specprefill_rag import SpecPrefillEngine
    from specprefill_rag.testing import build_model, random_documents

    draft = build_model(tokenizer, layers=2, seed=3, initializer_range=0.2)
    engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, draft, **quality.STUDY_ENGINE)  # look-ahead 8
    args = method_args("specprefill-la3-sentences")
    layout = engine.layout("When?", random_documents(2, 40, seed=1))
    methods = quality.make_methods(engine, args)
    assert "specprefill-la3-sentences" in methods and "specprefill-la8" not in methods
    built = SpecPrefillEngine.from_models(tiny_model, tokenizer, draft, min_prompt_tokens=0, look_ahead=3)
    importance = built.draft_scoring.importance(layout)
    assert not torch.equal(importance, engine.draft_scoring.importance(layout))  # look-ahead 3 scores otherwise
    kept = methods["specprefill-la3-sentences"]({}, layout, 0.3).kept
    starts = layout.sentence_starts()
    expected = quality.select_kept(
        importance, layout.document_index, keep_rate=0.3, chunk_size=32, sentence_start=starts
    )
    assert kept.tolist() == expected.tolist()
    assert quality.LOOK_AHEAD_METHOD.fullmatch("specprefill-la1") and not quality.LOOK_AHEAD_METHOD.fullmatch(
        "specprefill-la0"
    )


def test_a_draft_method_with_the_sentences_suffix_keeps_what_the_engine_keeps_by_sentences(tokenizer, tiny_model):
    """``--methods specprefill-sentences`` and ``self-sentences``: the draft's own importance, chunks of whole
    sentences, as an engine with ``chunking="sentences"`` selects them."""

    import quality

    from specprefill_rag import SpecPrefillEngine
    from specprefill_rag.testing import build_model

    draft = build_model(tokenizer, layers=1, seed=3)
    args = method_args("specprefill-sentences", "self-sentences")
    documents = [" ".join(f"Fact {d}.{i} is in document {d}." for i in range(12)) for d in range(2)]
    engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, draft, min_prompt_tokens=0, look_ahead=2)
    layout = engine.layout("When?", documents)
    methods = quality.make_methods(engine, args)
    sentences = SpecPrefillEngine.from_models(
        tiny_model, tokenizer, draft, min_prompt_tokens=0, look_ahead=2, chunking="sentences", keep_rate=0.3
    )
    assert methods["specprefill-sentences"]({}, layout, 0.3).kept.tolist() == sentences.select(layout).kept.tolist()
    index = layout.document_index
    starts = layout.sentence_starts() | (index != torch.cat([torch.tensor([-1]), index[:-1]]))  # or a document's
    by_tokens = quality.select_kept(engine.draft_scoring.importance(layout), layout.document_index, keep_rate=0.3,
                                    chunk_size=32)  # fmt: skip
    for kept in (methods["self-sentences"]({}, layout, 0.3).kept, sentences.select(layout).kept):
        mask = torch.zeros(len(layout), dtype=torch.bool)
        mask[kept] = True
        first_kept = mask & (layout.document_index >= 0) & ~torch.cat([torch.tensor([False]), mask[:-1]])
        assert starts[first_kept].all()  # every kept run of document tokens begins a sentence
    assert by_tokens.tolist() != sentences.select(layout).kept.tolist()


def test_the_draft_phase_timer_counts_each_phase_and_restores_the_originals():
    import document_cache_speed as study

    def current():
        return {name: getattr(owner, attribute) for name, (owner, attribute) in study.PHASES.items()}

    originals = current()
    with study.phase_timer() as spent:
        assert all(current()[name] is not originals[name] for name in originals)
        study.assembly._recomputed(
            None, 1, None, torch.zeros((0, 2), dtype=torch.long), [], torch.zeros(0), study.DocumentRepair("naive")
        )
    assert current() == originals
    assert spent["probe"] > 0 and spent["encode_documents"] == spent["fresh_forward"] == spent["score"] == 0


def test_the_draft_table_reads_each_arm_against_the_cold_draft():
    import document_cache_speed as study

    def arm(draft_ms):
        return {"draft_ms": draft_ms, "prompt_tokens": 2100, "phases_ms": dict.fromkeys(study.PHASES, 1.0)}

    settings = {"lengths": [2000], "repairs": ["blend"], "draft_layers": [8], "first_sights": ["alone", "in_context"]}
    settings["warm_layers"] = [8]
    arms = {"cold": arm(1000.0), "cold-layers8": arm(400.0), "first": arm(1200.0), "warm-blend": arm(300.0)}
    arms |= {"first-layers8": arm(500.0), "warm-layers8-blend": arm(150.0)}
    records = [{"length": 2000, **arms, "first-in_context": arm(1000.0)}]
    table = study.draft_table({"settings": settings, "machine": [], "records": records})
    rows = {line.split(" | ")[2]: line for line in table.splitlines() if line.startswith("| 2,000")}
    assert set(rows) == {"cold (joint)", "cold-layers8", "first", "first-in_context", "warm-blend", *arms} - {"cold"}
    assert "| 0.15 (0.15-0.15) |" in rows["warm-layers8-blend"]
    assert "| 0.40 (0.40-0.40) |" in rows["cold-layers8"] and "| 1.00 (1.00-1.00) |" in rows["first-in_context"]
    assert "| 1.20 (1.20-1.20) |" in rows["first"] and "| 0.30 (0.30-0.30) |" in rows["warm-blend"]


def test_the_speed_table_reads_a_truncated_draft_s_cached_arm_against_the_whole_draft_cold():
    import document_cache_speed as study

    def arm(ttft_ms, draft_ms):
        return {"ttft_ms": ttft_ms, "draft_ms": draft_ms, "prompt_tokens": 4100, "draft_documents_cached": 10}

    settings = {"lengths": [4000], "keeps": [0.1], "repairs": ["blend"], "draft_layers": [8]}
    row = {"length": 4000, "documents": 10, "full": arm(10000.0, 0.0), "cold@0.1": arm(5000.0, 4000.0)}
    row |= {"cached@0.1": arm(2500.0, 1600.0), "cached-layers8@0.1": arm(1600.0, 560.0)}
    table = study.speed_table({"settings": settings, "machine": [], "corpus": {}, "records": [row]})
    rows = {line.split(" | ")[4]: line for line in table.splitlines() if line.startswith("| 4,000")}
    assert set(rows) == {"whole", "first 8 layers"}
    # full / cached, cold / cached, then the cached draft against the whole draft's cold one
    assert "| 6.25 (6.25-6.25) | 3.12 (3.12-3.12) |" in rows["first 8 layers"]
    assert "| 0.14 (0.14-0.14) |" in rows["first 8 layers"] and "| 0.40 (0.40-0.40) |" in rows["whole"]
    assert study.cached_arm(0.3, "query:0.1", 12) == "cached-layers12-query:0.1@0.3"


def test_a_repairs_entry_names_a_repair_and_blend_takes_a_share():
    import document_cache_speed as study

    assert study.repair_of("naive") == study.DocumentRepair("naive")
    assert study.repair_of("blend:0.05") == study.DocumentRepair("blend", share=0.05)
    assert study.repair_spec("blend:0.05") == "blend:0.05"
    assert study.repair_of("query") == study.DocumentRepair("query")
    assert study.repair_of("query:0.1") == study.DocumentRepair("query", share=0.1)
    for bad in ("naive:0.05", "epic:0.1", "blend:2", "query:-1", "cacheblend", "blend:x"):
        with pytest.raises(study.argparse.ArgumentTypeError):
            study.repair_spec(bad)


@pytest.mark.parametrize(("warmed", "layers"), [(0, None), (5, None), (0, 1)])
def test_a_resumed_zipf_run_rebuilds_the_store_an_uninterrupted_run_holds(tiny_model, tokenizer, warmed, layers):
    """The questions already answered are asked again (after the run's own warm-up of the most popular
    paragraphs, if any): the store must equal, entry for entry and in LRU order, the store that answering them
    left, with documents evicted and kept out on the way, and its admission counts with it."""
    import document_cache_speed as study

    from specprefill_rag import SpecPrefillEngine
    from specprefill_rag.testing import random_documents

    many = layers is not None  # a truncated draft's entries are smaller: more documents to fill the store
    texts = random_documents(60 if many else 24, 120, seed=11)
    corpus = [{"text": text, "question": f"What is said in paragraph {i}?"} for i, text in enumerate(texts)]
    asked = study.zipf_questions(corpus, questions=30 if many else 14, retrieved=4, exponent=0.5, seed=3)
    engine = SpecPrefillEngine.from_models(
        tiny_model, tokenizer, tiny_model, min_prompt_tokens=0, document_cache_mb=1,
        draft_document_cache=True, draft_cache_mb=0, main_cache_mb=0,
        **({"look_ahead": 1} if layers is None else {"draft_layers": layers}),
    )  # fmt: skip
    store = engine.document_cache
    store.clear()
    assert study.warm_popular(engine, corpus, warmed) == warmed
    records = []
    for number, question in enumerate(asked):
        documents = [corpus[i]["text"] for i in question["documents"]]
        result = engine.generate(corpus[question["about"]]["question"], documents, study.SYSTEM, max_new_tokens=1)
        records.append({"question": number, "cached": study.record(result)})
    uninterrupted = [(key, store._entries[key].nbytes) for key in store._kept.keys()]
    counts = [store._kept.sketch.estimate(key) for key, _ in uninterrupted]
    seen = set(range(warmed)) | {i for q in asked for i in q["documents"]}
    store.clear()
    held = study.rebuild_store(engine, corpus, asked, records, warmed)
    assert len(seen) + 1 > len(uninterrupted) and held == len(uninterrupted) - 1  # some were evicted
    assert [(key, store._entries[key].nbytes) for key in store._kept.keys()] == uninterrupted
    assert [store._kept.sketch.estimate(key) for key, _ in uninterrupted] == counts
    records[-1]["cached"]["draft_documents_cached"] += 1
    store.clear()
    with pytest.raises(SystemExit, match="found other documents held"):
        study.rebuild_store(engine, corpus, asked, records, warmed)
    store.clear()


def test_the_store_replay_evicts_the_least_recently_used_and_never_a_pinned_document():
    from document_cache_speed import replay_store

    requests = [[(1, 4), (2, 4)], [(1, 4), (3, 4)], [(1, 4), (2, 4)]]
    hits, held = replay_store(requests, budget=10, admission=False)
    assert hits == 2 and held.keys() == [1, 2]  # 1 hits twice; 2 leaves for 3 (1 was just used), 3 for 2
    hits, held = replay_store(requests, budget=10, pinned={2: 4}, admission=False)
    assert hits == 3 and held.keys() == [1]  # 2 always hits; 1 and 3 take turns in the room the pin leaves
    hits, held = replay_store([[(5, 8)]], budget=10, pinned={2: 4})
    assert hits == 0 and len(held) == 0  # no room beside the pinned entry: kept out, as the store does
    hits, held = replay_store(requests, budget=10)
    assert hits == 3 and held.keys() == [1, 2]  # 3, asked for once, does not push 2 (as often) out: 2 hits again


class KeywordEmbedder:
    """A stand-in for all-MiniLM-L6-v2: one dimension per keyword, so similarity is keyword overlap."""

    KEYWORDS = ("bridge", "opened", "1883", "river", "paris")

    def encode(self, texts, convert_to_tensor, normalize_embeddings):
        vectors = torch.tensor([[float(k in t.lower()) for k in self.KEYWORDS] + [0.01] for t in texts])
        return torch.nn.functional.normalize(vectors, dim=-1) if normalize_embeddings else vectors


def test_sentences_split_after_stops_and_at_line_breaks():
    from sentence_filter import split_sentences

    text = "The bridge opened in 1883. Was it long?  Yes!\nA new line\n\n  then more. e.g"
    assert split_sentences(text) == [
        "The bridge opened in 1883.",
        "Was it long?",
        "Yes!",
        "A new line",
        "then more.",
        "e.g",
    ]
    assert split_sentences(" \n ") == []


def test_the_sentence_filter_keeps_the_question_s_sentences_within_the_budget_in_order(tokenizer):
    from sentence_filter import SentenceFilter

    documents = [
        "Paris has a river. The weather was mild that year. Many people lived there.",
        "The bridge opened in 1883. It crosses the river. Cars came much later on.",
        "Nothing here is about the question at all. Neither is this one.",
    ]
    question = "When was the bridge over the river opened?"
    sentence_filter = SentenceFilter(tokenizer, KeywordEmbedder())
    sentences = sentence_filter.sentences(documents)
    tokens = {s.text: s.tokens for s in sentences}
    budget = tokens["The bridge opened in 1883."] + tokens["It crosses the river."] + tokens["Paris has a river."]
    keep_rate = budget / sum(tokens.values())
    # best first: the bridge sentence, then the two river ones; the third document keeps nothing and is left
    # out; each document's sentences stay in their original order
    assert sentence_filter.filter(documents, question, keep_rate) == [
        "Paris has a river.",
        "The bridge opened in 1883. It crosses the river.",
    ]
    one_less = (budget - 1) / sum(tokens.values())
    assert sentence_filter.filter(documents, question, one_less) == ["The bridge opened in 1883. It crosses the river."]
    assert sentence_filter.filter(documents, question, keep_rate=1.0) == documents


def test_the_most_similar_sentence_is_kept_even_over_a_tiny_budget(tokenizer):
    from sentence_filter import SentenceFilter

    documents = ["Some text on rivers in general. The bridge opened in 1883 after years of work on it."]
    kept = SentenceFilter(tokenizer, KeywordEmbedder()).filter(documents, "When was the bridge opened?", 0.01)
    assert kept == ["The bridge opened in 1883 after years of work on it."]


def test_specprefill_after_the_filter_keeps_the_keep_rate_of_the_original_documents():
    from sentence_filter import sparse_keep_rate

    assert sparse_keep_rate(0.1, 1000, 500) == pytest.approx(0.2)  # half filtered out: twice the rate on the rest
    assert sparse_keep_rate(0.3, 1000, 200) == 1.0  # the filter already kept less than the budget
    assert sparse_keep_rate(0.1, 1000, 0) == 1.0  # nothing left to select from


def test_a_quality_method_runs_specprefill_on_what_the_filter_kept(tiny_model, tiny_draft, tokenizer, monkeypatch):
    """``embeddings-filter50-specprefill``: the prompt is laid out with the filter's sentences (50% of the
    documents' tokens) and the draft's selection on it keeps twice the keep rate of what is left."""

    import quality
    import sentence_filter

    from specprefill_rag import SpecPrefillEngine

    monkeypatch.setattr(sentence_filter, "load_minilm", KeywordEmbedder)
    engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, tiny_draft, min_prompt_tokens=0, look_ahead=2)
    name = "embeddings-filter50-specprefill"
    args = method_args(name)
    text = (Path(__file__).parent.parent / "examples" / "documents" / "brooklyn_bridge.txt").read_text()
    sample = {"question": "When was the bridge over the river opened?", "documents": [text[:600], text[600:1200]]}
    layout = quality.sample_layout(engine, sample)
    prefill = quality.make_methods(engine, args)[name](sample, layout, 0.1)

    kept_text = sentence_filter.SentenceFilter(tokenizer, KeywordEmbedder()).filter(
        sample["documents"], sample["question"], 0.5
    )
    shorter = quality.sample_layout(engine, sample, kept_text)
    assert prefill.layout.input_ids.tolist() == shorter.input_ids.tolist()
    assert shorter.n_document_tokens < layout.n_document_tokens
    rate = sentence_filter.sparse_keep_rate(0.1, layout.n_document_tokens, shorter.n_document_tokens)
    assert 0.1 < rate < 1
    expected = quality.select_kept(
        engine.draft_scoring.importance(shorter), shorter.document_index, keep_rate=rate, chunk_size=32
    )
    assert prefill.kept.tolist() == expected.tolist() and torch.equal(prefill.positions, prefill.kept)
    assert quality.rewrites_text(name) and not quality.rewrites_text("specprefill")


class _Store:
    """A vector store stand-in: the chunks in a fixed order, the first ``k`` for any query."""

    def __init__(self, chunks: list[str]) -> None:
        self.chunks = chunks

    def similarity_search(self, query: str, k: int) -> list:
        from langchain_core.documents import Document

        return [Document(page_content=text, metadata={"source": "a.txt"}) for text in self.chunks[:k]]


def test_the_agent_study_records_whether_its_tool_returned_the_answer():
    import agent_patterns

    class Retriever:
        vectorstore = _Store(["a decree of 196 BC", "a symbol of decipherment", "found in July 1799"])

    top_two = agent_patterns.Tool({"langchain": Retriever()}, k=2)
    top_two.retrieve("In what year was the Rosetta Stone found?")
    top_three = agent_patterns.Tool({"langchain": Retriever()}, k=3)
    top_three.retrieve("In what year was the Rosetta Stone found?")

    assert "1799" not in top_two.results[0] and "1799" in top_three.results[0]
    assert agent_patterns.retrieved_cell({"answer_retrieved": False}) == "no"
    assert agent_patterns.retrieved_cell({}) == "not recorded"  # a run recorded before the tool kept its results
    quoted_then_wrong = "The context says the stone was found in July 1799.\n\nTherefore the answer is:\n\n2019\n"
    assert not agent_patterns.final_line_ok(quoted_then_wrong)
    assert agent_patterns.final_line_ok("It was found in July 1799.\nTherefore: 1799.")
    looping = {"answer": "It was found in July 1799 while working on it while working on it", "calls": [{}]}
    assert agent_patterns.stopped_at_limit(looping, 256) is None  # the gateway's headers give no token count
    looping["calls"] = [{"completion_tokens": 26}, {"completion_tokens": 256}]
    assert agent_patterns.stopped_at_limit(looping, 256) and not agent_patterns.concluded_ok(looping, 256)
    looping["calls"][-1]["completion_tokens"] = 40
    assert agent_patterns.concluded_ok(looping, 256)


def test_the_tool_query_study_changes_only_what_the_draft_reads_after_the_prompt():
    import agentic
    import tool_query

    from specprefill_rag.prompt.chat import chat_layout
    from specprefill_rag.testing import build_family_tokenizer

    tokenizer = build_family_tokenizer("qwen3")
    tokenizer.chat_template = (Path(__file__).parent / "fixtures" / "chat_templates" / "qwen2_5.jinja").read_text()
    sample = {
        "question": "When did the bridge open?",
        "paragraphs": [("Bridge", "The bridge opened in 1883."), ("River", "The river is wide."), ("Town", "A town.")],
    }
    messages, search = tool_query.second_step(sample, "Answer briefly.", top_k=2)
    layout = chat_layout(tokenizer, messages, tools=[agentic.SEARCH]).layout
    text = tool_query.query_text("question-answer", sample["question"], search["arguments"])
    formed = tool_query.with_query(layout, tokenizer, text)

    assert text.endswith("Answer:") and tokenizer.decode(formed.draft_query_ids) == text
    assert torch.equal(formed.input_ids, layout.input_ids)  # the prompt the main model prefills is the same
    assert formed.source.render(tokenizer).draft_query_ids.tolist() == formed.draft_query_ids.tolist()
    assert "1883" in tool_query.kept_document_text(layout, None, tokenizer)
    assert tool_query.contains_answer(search["result"], ["1883"])
    assert tool_query.checkable(["1883"]) and not tool_query.checkable(["no"])  # "no" is inside "not", "known"


def test_first_call_probe_reads_the_start_of_step_one_per_prompt(task_data, tmp_path):
    """benchmarks/first_call.py on a tiny random Qwen-format model: one record per question and prompt, the call
    openings' first-token probability in [0, 1], a greedy start judged by the lazy grammar's triggers, and the
    agreement with a stored agentic run counted only for the prompt that run used."""
    import json

    import agentic
    import first_call

    from specprefill_rag.testing import build_family_tokenizer, build_model

    tokenizer = build_family_tokenizer("qwen3")
    tokenizer.chat_template = (Path(__file__).parent / "fixtures" / "chat_templates" / "qwen2_5.jinja").read_text()
    model = build_model(tokenizer, layers=1)
    openings = first_call.opening_ids(tokenizer)
    assert tokenizer.convert_tokens_to_ids("<tool_call>") in openings
    assert tokenizer.encode('{{"name"', add_special_tokens=False)[0] in openings  # '{' here; '{{' in Qwen's vocabulary
    stored = {
        "settings": {"system": agentic.SYSTEM},
        "records": [
            {"question": 0, "runs": {"1": {"natural_call": True}}},
            {"question": 1, "runs": {"1": {"natural_call": False}}},
        ],
    }
    (tmp_path / "stored.json").write_text(json.dumps(stored))
    out = tmp_path / "probe"
    argv = ["--questions", "2", "--prompts", "agentic", "tutorial-helpful-assistant", "--out", str(out)]
    report = first_call.main([*argv, "--against", str(tmp_path / "stored.json")], model=model, tokenizer=tokenizer)

    assert json.loads(Path(f"{out}.json").read_text())["prompts"] == report["prompts"]
    for entry in report["prompts"].values():
        assert [row["question"] for row in entry["records"]] == [0, 1]
        for row in entry["records"]:
            assert 0.0 <= row["p_call"] <= 1.0 and row["prompt_tokens"] > 0
            assert row["opens_call"] == first_call.starts_a_call(row["greedy_start"])
    probe = report["prompts"]["agentic"]["records"]
    assert report["agreement"] == {"agentic": int(probe[0]["opens_call"]) + int(not probe[1]["opens_call"])}
    assert "| agentic | 2 |" in Path(f"{out}.md").read_text()
    # what counts as a call: the lazy grammar's triggers, a marker spelled in ordinary tokens decodes the same
    calls = ['<tool_call>\n{"name": "search"', '{{"name": "The Wire", "arg', 'Sure. {"name": "search", "arg']
    assert all(first_call.starts_a_call(text) for text in calls)
    answers = ['{"name": "Alice", "age": 3}', "The search found 1883.", "<tool_response>\nParis"]
    assert not any(first_call.starts_a_call(text) for text in answers)


def test_the_fresh_forward_study_times_both_attentions_on_the_same_kv(tiny_model):
    """``fresh_forward.py``: both arms write the same fresh KV (float32), and the grouped attention is restored."""
    import fresh_forward

    from specprefill_rag.draft import assembly

    record = fresh_forward.run_setting(tiny_model, 60, 0.4, repeats=2, seed=1)
    assert record["prompt_tokens"] == 60 and 30 <= record["fresh_tokens"] < 60
    assert [len(record["seconds"][arm]) for arm in ("one_mask", "grouped")] == [2, 2]
    assert record["largest_relative_difference"] < 1e-5
    assert assembly._masked_attention is fresh_forward.GROUPED
    assert "| 60 |" in fresh_forward.table({"settings": {}, "machine": [], "records": [record]})


@pytest.mark.parametrize("repair", ["naive", "blend"])
def test_the_window_fold_study_scores_both_warm_arms_alike(tiny_model, repair):
    """``window_fold.py``: the folded window and the two-pass reference score a warm prompt alike (float32), every
    arm timed per repeat."""
    import window_fold

    ids, spans = window_fold.prompt(tiny_model.config.vocab_size, documents=3, document_tokens=20, seed=1)
    assert ids.numel() == window_fold.PREFIX + 3 * 21 + window_fold.QUESTION
    record = window_fold.run_repair(tiny_model, repair, ids, spans, repeats=2)
    assert [len(record["seconds"][arm]) for arm in window_fold.ARMS] == [2, 2, 2, 2]
    assert record["largest_relative_score_difference"] < 1e-5
    assert f"| {repair} | {ids.numel()} |" in window_fold.table({"settings": {}, "machine": [], "records": [record]})


def test_the_first_sight_order_study_runs_every_arm_and_reads_them_against_both_colds(tiny_model, tokenizer):
    """``first_sight_order.py``: each arm answers the prompt (in context: every document a miss, none served from
    a store, on a new engine or a used one), and the table reads each arm against both cold arms."""
    import first_sight_order as study

    from specprefill_rag import SpecPrefillEngine
    from specprefill_rag.testing import random_documents

    settings = {"keep": 0.5}
    cold = SpecPrefillEngine.from_models(
        tiny_model, tokenizer, tiny_model, document_cache_mb=0, min_prompt_tokens=0, draft_cache_mb=0, keep_rate=0.5
    )
    documents = random_documents(3, 80)
    arms = study.arms(tiny_model, tokenizer, cold, settings, number=0)
    assert tuple(arms) == study.ARMS
    row = {name: arm(documents, "When did the bridge open?") for name, arm in arms.items()}
    assert all(record["compressed"] and record["draft_ms"] > 0 for record in row.values())
    assert row["in_context-new"]["draft_documents_cached"] == row["in_context-used"]["draft_documents_cached"] == 0
    assert len({record["prompt_tokens"] for record in row.values()}) == 1
    timed = {name: row[name] | {"draft_ms": ms} for name, ms in zip(study.ARMS, (1000.0, 800.0, 1100.0, 1200.0))}
    table = study.table({"settings": settings, "machine": [], "records": [timed]})
    lines = {
        line.split(" | ")[0][2:]: line for line in table.splitlines() if line.startswith("| ") and "---" not in line
    }
    assert lines["in_context-new"].endswith("| 1.10 (1.10-1.10) | 1.38 (1.38-1.38) |")
    assert lines["cold-new"].endswith("| 0.80 (0.80-0.80) | 1.00 (1.00-1.00) |")


def test_the_look_ahead_study_builds_an_engine_per_arm_and_reads_each_against_the_longest(tiny_model, tokenizer):
    """``look_ahead_speed.py``: each look-ahead its cold and cached engine (the cached ones with their own store),
    and the table reads each arm against full prefill, the cold draft and the same arm at the longest look-ahead."""
    import look_ahead_speed as study

    from specprefill_rag.testing import random_documents

    arms = study.engines(tiny_model, tokenizer, tiny_model, 0.5, [8, 4], [2])
    assert list(arms) == ["full", "cold-la8", "cached-la8", "cold-la4", "cached-la4", "cold-layers2", "cached-layers2"]
    assert [arms[name].draft.look_ahead for name in ("cold-la8", "cached-la4")] == [8, 4]
    assert [arms[name].draft.n_layers for name in ("cold-layers2", "cached-layers2")] == [2, 2]  # window queries
    assert arms["cached-layers2"].draft.document_cache is not arms["cached-la4"].draft.document_cache
    assert arms["cached-la8"].draft.document_cache is not arms["cached-la4"].draft.document_cache
    assert arms["cold-la4"].draft.document_cache is None
    documents = random_documents(3, 80)
    arms["cached-la4"].warm_documents(documents)
    warm = arms["cached-la4"].generate("When?", documents, max_new_tokens=1)
    assert warm.stats.draft_documents_cached == 3

    def arm(ttft_ms, draft_ms):
        return {"ttft_ms": ttft_ms, "draft_ms": draft_ms, "draft_documents_cached": 10}

    row = {"documents": 10, "full": arm(10000.0, 0.0), "cold-la8": arm(5000.0, 4000.0)}
    row |= {"cached-la8": arm(4000.0, 2000.0), "cold-la4": arm(4000.0, 3200.0), "cached-la4": arm(2500.0, 1200.0)}
    row |= {"cold-layers2": arm(4500.0, 3600.0), "cached-layers2": arm(2000.0, 800.0)}
    table = study.table({"settings": {"look_aheads": [8, 4], "draft_layers": [2]}, "machine": [], "records": [row]})
    lines = {line.split(" | ")[0][2:]: line for line in table.splitlines() if line.startswith("| c")}
    assert lines["cached-la4"].endswith(
        "| 4.00 (4.00-4.00) | 1,200 (1,200-1,200) | 0.30 (0.30-0.30) | 0.62 (0.62-0.62) | 1.00 (1.00-1.00) |"
    )
    assert lines["cold-la4"].endswith("| 0.80 (0.80-0.80) | 0.80 (0.80-0.80) | 1.00 (1.00-1.00) |")
    assert lines["cached-layers2"].endswith(
        "| 5.00 (5.00-5.00) | 800 (800-800) | 0.20 (0.20-0.20) | 0.50 (0.50-0.50) | 1.00 (1.00-1.00) |"
    )
