import json

import pytest

from specprefill_rag.cli import ASK_DECODING, main, parser
from specprefill_rag.config import GenerationParams, SpecPrefillConfig
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


def test_ask_takes_the_decoding_settings_and_returns_logprobs(tmp_path, tiny_model_dir, capsys):
    docs = write_documents(tmp_path)
    model = str(tiny_model_dir)
    argv = ["ask", "--question", "When?", "--docs", *docs, "--main", model, "--draft", model, "--json"]
    options = ["--max-new-tokens", "3", "--logprobs", "--top-logprobs", "2", "--top-p", "0.9", "--seed", "7"]
    assert main([*argv, *options]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert 1 <= len(payload["logprobs"]) <= 3
    assert all(len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0 for entry in payload["logprobs"])


def test_ask_options_are_the_generation_params_fields():
    """Generated from GenerationParams: each option's help holds the field's description; an option not given
    is left out, so the field's default applies."""
    assert not hasattr(parser().parse_args(["ask", "--question", "q", "--docs", "f"]), "top_p")
    ask = parser()._subparsers._group_actions[0].choices["ask"]
    options = {action.dest: action for action in ask._actions}
    for name in ASK_DECODING:
        assert (GenerationParams.model_fields[name].description or "") in options[name].help


def test_ask_options_are_the_engine_settings_fields():
    """Every SpecPrefillConfig field is an ``ask`` option with its description; one not given is left out, so the
    engine's default applies, and one given reaches the engine's config."""
    ask = parser()._subparsers._group_actions[0].choices["ask"]
    options = {action.dest: action for action in ask._actions}
    for name, info in SpecPrefillConfig.model_fields.items():
        assert (info.description or "")[:40] in options[name].help.replace("%%", "%")
    argv = ["ask", "--question", "q", "--docs", "f"]
    assert not {"keep_rate", "main", "device"} & set(vars(parser().parse_args(argv)))
    given = parser().parse_args([*argv, "--keep-rate", "auto", "--look-ahead", "4", "--draft-document-cache"])
    assert (given.keep_rate, given.look_ahead, given.draft_document_cache) == ("auto", 4, True)


def test_ask_passes_engine_settings_to_the_engine(tmp_path, tiny_model_dir, capsys):
    docs = write_documents(tmp_path)
    model = str(tiny_model_dir)
    argv = ["ask", "--question", "When?", "--docs", *docs, "--main", model, "--draft", model, "--json"]
    assert main([*argv, "--keep-rate", "0.5", "--min-prompt-tokens", "0", "--chunk-size", "8"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert 0.45 < stats["keep_rate"] < 0.55 and stats["compressed"] is True  # the default keeps 0.3
    assert main([*argv, "--chunk-size", "0"]) == 2
    assert "chunk_size" in capsys.readouterr().err


@pytest.mark.parametrize("option", [["--top-p", "1.5"], ["--top-logprobs", "21"], ["--temperature", "-1"]])
def test_ask_refuses_decoding_settings_out_of_bounds(tmp_path, tiny_model_dir, capsys, option):
    docs = write_documents(tmp_path)
    model = str(tiny_model_dir)
    assert main(["ask", "--question", "Q?", "--docs", *docs, "--main", model, "--draft", model, *option]) == 2
    assert option[0].lstrip("-").replace("-", "_") in capsys.readouterr().err


def test_ask_keep_rate_auto_reports_the_chosen_share(tmp_path, tiny_model_dir, capsys):
    docs = write_documents(tmp_path)
    model = str(tiny_model_dir)
    argv = [
        "ask",
        "--question",
        "When?",
        "--docs",
        *docs,
        "--main",
        model,
        "--draft",
        model,
        "--min-prompt-tokens",
        "0",
    ]
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
    args = parser().parse_args(
        [
            "serve",
            "--port",
            "9001",
            "--keep-rate",
            "0.2",
            "--draft-batch-size",
            "8",
            "--on-draft-error",
            "fail",
            "--request-timeout",
            "30",
        ]
    )
    settings = serve_settings(args)
    assert (settings.port, settings.keep_rate, settings.draft_batch_size) == (9001, 0.2, 8)
    assert settings.on_draft_error == "fail" and settings.request_timeout_s == 30
    assert settings.api_key.get_secret_value() == "from-env" and settings.host == "127.0.0.1"
    assert "from-env" not in repr(settings)  # the key is never printed
    explicit = serve_settings(parser().parse_args(["serve", "--api-key", "given"]))
    assert explicit.api_key.get_secret_value() == "given"
    auto = serve_settings(
        parser().parse_args(
            [
                "serve",
                "--keep-rate",
                "auto",
                "--auto-keep-floor",
                "0.2",
                "--auto-keep-ceiling",
                "0.4",
                "--auto-keep-share",
                "0.7",
            ]
        )
    )
    config = auto.engine_config()
    assert config.keep_rate == "auto" and (
        config.auto_keep_share,
        config.auto_keep_floor,
        config.auto_keep_ceiling,
    ) == (0.7, 0.2, 0.4)
    bounded = serve_settings(parser().parse_args(["serve", "--max-draft-tokens", "2048", "--draft-cache-mb", "0"]))
    assert (bounded.engine_config().max_draft_tokens, bounded.engine_config().draft_cache_mb) == (2048, 0)
    assert serve_settings(parser().parse_args(["serve"])).engine_config().draft_cache_mb == DEFAULT_DRAFT_CACHE_MB
    assert serve_settings(parser().parse_args(["serve"])).engine_config().positions == "original"
    renumbered = serve_settings(parser().parse_args(["serve", "--positions", "contiguous"]))
    assert renumbered.engine_config().positions == "contiguous"

    # a separate draft scores with the look-ahead unless --draft-queries asks for the window
    def queries(*flags: str) -> tuple[str, int]:
        config = serve_settings(parser().parse_args(["serve", "--draft", "smollm2-135m", *flags])).engine_config()
        return config.queries, config.effective_look_ahead

    assert queries() == ("look_ahead", 8)
    assert queries("--look-ahead", "4") == ("look_ahead", 4)
    assert queries("--draft-queries", "window") == ("window", 1)


def test_serve_reports_bad_settings_without_traceback(capsys):
    assert main(["serve", "--keep-rate", "0", "--port", "1"]) == 2
    assert "keep_rate" in capsys.readouterr().err


def test_draft_batch_size_defaults_to_the_measured_choice_per_device():
    from specprefill_rag.serve.settings import GatewaySettings

    assert GatewaySettings(device="cpu").resolved_draft_batch_size() == 1
    assert GatewaySettings(device="cuda:1").resolved_draft_batch_size() == 8
    assert GatewaySettings(device="cpu", draft_batch_size=3).resolved_draft_batch_size() == 3


# The serve options every release so far has had: generated from GatewaySettings now, they must all stay.
RELEASED_SERVE_OPTIONS = [
    "--main",
    "--draft",
    "--host",
    "--port",
    "--api-key",
    "--served-model-name",
    "--keep-rate",
    "--auto-keep-share",
    "--auto-keep-floor",
    "--auto-keep-ceiling",
    "--max-document-tokens",
    "--min-prompt-tokens",
    "--look-ahead",
    "--positions",
    "--device",
    "--dtype",
    "--on-draft-error",
    "--on-missing-plugin",
    "--max-draft-tokens",
    "--draft-cache-mb",
    "--queue-size",
    "--draft-batch-size",
    "--draft-batch-tokens",
    "--batch-window-ms",
    "--request-timeout",
    "--upstream-timeout",
    "--log-level",
]


def test_every_gateway_setting_is_a_serve_option_and_no_released_option_is_gone():
    from specprefill_rag.cli import option_name, parser
    from specprefill_rag.serve.settings import GatewaySettings

    serve = parser()._subparsers._group_actions[0].choices["serve"]
    options = {flag: action.dest for action in serve._actions for flag in action.option_strings}
    assert set(RELEASED_SERVE_OPTIONS) <= set(options)
    for name, info in GatewaySettings.model_fields.items():
        flag = option_name(name, info.annotation)
        assert options[flag] == name
        assert info.description and info.description.split()[0] in serve.format_help(), name


def test_generated_serve_options_parse_into_the_settings():
    from specprefill_rag.cli import parser, serve_settings

    args = parser().parse_args(
        [
            "serve",
            "--keep-rate",
            "auto",
            "--look-ahead",
            "4",
            "--positions",
            "contiguous",
            "--dtype",
            "float32",
            "--allowed-host",
            "gw.internal",
            "--allowed-host",
            "*.example.com",
            "--cors-origin",
            "https://app.example",
            "--header-timeout",
            "2.5",
            "--max-body-bytes",
            "4096",
            "--protect-tail-tokens",
            "8",
        ]
    )
    settings = serve_settings(args)
    assert settings.keep_rate == "auto" and settings.look_ahead == 4 and settings.positions == "contiguous"
    assert settings.allowed_hosts == ("gw.internal", "*.example.com") and settings.cors_origins == (
        "https://app.example",
    )
    assert settings.header_timeout_s == 2.5 and settings.max_body_bytes == 4096
    config = settings.engine_config()
    assert (config.keep_rate, config.look_ahead, config.positions, config.dtype, config.protect_tail_tokens) == (
        "auto",
        4,
        "contiguous",
        "float32",
        8,
    )
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--keep-rate", "lots"])
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--dtype", "int8"])


def test_boolean_serve_options_are_switches():
    from specprefill_rag.cli import parser, serve_settings

    assert serve_settings(parser().parse_args(["serve"])).reselect is True
    assert serve_settings(parser().parse_args(["serve", "--no-reselect"])).reselect is False
    settings = serve_settings(parser().parse_args(["serve", "--draft-document-cache", "--reselect"]))
    assert settings.draft_document_cache is True and settings.reselect is True
    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--reselect", "false"])  # a switch takes no value ("false" would be truthy)
