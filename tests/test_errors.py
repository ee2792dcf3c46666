"""Bad input gets a clear, typed error that names the problem and the fix."""

import pytest
from pydantic import ValidationError

from specprefill_rag import (
    ContextLengthError,
    InvalidRequestError,
    ModelLoadError,
    SpecPrefillConfig,
    SpecPrefillEngine,
    TokenizerMismatchError,
)
from specprefill_rag.models.loading import load_model
from specprefill_rag.testing import build_model, build_tokenizer, random_documents


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer):
    return SpecPrefillEngine.from_models(tiny_model, tokenizer, min_prompt_tokens=0)


@pytest.mark.parametrize("keep_rate", [0.0, -0.5, 1.5])
def test_keep_rate_outside_range(keep_rate, engine):
    with pytest.raises(ValidationError, match="keep_rate"):
        SpecPrefillConfig(keep_rate=keep_rate)
    with pytest.raises(InvalidRequestError, match=r"keep_rate must be in \(0, 1\]"):
        engine.generate("Q?", ["some text"], keep_rate=keep_rate)


@pytest.mark.parametrize(
    "settings, field",
    [
        ({"pool_kernel": 12}, "pool_kernel must be odd"),
        ({"draft": "self:x"}, "self:<n>"),
        ({"chunk_size": 0}, "chunk_size"),
    ],
)
def test_bad_config_names_the_field(settings, field):
    with pytest.raises(ValidationError, match=field):
        SpecPrefillConfig(**settings)


def test_self_draft_with_explicit_look_ahead():
    with pytest.raises(ValidationError, match="look_ahead"):
        SpecPrefillConfig(draft="self:4", look_ahead=8)
    assert SpecPrefillConfig(draft="self:4").effective_look_ahead == 1


@pytest.mark.parametrize("question", ["", "   "])
def test_empty_question(engine, question):
    with pytest.raises(InvalidRequestError, match="question is empty"):
        engine.generate(question, ["a document"])


@pytest.mark.parametrize(
    "documents, match",
    [
        ([], "no documents given"),
        ("a string, not a list", "documents must be a list .* got str; wrap a single document"),
    ],
)
def test_no_documents(engine, documents, match):
    with pytest.raises(InvalidRequestError, match=match):
        engine.generate("Q?", documents)


def test_empty_document_named_by_index(engine):
    with pytest.raises(InvalidRequestError, match="document 1 is empty"):
        engine.generate("Q?", ["fine", "  \n"])


def test_non_utf8_document(engine):
    with pytest.raises(InvalidRequestError, match="document 0 is not valid UTF-8"):
        engine.generate("Q?", [b"caf\xe9 au lait"])
    assert engine.generate("Q?", ["café".encode()], max_new_tokens=1).stats.prompt_tokens > 0


def test_wrong_document_type(engine):
    with pytest.raises(InvalidRequestError, match="document 0 has type int"):
        engine.generate("Q?", [42])


def test_prompt_longer_than_context(tokenizer):
    small = SpecPrefillEngine.from_models(build_model(tokenizer, max_positions=64), tokenizer)
    with pytest.raises(ContextLengthError, match=r"prompt has \d+ tokens but the main model's context is 64"):
        small.generate("Q?", random_documents(2, 80))


def test_prompt_plus_max_new_tokens_exceeds_context(tokenizer):
    small = SpecPrefillEngine.from_models(build_model(tokenizer, max_positions=256), tokenizer)
    with pytest.raises(ContextLengthError, match=r"max_new_tokens=500 .* exceeds the main model's context of 256"):
        small.generate("Q?", ["short text"], max_new_tokens=500)


def test_tokenizer_mismatch(tokenizer):
    other_tokenizer = build_tokenizer(vocab_size=300, seed_text=["completely different words here"] * 10)
    from specprefill_rag.models.loading import check_same_vocabulary

    with pytest.raises(TokenizerMismatchError, match="same model family"):
        check_same_vocabulary(tokenizer, other_tokenizer)


def test_a_draft_folder_of_another_vocabulary_is_mapped_not_refused(tmp_path, tiny_model_dir):
    other_tokenizer = build_tokenizer(vocab_size=300, seed_text=["completely different words here"] * 10)
    other = build_model(other_tokenizer)
    other.save_pretrained(tmp_path / "other")
    other_tokenizer.save_pretrained(tmp_path / "other")
    assert SpecPrefillEngine(main=str(tiny_model_dir), draft=str(tmp_path / "other")).draft_path == "mapped"
    assert SpecPrefillEngine(main=str(tiny_model_dir), draft=str(tiny_model_dir)).draft_path == "direct"


def test_unknown_model_path():
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model("./no/such/model")


def test_unknown_hub_id_offline():
    with pytest.raises(ModelLoadError, match="cannot load model 'no-such-org/no-such-model'"):
        load_model("no-such-org/no-such-model")


def test_gguf_that_is_not_a_model(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPREFILL_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(text))
    truncated = tmp_path / "broken.gguf"
    truncated.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\x00" * 8)
    with pytest.raises(ModelLoadError, match="not a loadable GGUF model"):
        load_model(str(truncated))
    missing = tmp_path / "missing.gguf"
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(missing))


def test_self_draft_with_too_many_layers(tiny_model, tokenizer):
    with pytest.raises(InvalidRequestError, match="more layers than the main model has"):
        SpecPrefillEngine.from_models(tiny_model, tokenizer, draft="self:9")


def test_config_and_settings_together(tiny_model, tokenizer):
    with pytest.raises(InvalidRequestError, match="not both"):
        SpecPrefillEngine.from_models(tiny_model, tokenizer, config=SpecPrefillConfig(), keep_rate=0.5)


def test_failed_request_does_not_break_the_engine(engine):
    with pytest.raises(InvalidRequestError):
        engine.generate("", ["x"])
    assert engine.generate("Q?", ["a document"], max_new_tokens=2).stats.prompt_tokens > 0


def test_adapter_config_backend_and_look_ahead():
    from pydantic import ValidationError

    from specprefill_rag.config import adapter_config

    with pytest.raises(ValueError, match="neither 'transformers'"):
        adapter_config("grpc://host:8000", "smollm2-135m")
    with pytest.raises(ValueError, match="needs the main model in-process"):
        adapter_config("http://host:8000", "self:4")
    with pytest.raises(ValueError, match="needs the main model in-process"):
        adapter_config("http://host:8000", "self")
    assert adapter_config("http://host:8000", "smollm2-135m").look_ahead == 8
    assert adapter_config("transformers", "self").effective_look_ahead == 1
    assert adapter_config("transformers", "self:4").effective_look_ahead == 1
    assert adapter_config("transformers", "smollm2-135m", look_ahead=3).look_ahead == 3
    with pytest.raises(ValidationError, match="cannot decode look-ahead tokens"):  # set, not silently dropped
        adapter_config("transformers", "self:4", look_ahead=3)


def test_auto_dtype_is_float16_on_a_gpu_without_bfloat16(monkeypatch):
    import torch

    from specprefill_rag.models.loading import _dtype

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: False)
    assert _dtype("auto", "cuda:0") == torch.float16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    assert _dtype("auto", "cuda") == torch.bfloat16
    assert _dtype("float16", "cpu") == torch.float16
