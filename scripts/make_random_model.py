"""Write a random-weight model with SmolLM2-135M's shape (and a word-level tokenizer) to a
directory: for throughput runs where weight values do not matter (greedy, ignore_eos) and the
embedded model's package is not at hand, e.g. on a GPU machine without network.

    python scripts/make_random_model.py DIR [--layers 30 --hidden 576 ...]
    python scripts/make_random_model.py DIR --preset qwen3-0.6b    (Qwen3-0.6B's shape)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3Config

# Qwen3-0.6B: 28 layers, hidden 1024, 16 query / 8 KV heads of 128, qk-norm, tied embeddings
QWEN3_06B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    tie_word_embeddings=True,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--preset", choices=["qwen3-0.6b"], default=None, help="overrides the shape")
    args = p.parse_args()
    out = Path(args.out)
    if (out / "config.json").exists():
        print(out)
        return
    config: LlamaConfig | Qwen3Config
    if args.preset == "qwen3-0.6b":
        config = Qwen3Config(**QWEN3_06B, bos_token_id=1, eos_token_id=2)
    else:
        config = LlamaConfig(
            vocab_size=args.vocab,
            hidden_size=args.hidden,
            intermediate_size=args.intermediate,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            max_position_embeddings=8192,
            tie_word_embeddings=True,
            rope_theta=100000.0,
            bos_token_id=1,
            eos_token_id=2,
        )
    torch.manual_seed(0)
    # bf16 on disk: half the bytes to write and load; the benchmarks run in bf16 anyway
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t2").save_pretrained(
        out
    )
    print(out)


if __name__ == "__main__":
    main()
