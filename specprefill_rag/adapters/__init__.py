"""What the framework adapters (LangChain, LlamaIndex) share: their settings, generated from the one declaration."""
