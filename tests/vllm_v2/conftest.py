"""Model Runner V2 tests run in .venv-vllm-v2: the real vllm==0.33.0 wheel installed without its GPU
dependencies, which imports on CPU (no engine, no Triton kernels). They drive the plugin's model
state with CPU tensors shaped like MRV2's own input batches. `make test-vllm-v2` sets
SPECPREFILL_REQUIRE_VLLM_V2=1, which turns a missing vLLM into an error instead of a skip."""

import importlib.util
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")


def _missing_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vllm (the 0.33 wheel) is not installed here; `make test-vllm-v2` runs these in .venv-vllm-v2"
    import vllm

    version = vllm.__version__
    if tuple(int(p) for p in version.split("+")[0].split(".")[:2]) < (0, 33):
        return f"vllm {version} found; these tests target the 0.33 Model Runner V2 classes (`make test-vllm-v2`)"
    return None


REASON = _missing_reason()
if REASON is not None:
    if os.environ.get("SPECPREFILL_REQUIRE_VLLM_V2") == "1":
        raise RuntimeError(REASON)
    collect_ignore_glob = ["test_*.py"]


def pytest_report_header(config):
    return f"tests/vllm_v2 skipped: {REASON}" if REASON else None


@pytest.fixture(scope="session")
def vllm_config(tmp_path_factory):
    """A real ``VllmConfig`` for a tiny Llama folder: max_model_len 64, 8 request slots, 64 tokens a step."""
    from transformers import LlamaConfig
    from vllm.config import DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
    ).save_pretrained(folder)
    model_config = ModelConfig(model=str(folder), skip_tokenizer_init=True, max_model_len=64, dtype="float32")
    scheduler_config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, is_encoder_decoder=False
    )
    return VllmConfig(model_config=model_config, scheduler_config=scheduler_config, device_config=DeviceConfig("cpu"))
