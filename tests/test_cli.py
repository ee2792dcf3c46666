import json

from specprefill_rag.cli import main

from specprefill_rag.testing import random_documents


def write_documents(folder, count=3):
    paths = []
    for index, text in enumerate(random_documents(count, 70)):
        path = folder / f"doc{index}.txt"
        path.write_text(text)
        paths.append(str(path))
    return paths


def test_ask_json_reports_numeric_stats(tmp_path, tiny_model_dir, capsys):
    docs = write_documents(tmp_path)
    model = str(tiny_model_dir)
    argv = ["ask", "--question", "When?", "--docs", *docs, "--main", model, "--draft", model]
    code = main([*argv, "--keep-rate", "0.2", "--min-prompt-tokens", "0", "--max-new-tokens", "5", "--json"])
    assert code == 0
    payload = json.loads(capsys.readouterr().out)
    stats = payload["stats"]
    assert isinstance(payload["answer"], str)
    assert stats["compressed"] is True and 0.2 <= stats["keep_rate"] < 1.0
    assert isinstance(stats["ttft_ms"], float) and stats["completion_tokens"] <= 5


def test_ask_keep_rate_auto_reports_the_chosen_share(tmp_path, tiny_model_dir, capsys):
    docs = write_documents(tmp_path)
    model = str(tiny_model_dir)
    argv = ["ask", "--question", "When?", "--docs", *docs, "--main", model, "--draft", model, "--min-prompt-tokens", "0"]
    assert main([*argv, "--keep-rate", "auto", "--max-new-tokens", "2", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["keep_policy"] == "auto" and stats["compressed"] is True
    assert stats["keep_rate"] == stats["kept_document_tokens"] / stats["document_tokens"]
    assert main([*argv, "--keep-rate", "auto", "--max-new-tokens", "2"]) == 0
    assert "chosen by auto" in capsys.readouterr().err


def test_ask_stream_prints_answer_and_stats(tmp_path, tiny_model_dir, capsys):
    docs = write_documents(tmp_path)
    model = str(tiny_model_dir)
    code = main(["ask", "--question", "When?", "--docs", *docs, "--main", model, "--draft", model, "--stream"])
    assert code == 0
    captured = capsys.readouterr()
    assert "document tokens" in captured.err and "TTFT" in captured.err


def test_ask_reports_bad_input_without_traceback(tmp_path, tiny_model_dir, capsys):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9")
    model = str(tiny_model_dir)
    assert main(["ask", "--question", "Q?", "--docs", str(bad), "--main", model, "--draft", model]) == 2
    assert "latin1.txt is not UTF-8" in capsys.readouterr().err
    good = write_documents(tmp_path, 1)
    assert main(["ask", "--question", "Q?", "--docs", *good, "--keep-rate", "2", "--main", model]) == 2
    assert "keep_rate" in capsys.readouterr().err
    assert main(["ask", "--question", "Q?", "--docs", str(tmp_path / "missing.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_serve_options_fill_the_gateway_settings(monkeypatch):
    from specprefill_rag.cli import parser, serve_settings
    from specprefill_rag.config import DEFAULT_DRAFT_CACHE_MB

    monkeypatch.setenv("SPECPREFILL_API_KEY", "from-env")
    args = parser().parse_args(["serve", "--port", "9001", "--keep-rate", "0.2", "--draft-batch-size", "8",
                                "--on-draft-error", "fail", "--request-timeout", "30"])
    settings = serve_settings(args)
    assert (settings.port, settings.keep_rate, settings.draft_batch_size) == (9001, 0.2, 8)
    assert settings.on_draft_error == "fail" and settings.request_timeout_s == 30
    assert settings.api_key.get_secret_value() == "from-env" and settings.host == "127.0.0.1"
    assert "from-env" not in repr(settings)  # the key is never printed
    explicit = serve_settings(parser().parse_args(["serve", "--api-key", "given"]))
    assert explicit.api_key.get_secret_value() == "given"
    auto = serve_settings(parser().parse_args(["serve", "--keep-rate", "auto", "--auto-keep-floor", "0.2",
                                               "--auto-keep-ceiling", "0.4", "--auto-keep-share", "0.7"]))
    config = auto.engine_config()
    assert config.keep_rate == "auto" and (config.auto_keep_share, config.auto_keep_floor, config.auto_keep_ceiling) \
        == (0.7, 0.2, 0.4)
    bounded = serve_settings(parser().parse_args(["serve", "--max-draft-tokens", "2048", "--draft-cache-mb", "0"]))
    assert (bounded.engine_config().max_draft_tokens, bounded.engine_config().draft_cache_mb) == (2048, 0)
    assert serve_settings(parser().parse_args(["serve"])).engine_config().draft_cache_mb == DEFAULT_DRAFT_CACHE_MB
    assert serve_settings(parser().parse_args(["serve"])).engine_config().positions == "original"
    renumbered = serve_settings(parser().parse_args(["serve", "--positions", "contiguous"]))
    assert renumbered.engine_config().positions == "contiguous"


def test_serve_reports_bad_settings_without_traceback(capsys):
    assert main(["serve", "--keep-rate", "0", "--port", "1"]) == 2
    assert "keep_rate" in capsys.readouterr().err


def test_draft_batch_size_defaults_to_the_measured_choice_per_device():
    from specprefill_rag.serve.settings import GatewaySettings

    assert GatewaySettings(device="cpu").resolved_draft_batch_size() == 1
    assert GatewaySettings(device="cuda:1").resolved_draft_batch_size() == 8
    assert GatewaySettings(device="cpu", draft_batch_size=3).resolved_draft_batch_size() == 3
