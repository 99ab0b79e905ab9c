"""Tiny random-weight Hugging Face models saved as real model directories, their tokenizers, and
random PEFT adapters for them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

TINY_VOCAB = 512


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer whose vocabulary is exactly t0 .. t{vocab_size-1}."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", eos_token="t2", bos_token="t1"
    )
    fast.save_pretrained(path)


def make_tiny_model(path: Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> str:
    """Save a random model of ``arch`` (llama | qwen2 | qwen3) in fp32 to ``path``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    if arch == "llama":
        config: Any = LlamaConfig(**common)
    elif arch == "qwen2":
        config = Qwen2Config(**common)
    elif arch == "qwen3":
        common.setdefault("head_dim", 32)
        config = Qwen3Config(**common)
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init is near zero; larger weights give peaked, seed-dependent distributions.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    write_tokenizer(path, TINY_VOCAB)
    return str(path)


def english_tokenizer(path: Path) -> None:
    """Replace the tiny model's tokenizer with a word-level one over the bench's sentence pool,
    so that different prompts really are different token sequences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from loraplex.bench.workload import SENTENCES

    words = sorted({w for s in SENTENCES for w in re.findall(r"\w+|[^\w\s]+", s)})
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {w: i + 3 for i, w in enumerate(words)}
    assert len(vocab) <= TINY_VOCAB
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)


def make_adapter(
    model_dir: str, out: Path, rank: int, alpha: int, targets: object, seed: int
) -> str:
    """A random PEFT LoRA adapter for the model in ``model_dir``, saved to ``out``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)
    peft_model = get_peft_model(base, cfg)
    with torch.no_grad():  # PEFT's random B is tiny; make every adapter change the outputs
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)
    peft_model.save_pretrained(out)
    return str(out)
