"""A draft of another vocabulary through the engine: the mapped path, end to end on tiny random models
with two tokenizers built in the test, and on the vLLM client against a stand-in server."""

import asyncio
import json
from dataclasses import replace

import pytest
import torch

from specprefill_rag import DraftContextLengthError, GenerationParams, InvalidRequestError, SpecPrefillEngine
from specprefill_rag.backends.vllm import check_server_tokenizer, tool_markers
from specprefill_rag.cli import parser, serve_settings
from specprefill_rag.draft.paths import MappedScoring
from specprefill_rag.errors import TokenizerMismatchError
from specprefill_rag.prompt.chat import ChatMessage, chat_layout, mark_document
from specprefill_rag.prompt.layout import Role
from specprefill_rag.prompt.render import build_rag_layout
from specprefill_rag.selection import select_kept
from specprefill_rag.serve.app import build_engine
from specprefill_rag.testing import build_family_tokenizer, build_model, build_tokenizer, random_documents

from .test_vllm_client import StandIn, handler_class, serve

QUESTION = "When did the bridge open?"
SETTINGS = {"keep_rate": 0.2, "min_prompt_tokens": 0, "look_ahead": 3}


@pytest.fixture(scope="module")
def draft_tokenizer():
    return build_tokenizer(vocab_size=300)  # fewer merges: about twice the main model's tokens


@pytest.fixture(scope="module")
def other_draft(draft_tokenizer):
    return build_model(draft_tokenizer, layers=1, max_positions=4096, seed=1)


@pytest.fixture(scope="module")
def mapped(tiny_model, tokenizer, other_draft, draft_tokenizer):
    return SpecPrefillEngine.from_models(
        tiny_model, tokenizer, other_draft, draft_tokenizer=draft_tokenizer, **SETTINGS
    )


def test_a_draft_of_another_vocabulary_scores_through_characters(mapped, tokenizer):
    assert mapped.draft_path == "mapped"
    layout = mapped.layout(QUESTION, random_documents(4, 80), instructions="Answer briefly.")
    result = mapped.generate_layout(layout, GenerationParams(max_new_tokens=4))
    stats = result.stats
    assert stats.draft_path == "mapped" and stats.compressed
    assert 0.2 <= stats.keep_rate < 0.2 + 32 * 4 / stats.document_tokens
    for role in (Role.QUESTION, Role.INSTRUCTION, Role.TEMPLATE):
        assert int((layout.roles[result.kept_positions] == role).sum()) == int((layout.roles == role).sum())
    importance = mapped.draft_scoring.importance(layout)
    expected = select_kept(importance, layout.document_index, keep_rate=0.2, chunk_size=32)
    assert torch.equal(result.kept_positions, expected)  # the main tokens' chunks, ranked by the mapped scores
    draft_layout = mapped.draft_scoring.draft_layout(layout)
    assert len(draft_layout) != len(layout) and (draft_layout.input_ids < len(mapped.draft_scoring.tokenizer)).all()


def test_each_request_renders_the_prompt_for_the_draft_once(mapped, monkeypatch):
    # the request's checks render it (to refuse a prompt too long for the draft) and hand it to the scoring
    renders = []
    render = MappedScoring.draft_layout
    monkeypatch.setattr(MappedScoring, "draft_layout", lambda self, layout: renders.append(1) or render(self, layout))
    documents = random_documents(4, 80)
    mapped.generate(QUESTION, documents, max_new_tokens=2)
    assert len(renders) == 1
    asyncio.run(mapped.agenerate(QUESTION, documents, max_new_tokens=2))
    assert len(renders) == 2


def test_with_the_same_tokenizer_the_mapped_path_keeps_what_the_direct_one_keeps(tiny_model, tiny_draft, tokenizer):
    # no draft prefix cache: the second scoring of the same ids would start from the first one's KV and
    # match it to float tolerance, not bit for bit
    direct = SpecPrefillEngine.from_models(tiny_model, tokenizer, tiny_draft, draft_cache_mb=0, **SETTINGS)
    assert direct.draft_path == "direct"
    through_characters = MappedScoring(direct.draft, tokenizer, context_length=None, look_ahead=3)
    layout = direct.layout(QUESTION, random_documents(4, 80), instructions="Answer briefly.")
    expected, mapped = direct.draft_scoring.importance(layout), through_characters.importance(layout)
    documents = layout.document_index >= 0
    assert torch.equal(mapped[documents], expected[documents])
    kept = direct.select(layout).kept
    assert torch.equal(select_kept(mapped, layout.document_index, keep_rate=0.2, chunk_size=32), kept)


def test_the_stats_say_which_path_ran(tiny_model, tiny_draft, tokenizer):
    documents = random_documents(3, 60)
    direct = SpecPrefillEngine.from_models(tiny_model, tokenizer, tiny_draft, **SETTINGS)
    itself = SpecPrefillEngine.from_models(tiny_model, tokenizer, draft="self:1", min_prompt_tokens=0)
    for engine, path in [(direct, "direct"), (itself, "self")]:
        assert engine.draft_path == path
        assert engine.generate(QUESTION, documents, max_new_tokens=2).stats.draft_path == path
        assert engine.generate(QUESTION, documents, keep_rate=1.0, max_new_tokens=2).stats.draft_path is None


def test_the_draft_reads_the_turns_with_its_own_chat_template(tiny_model, tokenizer):
    llama3 = build_family_tokenizer("llama3")
    engine = SpecPrefillEngine.from_models(
        tiny_model, tokenizer, build_model(llama3, layers=1), draft_tokenizer=llama3, **SETTINGS
    )
    layout = engine.layout(QUESTION, random_documents(3, 60), instructions="Be brief.")
    draft_layout = engine.draft_scoring.draft_layout(layout)
    assert draft_layout.text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.")
    assert layout.text.startswith("<|im_start|>system\nBe brief.")
    assert engine.generate_layout(layout, GenerationParams(max_new_tokens=2)).stats.draft_path == "mapped"


def test_raw_text_and_chat_layouts_are_mapped_too(mapped):
    documents = random_documents(3, 60)
    prompt = "<|im_start|>user\n" + " ".join(documents) + " When?<|im_end|>\n<|im_start|>assistant\n"
    result = mapped.generate_text(prompt, parse_special_tokens=True, max_new_tokens=2)
    layout = mapped.text_layout(prompt, parse_special_tokens=True)
    assert result.stats.draft_path == "mapped" and result.stats.compressed
    assert torch.isin(torch.nonzero(layout.roles != Role.DOCUMENT).flatten(), result.kept_positions).all()
    for messages in (
        [ChatMessage("user", [" ".join(mark_document(d) for d in documents) + " " + QUESTION])],
        [ChatMessage("user", [" ".join(documents) + " " + QUESTION])],
    ):  # markers; the tail fallback
        chat = chat_layout(mapped.tokenizer, messages, protect_tail_tokens=8).layout
        assert mapped.generate_layout(chat, GenerationParams(max_new_tokens=2)).stats.draft_path == "mapped"


def test_a_prompt_longer_than_the_draft_context_is_a_typed_error(tiny_model, tokenizer, draft_tokenizer):
    short = build_model(draft_tokenizer, layers=1, max_positions=64)
    documents = random_documents(3, 60)
    for draft, draft_tok in [(short, draft_tokenizer), (build_model(tokenizer, layers=1, max_positions=64), None)]:
        engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, draft, draft_tokenizer=draft_tok, **SETTINGS)
        with pytest.raises(DraftContextLengthError, match=r"\+2 look-ahead\) but the draft's context is 64 tokens"):
            engine.generate(QUESTION, documents, max_new_tokens=2)
        assert engine.generate(QUESTION, documents, keep_rate=1.0, max_new_tokens=2).stats.compressed is False


def test_a_layout_built_by_hand_cannot_be_mapped(mapped):
    layout = mapped.layout(QUESTION, random_documents(3, 60))
    bare = replace(layout, offsets=None, document_spans=None, source=None)
    with pytest.raises(InvalidRequestError, match="no source to render for the draft's tokenizer"):
        mapped.generate_layout(bare, GenerationParams(max_new_tokens=2))


def test_a_tokenizer_for_an_in_process_main_model_is_refused(tiny_model_dir):
    with pytest.raises(InvalidRequestError, match="tokenizer= names the tokenizer of a main model on vLLM"):
        SpecPrefillEngine(main=str(tiny_model_dir), tokenizer=str(tiny_model_dir))


# -- vLLM: the client needs the main model's tokenizer, checked by the server's /tokenize -----------


class TokenizingStandIn(StandIn):
    """The stand-in vLLM server, plus ``/tokenize`` with the served model's tokenizer."""

    served_tokenizer = None

    def do_POST(self):
        if self.path != "/tokenize":
            return super().do_POST()
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        return self._json(200, {"tokens": self.served_tokenizer(body["prompt"], add_special_tokens=False)["input_ids"]})


@pytest.fixture
def draft_dir(tmp_path, other_draft, draft_tokenizer):
    other_draft.save_pretrained(tmp_path / "draft")
    draft_tokenizer.save_pretrained(tmp_path / "draft")
    return str(tmp_path / "draft")


@pytest.fixture
def served(tokenizer):
    server, url = serve(handler_class(TokenizingStandIn, plugin=True, served_tokenizer=tokenizer))
    yield url
    server.shutdown()


def test_vllm_client_with_the_main_tokenizer_and_a_mapped_draft(served, draft_dir, tiny_model_dir, tokenizer):
    engine = SpecPrefillEngine.for_vllm(served, draft=draft_dir, tokenizer=str(tiny_model_dir), **SETTINGS)
    assert engine.draft_path == "mapped" and engine.tokenizer.get_vocab() == tokenizer.get_vocab()
    layout = engine.layout(QUESTION, random_documents(3, 60))
    assert torch.equal(layout.input_ids, build_rag_layout(tokenizer, QUESTION, random_documents(3, 60)).input_ids)
    result = engine.generate_layout(layout)
    assert result.stats.draft_path == "mapped" and result.stats.compressed


def test_vllm_client_refuses_a_draft_tokenizer_the_server_does_not_use(served, draft_dir, tiny_model_dir):
    with pytest.raises(TokenizerMismatchError, match="pass tokenizer= with the served model's HF id or folder"):
        SpecPrefillEngine.for_vllm(served, draft=draft_dir, **SETTINGS)
    with pytest.raises(TokenizerMismatchError, match="tokenizes differently"):  # the named tokenizer is checked too
        SpecPrefillEngine.for_vllm(served, draft=str(tiny_model_dir), tokenizer=draft_dir, **SETTINGS)


class FakeLLM:
    """What ``VLLMOfflineBackend`` reads of an in-process ``vllm.LLM`` at engine start."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.llm_engine = type("Engine", (), {"model_config": type("Config", (), {"max_model_len": 1024})})()

    def get_tokenizer(self):
        return self.tokenizer


def test_in_process_vllm_checks_the_tokenizer_against_the_served_models(tokenizer, draft_dir, tiny_model_dir):
    with pytest.raises(TokenizerMismatchError, match="vLLM model's tokenizer differs from the local one"):
        SpecPrefillEngine.for_vllm(FakeLLM(tokenizer), draft=draft_dir, **SETTINGS)
    engine = SpecPrefillEngine.for_vllm(FakeLLM(tokenizer), draft=draft_dir, tokenizer=str(tiny_model_dir), **SETTINGS)
    assert engine.draft_path == "mapped" and engine.tokenizer.get_vocab() == tokenizer.get_vocab()


class Tokenizing:
    """A vLLM server backend as check_server_tokenizer sees it: ``/tokenize`` with ``served``."""

    model = "served"

    def __init__(self, served):
        self.served = served

    def _request(self, method, path, body):
        assert (method, path) == ("POST", "/tokenize") and body["add_special_tokens"] is False
        return {"tokens": self.served(body["prompt"], add_special_tokens=False)["input_ids"]}


def with_markers(markers):
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(markers)
    return tokenizer


def test_the_server_check_compares_the_tool_call_markers_ids():
    local = with_markers(["<tool_call>", "</tool_call>"])
    markers = tool_markers(local)
    assert set(markers) == {"<tool_call>", "</tool_call>"}
    check_server_tokenizer(Tokenizing(with_markers(["<tool_call>", "</tool_call>"])), local, markers)
    swapped = Tokenizing(with_markers(["</tool_call>", "<tool_call>"]))  # the same text, other ids
    with pytest.raises(TokenizerMismatchError, match="tool-call marker '<tool_call>'"):
        check_server_tokenizer(swapped, local, markers)
    # a server that splits the marker's text (mistral_common reads no control tokens from text) is not judged by it
    check_server_tokenizer(Tokenizing(build_tokenizer()), local, markers)


def test_serve_in_front_of_vllm_takes_the_served_models_tokenizer(served, draft_dir, tiny_model_dir, tokenizer):
    """``specprefill-rag serve --main <vLLM URL> --draft <other vocabulary> --tokenizer <served model's>``."""
    argv = ["serve", "--main", served, "--draft", draft_dir, "--device", "cpu", "--min-prompt-tokens", "0"]
    engine = build_engine(serve_settings(parser().parse_args([*argv, "--tokenizer", str(tiny_model_dir)])))
    assert engine.draft_path == "mapped" and engine.tokenizer.get_vocab() == tokenizer.get_vocab()
    assert engine.generate_layout(engine.layout(QUESTION, random_documents(3, 60))).stats.compressed
    with pytest.raises(TokenizerMismatchError, match="pass tokenizer= with the served model's HF id or folder"):
        build_engine(serve_settings(parser().parse_args(argv)))  # without it, the draft's tokenizer is refused
