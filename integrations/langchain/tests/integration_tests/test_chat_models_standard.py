"""langchain-tests standard integration suite against the real embedded SmolLM2-135M-Instruct.

Tool calling, structured output and multimodal input are declared unsupported through the suite's
own properties (ChatSpecPrefill has no bind_tools and takes text only).
"""

from typing import Any

from langchain_tests.integration_tests import ChatModelIntegrationTests

from langchain_specprefill import ChatSpecPrefill


class TestChatSpecPrefillIntegration(ChatModelIntegrationTests):
    @property
    def chat_model_class(self) -> type[ChatSpecPrefill]:
        return ChatSpecPrefill

    @property
    def chat_model_params(self) -> dict[str, Any]:
        return {"model": "smollm2-135m", "draft_model": "smollm2-135m", "keep_rate": 0.3, "max_tokens": 24}

    @property
    def standard_chat_model_params(self) -> dict[str, Any]:
        return {"temperature": 0, "max_tokens": 100, "stop": []}

    @property
    def supports_model_override(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False

    @property
    def supports_json_mode(self) -> bool:
        return False
