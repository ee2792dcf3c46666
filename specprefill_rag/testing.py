"""Offline test doubles: a tiny random Llama and a byte-level BPE tokenizer built in memory.

Used by this package's tests and by the integration packages' fast tests; nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France.",
    "Document Question Answer: the bridge opened in 1883 after thirteen years of work.",
    "Retrieval augmented generation feeds documents to a language model before the question.",
] * 20


def build_tokenizer(vocab_size: int = 400, seed_text: list[str] | None = None) -> Any:
    """A fast byte-level BPE tokenizer with ChatML special tokens and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(seed_text or CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model(tokenizer: Any, layers: int = 2, max_positions: int = 1024, seed: int = 0) -> Any:
    """A random Llama: hidden 64, 4 query heads sharing 2 KV heads (GQA), SDPA attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def random_documents(count: int, words: int, seed: int = 0) -> list[str]:
    """``count`` documents of ``words`` words drawn from the tokenizer's training corpus."""
    generator = torch.Generator().manual_seed(seed)
    vocabulary = " ".join(CORPUS[:3]).replace(".", "").split()
    documents = []
    for _ in range(count):
        picks = torch.randint(len(vocabulary), (words,), generator=generator)
        documents.append(" ".join(vocabulary[i] for i in picks.tolist()) + ".")
    return documents
