"""langchain-tests standard unit suite. Construction must not load weights (test_init_time). bind_tools and
with_structured_output (every method and strict value) build their runnables without loading a model."""

from typing import Any

from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_specprefill import ChatSpecPrefill


class TestChatSpecPrefillUnit(ChatModelUnitTests):
    @property
    def chat_model_class(self) -> type[ChatSpecPrefill]:
        return ChatSpecPrefill

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "smollm2-135m", "draft_model": "smollm2-135m", "keep_rate": 0.2}

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        # timeout/max_retries/api_key describe remote APIs; an in-process model has none of them.
        return {"temperature": 0, "max_tokens": 100, "stop": []}

    @property
    def supports_model_override(self) -> bool:
        return False  # one SpecPrefill engine per instance: switch models by making another instance

    @property
    def has_tool_calling(self) -> bool:
        return True

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def returns_usage_metadata(self) -> bool:
        return True
