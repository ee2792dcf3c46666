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


# Special tokens and chat templates of the supported families, in the shape of their real templates
# (Llama 3 trims message content; Mistral v0.3 folds the system message into the last user turn).
FAMILIES: dict[str, dict[str, Any]] = {
    "chatml": {  # Qwen2/2.5, SmolLM2
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "bos": "<|im_start|>",
        "eos": "<|im_end|>",
        "pad": "<|endoftext|>",
        "template": CHAT_TEMPLATE,
    },
    "qwen3": {  # ChatML plus non-special added tokens that still steer the model
        "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        "added": ["<think>", "</think>", "<tool_call>", "</tool_call>"],
        "bos": "<|im_start|>",
        "eos": "<|im_end|>",
        "pad": "<|endoftext|>",
        "template": CHAT_TEMPLATE,
    },
    "llama3": {
        "specials": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "bos": "<|begin_of_text|>",
        "eos": "<|eot_id|>",
        "pad": "<|end_of_text|>",
        "template": (
            "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
            "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
        ),
    },
    "mistral": {
        "specials": ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
        "bos": "<s>",
        "eos": "</s>",
        "pad": "<unk>",
        "template": (
            "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
            "{% set messages = messages[1:] %}{% endif %}{{ bos_token }}{% for message in messages %}"
            "{% if message['role'] == 'user' %}{% if loop.last and system is defined %}"
            "{{ '[INST] ' + system + '\n\n' + message['content'] + '[/INST]' }}{% else %}"
            "{{ '[INST] ' + message['content'] + '[/INST]' }}{% endif %}"
            "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
        ),
    },
}


def build_family_tokenizer(family: str, vocab_size: int = 400) -> Any:
    """A fast byte-level BPE tokenizer with the special tokens and chat template of ``family``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=spec["specials"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(CORPUS, trainer)
    core.add_tokens([AddedToken(token, special=False) for token in spec.get("added", [])])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=spec["bos"], eos_token=spec["eos"], pad_token=spec["pad"]
    )
    tokenizer.chat_template = spec["template"]
    return tokenizer


def build_model(
    tokenizer: Any, layers: int = 2, max_positions: int = 1024, seed: int = 0, initializer_range: float = 0.02
) -> Any:
    """A random Llama: hidden 64, 4 query heads sharing 2 KV heads (GQA), SDPA attention.

    At the default ``initializer_range`` attention is almost uniform, so greedy tokens rarely depend on
    positions; 0.2 makes it sharp enough that they do (tests of position ids).
    """
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
        initializer_range=initializer_range,
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


# The frameworks' own RAG prompts, as their docs write them (tests and benchmarks/tutorials.py render them).
# LangChain's RAG tutorial QA prompt (context in the system message)
LANGCHAIN_TUTORIAL = (
    "You are an assistant for question-answering tasks. "
    "Use the following pieces of retrieved context to answer "
    "the question. If you don't know the answer, say that you "
    "don't know. Use three sentences maximum and keep the "
    "answer concise."
    "\n\n"
    "{context}"
)
# the LangChain docs' create_retrieval_chain QA prompt
LANGCHAIN_RETRIEVAL_CHAIN = (
    "Use the given context to answer the question. "
    "If you don't know the answer, say you don't know. "
    "Use three sentence maximum and keep the answer concise. "
    "Context: {context}"
)
