"""Test fixture models: a small random Qwen2 with a char-level tokenizer, built in a second, no hub needed.

hidden 64 with 2 attention heads: vLLM's CPU attention supports head_dim 32 but not 16. The embedding table
(96 rows) is larger than the tokenizer's vocabulary, so a sampler can emit ids no tokenizer knows, exactly
the case the generator's decoding must survive.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

VOCAB_ROWS = 96
EMBED_SCALE = 5.0
SPECIALS = ["<pad>", "<eos>"]
CHARS = string.digits + "+-*=() ?:\n" + string.ascii_letters + ".,"


def build_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + list(CHARS))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>")


def random_qwen2(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB_ROWS, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=256, tie_word_embeddings=True, eos_token_id=1,
        pad_token_id=0, bos_token_id=None, dtype="float32",
    )
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():  # a larger (tied) embedding: peaked next-token distributions, no near-ties in greedy
        model.model.embed_tokens.weight.mul_(EMBED_SCALE)
    return model.eval()


def build_model_folder(folder: str | Path, seed: int = 0) -> Path:
    """Save a random tiny Qwen2 and its tokenizer (HF layout, safetensors) into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save_pretrained(folder)
    random_qwen2(seed).save_pretrained(folder)
    return folder
