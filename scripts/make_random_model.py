"""Write a random-weight model with SmolLM2-135M's shape (and a word-level tokenizer) to a
directory: for throughput runs where weight values do not matter (greedy, ignore_eos) and the
embedded model's package is not at hand, e.g. on a GPU machine without network.

    python scripts/make_random_model.py DIR [--layers 30 --hidden 576 ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--vocab", type=int, default=49152)
    args = p.parse_args()
    out = Path(args.out)
    if (out / "config.json").exists():
        print(out)
        return
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
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    vocab = {f"t{i}": i for i in range(args.vocab)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t2").save_pretrained(
        out
    )
    print(out)


if __name__ == "__main__":
    main()
