#!/usr/bin/python3
"""Writes a randomly initialised relgen model (any scheme) in the documented format.

  /usr/bin/python3 tools/make_random_model.py --out DIR [--scheme skew] [--d-model 512] ...

Used for benchmarks and as a stand-in model; its output is noise."""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import relgen_ref  # noqa: E402
import safetensors_io  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--name", default="random")
    ap.add_argument("--scheme", default="skew", choices=["none", "skew", "skew_local", "shaw", "t5", "alibi"])
    ap.add_argument("--vocab-size", type=int, default=259)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--ffn-dim", type=int, default=1024)
    ap.add_argument("--max-seq-len", type=int, default=1024)
    ap.add_argument("--max-relative-position", type=int, default=512, help="skew, skew_local")
    ap.add_argument("--block-length", type=int, default=128, help="skew_local")
    ap.add_argument("--clip", type=int, default=16, help="shaw")
    ap.add_argument("--relative-values", action="store_true", help="shaw: relative value tables too")
    ap.add_argument("--heads-share-table", action="store_true", help="one relative table for all heads")
    ap.add_argument("--dtype", default="F32", choices=["F32", "F16", "BF16"])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rel = {"scheme": a.scheme}
    if a.scheme in ("skew", "skew_local"):
        rel["max_relative_position"] = a.max_relative_position
    if a.scheme == "skew_local":
        rel["block_length"] = a.block_length
    if a.scheme == "shaw":
        rel["clip"] = a.clip
        rel["relative_values"] = a.relative_values
    if a.heads_share_table:
        rel["heads_share_table"] = True
    if a.scheme != "none":
        rel["scale_with_qk"] = a.scheme in ("skew", "skew_local", "shaw")
    cfg = {
        "format_version": 1, "name": a.name, "vocab_size": a.vocab_size, "d_model": a.d_model,
        "n_layers": a.n_layers, "n_heads": a.n_heads, "head_dim": a.d_model // a.n_heads,
        "ffn_dim": a.ffn_dim, "ffn_activation": "gelu", "norm": "layernorm", "norm_placement": "pre",
        "linear_bias": True, "tie_embeddings": True, "max_seq_len": a.max_seq_len,
        "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258,
        "tokenizer": {"kind": "byte"}, "relative_attention": rel,
    }
    tensors = relgen_ref.random_tensors(cfg, torch.Generator().manual_seed(a.seed))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    safetensors_io.save(os.path.join(a.out, "model.safetensors"),
                        {k: v.float().numpy() for k, v in tensors.items()}, dtypes={k: a.dtype for k in tensors})
    n = sum(v.numel() for v in tensors.values())
    print(f"wrote {a.out}: {a.scheme}, {n / 1e6:.1f}M parameters, {a.dtype}")


if __name__ == "__main__":
    main()
