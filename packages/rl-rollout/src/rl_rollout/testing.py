"""Tiny local models for tests, demos and benchmarks: no hub, no download.

:func:`make_tiny_model` writes a character-level tokenizer (WordLevel over printable
ASCII plus special tokens, with a chat template) and a random-init Llama causal LM
to a folder that transformers, vLLM (CPU build) and DeepSpeed all load. head_dim
is 64 because vLLM's CPU attention rejects 16 (ENVIRONMENT.md). The architecture
is Llama, not Qwen2: transformers 5 replaces the tokenizer of a ``qwen2`` config
with its own byte-level pre-tokenizer (its list of hub configs with a wrong
tokenizer class), which would drop the character tokenizer's newline.
"""

from __future__ import annotations

import os
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(vocab_size: int = 128):
    """A ``PreTrainedTokenizerFast`` that maps each printable ASCII char (and ``\\n``) to one id."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + chars)}
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size must be >= {len(vocab)} (specials + printable ASCII), got {vocab_size}")
    while len(vocab) < vocab_size:
        vocab[f"<extra_{len(vocab)}>"] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    specials = "|".join(t.replace("|", r"\|") for t in SPECIAL_TOKENS)
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(f"{specials}|[\\s\\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token="<|im_end|>",
        bos_token=None,
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_tiny_model(
    path: str | os.PathLike,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 256,
    vocab_size: int = 128,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    dtype: str = "float32",
    tie_word_embeddings: bool = True,
) -> Path:
    """Save a random tiny Llama and its tokenizer to ``path``; returns the path.

    Idempotent: if ``path/config.json`` exists the folder is reused as is.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(vocab_size)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
