from langchain_specprefill import __all__

EXPECTED_ALL = [
    "ChatSpecPrefill",
    "SpecPrefillDocumentWarmer",
    "SpecPrefillLLM",
    "__version__",
    "document_prompt",
    "format_docs",
    "install_retriever_recorder",
    "remove_retriever_recorder",
]


def test_all_imports() -> None:
    assert sorted(EXPECTED_ALL) == sorted(__all__)
