#!/usr/bin/env python3
"""A Hugging Face MPT or BLOOM checkpoint at a published model's dimensions with random weights,
written tensor by tensor into shards as save_pretrained lays them out (model-0000N-of-0000M
.safetensors + model.safetensors.index.json), so that even mpt-7b's 13.3 GB is made in little
memory: no framework holds the model. The config is tools/bench/shapes/<name>.json (written by
transformers' config classes); the tokenizer is copied from a checkpoint given with --tokenizer_from.

  /usr/bin/python3 tools/make_shape_checkpoint.py --shape mpt-7b --out DIR --tokenizer_from CKPT_DIR
      [--dtype bf16|f16|f32] [--layers N] [--vocab V] [--shard_gb 5]

Weights are N(0, 0.02) (transformers' initializer_range), norms 1 + N(0, 0.02): the numbers mean
nothing; the shapes, names, dtypes and layout are what is tested. --layers and --vocab make a smaller
model of the same widths (CI's few-hundred-MB case).
"""
import argparse
import json
import os
import shutil
import struct
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
DT = {"bf16": ("BF16", 2), "f16": ("F16", 2), "f32": ("F32", 4)}


def tensors(family, cfg):
    """(name, shape, is_norm_weight) in the order save_pretrained writes them (sorted by name)."""
    out = []
    if family == "mpt":
        d, L, v = cfg["d_model"], cfg["n_layers"], cfg["vocab_size"]
        f = cfg.get("expansion_ratio", 4) * d
        for i in range(L):
            p = f"transformer.blocks.{i}."
            out += [(p + "attn.Wqkv.weight", [3 * d, d], False), (p + "attn.out_proj.weight", [d, d], False),
                    (p + "ffn.down_proj.weight", [d, f], False), (p + "ffn.up_proj.weight", [f, d], False),
                    (p + "norm_1.weight", [d], True), (p + "norm_2.weight", [d], True)]
        out += [("transformer.norm_f.weight", [d], True), ("transformer.wte.weight", [v, d], False)]
    elif family == "bloom":
        d, L, v = cfg["hidden_size"], cfg["n_layer"], cfg["vocab_size"]
        for i in range(L):
            p = f"transformer.h.{i}."
            out += [(p + "input_layernorm.bias", [d], False), (p + "input_layernorm.weight", [d], True),
                    (p + "mlp.dense_4h_to_h.bias", [d], False), (p + "mlp.dense_4h_to_h.weight", [d, 4 * d], False),
                    (p + "mlp.dense_h_to_4h.bias", [4 * d], False), (p + "mlp.dense_h_to_4h.weight", [4 * d, d], False),
                    (p + "post_attention_layernorm.bias", [d], False),
                    (p + "post_attention_layernorm.weight", [d], True),
                    (p + "self_attention.dense.bias", [d], False), (p + "self_attention.dense.weight", [d, d], False),
                    (p + "self_attention.query_key_value.bias", [3 * d], False),
                    (p + "self_attention.query_key_value.weight", [3 * d, d], False)]
        out += [("transformer.ln_f.bias", [d], False), ("transformer.ln_f.weight", [d], True),
                ("transformer.word_embeddings.weight", [v, d], False),
                ("transformer.word_embeddings_layernorm.bias", [d], False),
                ("transformer.word_embeddings_layernorm.weight", [d], True)]
    else:
        raise SystemExit(f"make_shape_checkpoint: family {family} is not made here")
    return sorted(out)


def encode(a, dtype):
    if dtype == "BF16":
        bits = a.astype(np.float32).view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16).tobytes()
    return a.astype(np.float16 if dtype == "F16" else np.float32).tobytes()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True, help="a config in tools/bench/shapes (mpt-7b, bloom-560m)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer_from", required=True, help="a checkpoint directory whose tokenizer.json is copied")
    ap.add_argument("--dtype", default="bf16", choices=DT)
    ap.add_argument("--layers", type=int, default=0, help="fewer layers than the shape's (0: all)")
    ap.add_argument("--vocab", type=int, default=0, help="another vocabulary size (0: the shape's)")
    ap.add_argument("--shard_gb", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    cfg = json.load(open(os.path.join(HERE, "bench", "shapes", a.shape + ".json")))
    family = cfg["model_type"]
    if a.layers:
        cfg["n_layers" if family == "mpt" else "n_layer"] = a.layers
    if a.vocab:
        cfg["vocab_size"] = a.vocab
    cfg["torch_dtype"] = {"bf16": "bfloat16", "f16": "float16", "f32": "float32"}[a.dtype]
    os.makedirs(a.out, exist_ok=True)
    dtype, size = DT[a.dtype]
    specs = tensors(family, cfg)
    # Shards of at most shard_gb, tensors in name order, as save_pretrained splits them.
    limit = int(a.shard_gb * 1e9)
    shards, cur, cur_bytes = [], [], 0
    for name, shape, norm in specs:
        n = int(np.prod(shape)) * size
        if cur and cur_bytes + n > limit:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append((name, shape, norm))
        cur_bytes += n
    shards.append(cur)
    rng = np.random.default_rng(a.seed)
    weight_map, total = {}, 0
    for si, shard in enumerate(shards):
        fname = f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        header, off = {}, 0
        for name, shape, _ in shard:
            n = int(np.prod(shape)) * size
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = fname
        header["__metadata__"] = {"format": "pt"}
        hb = json.dumps(header).encode()
        hb += b" " * (-len(hb) % 8)
        with open(os.path.join(a.out, fname), "wb") as f:
            f.write(struct.pack("<Q", len(hb)))
            f.write(hb)
            for name, shape, norm in shard:
                rows = shape[0]
                per = max(1, (1 << 24) // max(1, int(np.prod(shape[1:]))))  # ~16M elements at a time
                for r in range(0, rows, per):
                    part = [min(per, rows - r)] + shape[1:]
                    x = rng.standard_normal(part, dtype=np.float32) * 0.02
                    if norm:
                        x += 1.0
                    f.write(encode(x, dtype))
        total += off
        print(f"make_shape_checkpoint: {fname} {off / 1e9:.2f} GB", file=sys.stderr, flush=True)
    if len(shards) > 1:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map},
                  open(os.path.join(a.out, "model.safetensors.index.json"), "w"), indent=2)
    json.dump(cfg, open(os.path.join(a.out, "config.json"), "w"), indent=2)
    shutil.copy(os.path.join(a.tokenizer_from, "tokenizer.json"), a.out)
    print(json.dumps({"out": a.out, "bytes": total, "tensors": len(specs), "shards": len(shards)}))


if __name__ == "__main__":
    main()
