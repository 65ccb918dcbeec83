#!/usr/bin/python3
"""Writes random models in the relgen format and the reference's logits for them (golden files).

  /usr/bin/python3 tools/make_goldens.py --out DIR

DIR/manifest.json lists the cases; DIR/<case>/ holds config.json, model.safetensors and
golden.safetensors (tokens_<L> as I32 and logits_<L> [L, vocab] as F64 for every length L)."""
import argparse
import copy
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import relgen_ref  # noqa: E402
import safetensors_io  # noqa: E402

LENGTHS = [1, 2, 17, 64, 129]

BASE = {
    "format_version": 1, "vocab_size": 300, "d_model": 64, "n_layers": 2, "n_heads": 4,
    "head_dim": 16, "ffn_dim": 96, "max_seq_len": 256, "ffn_activation": "gelu",
    "norm": "layernorm", "norm_placement": "pre", "norm_eps": 1e-5, "linear_bias": True,
    "tie_embeddings": False, "bos_token_id": 256, "eos_token_id": 257,
    "tokenizer": {"kind": "byte"},
}

# name -> (config overrides, relative_attention, weight dtype). Each scheme with a range appears
# with the range shorter and longer than the longest sequence (129); other options vary across.
CASES = {
    "skew_short_range": ({}, {"scheme": "skew", "max_relative_position": 8, "scale_with_qk": True}, "F32"),
    "skew_long_range": ({"norm": "rmsnorm", "ffn_activation": "silu", "ffn_gated": True,
                         "linear_bias": False, "tie_embeddings": True},
                        {"scheme": "skew", "max_relative_position": 200, "heads_share_table": True,
                         "share_across_layers": True, "scale_with_qk": True}, "F16"),
    "skew_rel_unscaled": ({"embedding_scale": 4.0, "attention_scale": 0.3},
                          {"scheme": "skew", "max_relative_position": 50, "scale_with_qk": False}, "F32"),
    "skew_local_short_range": ({"norm_placement": "post", "ffn_activation": "relu"},
                               {"scheme": "skew_local", "block_length": 16, "max_relative_position": 10,
                                "scale_with_qk": True}, "F32"),
    "skew_local_long_range": ({}, {"scheme": "skew_local", "block_length": 16, "max_relative_position": 40,
                                   "heads_share_table": True, "scale_with_qk": True}, "BF16"),
    "shaw_keys_short_range": ({}, {"scheme": "shaw", "clip": 4, "scale_with_qk": True}, "F32"),
    "shaw_keys_long_range": ({"ffn_activation": "gelu_tanh"},
                             {"scheme": "shaw", "clip": 160, "share_across_layers": True,
                              "scale_with_qk": True}, "F32"),
    "shaw_values_short_range": ({}, {"scheme": "shaw", "clip": 4, "relative_values": True,
                                     "heads_share_table": True, "scale_with_qk": True}, "F32"),
    "shaw_values_long_range": ({"norm": "rmsnorm"}, {"scheme": "shaw", "clip": 150, "relative_values": True,
                                                     "scale_with_qk": True}, "BF16"),
    "t5_causal_short_range": ({}, {"scheme": "t5", "num_buckets": 8, "max_distance": 20,
                                   "share_across_layers": False, "scale_with_qk": False}, "F32"),
    "t5_causal_standard": ({}, {"scheme": "t5", "num_buckets": 32, "max_distance": 128,
                                "scale_with_qk": False}, "F32"),
    "t5_causal_long_range": ({}, {"scheme": "t5", "num_buckets": 16, "max_distance": 300,
                                  "scale_with_qk": True}, "F16"),
    "t5_bidirectional": ({}, {"scheme": "t5", "num_buckets": 32, "max_distance": 128,
                              "bidirectional": True, "scale_with_qk": False}, "F32"),
    "alibi_8_heads": ({"n_heads": 8, "head_dim": 8}, {"scheme": "alibi", "scale_with_qk": False}, "F32"),
    "alibi_12_heads": ({"d_model": 96, "n_heads": 12, "head_dim": 8},
                       {"scheme": "alibi", "scale_with_qk": False}, "F32"),
    "none": ({}, {"scheme": "none"}, "F32"),
}


# Small models with a 512-token context for the engine tests (no golden logits needed).
ENGINE_MODELS = {
    "skew": {"scheme": "skew", "max_relative_position": 64, "scale_with_qk": True},
    "skew_local": {"scheme": "skew_local", "block_length": 32, "max_relative_position": 64, "scale_with_qk": True},
    "shaw": {"scheme": "shaw", "clip": 16, "relative_values": True, "scale_with_qk": True},
    "t5": {"scheme": "t5", "num_buckets": 32, "max_distance": 128, "scale_with_qk": False},
    "alibi": {"scheme": "alibi", "scale_with_qk": False},
    "none": {"scheme": "none"},
}


def make_engine_model(out_dir, name, rel, seed, overrides=None):
    cfg = copy.deepcopy(BASE)
    cfg.update({"name": f"engine-{name}", "max_seq_len": 512, "vocab_size": 259,
                "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258,
                "relative_attention": rel})
    cfg.update(overrides or {})
    tensors = relgen_ref.random_tensors(cfg, torch.Generator().manual_seed(seed))
    d = os.path.join(out_dir, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    safetensors_io.save(os.path.join(d, "model.safetensors"), {k: v.float().numpy() for k, v in tensors.items()})


def make_case(out_dir, name, overrides, rel, dtype, seed):
    cfg = copy.deepcopy(BASE)
    cfg.update(overrides)
    cfg["name"] = name
    cfg["relative_attention"] = rel
    gen = torch.Generator().manual_seed(seed)
    tensors = relgen_ref.random_tensors(cfg, gen)
    case_dir = os.path.join(out_dir, name)
    os.makedirs(case_dir, exist_ok=True)
    with open(os.path.join(case_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    path = os.path.join(case_dir, "model.safetensors")
    safetensors_io.save(path, {k: v.float().numpy() for k, v in tensors.items()},
                        dtypes={k: dtype for k in tensors})
    # The reference runs on exactly the stored (possibly rounded) weights.
    ref = relgen_ref.Reference(cfg, safetensors_io.load(path))
    golden = {}
    for L in LENGTHS:
        tokens = torch.randint(0, cfg["vocab_size"], (L,), generator=gen, dtype=torch.int32)
        with torch.no_grad():
            logits = ref.forward(tokens.long())
        golden[f"tokens_{L}"] = tokens.numpy()
        golden[f"logits_{L}"] = logits.numpy()
    safetensors_io.save(os.path.join(case_dir, "golden.safetensors"), golden)
    return ref.checked_paths


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", nargs="*", help="case names (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    os.makedirs(args.out, exist_ok=True)
    names = args.only or list(CASES)
    t0 = time.time()
    for n, name in enumerate(names):
        overrides, rel, dtype = CASES[name]
        checked = make_case(args.out, name, overrides, rel, dtype, seed=1000 + n)
        extra = f" (skew == naive R checked {checked}x)" if checked else ""
        print(f"[{n + 1}/{len(names)}] {name}: {dtype}{extra}", flush=True)
    for n, (name, rel) in enumerate(ENGINE_MODELS.items()):
        make_engine_model(os.path.join(args.out, "engine"), name, rel, seed=2000 + n)
    # A slower model for server tests that must interrupt a generation in progress.
    make_engine_model(os.path.join(args.out, "engine"), "server",
                      {"scheme": "skew", "max_relative_position": 256, "scale_with_qk": True}, seed=3000,
                      overrides={"d_model": 256, "n_layers": 4, "n_heads": 4, "head_dim": 64, "ffn_dim": 1024,
                                 "max_seq_len": 2048})
    # A small model with a long context for the prefix-cache workload (prefixes up to 700 tokens).
    make_engine_model(os.path.join(args.out, "engine"), "long",
                      {"scheme": "skew", "max_relative_position": 64, "scale_with_qk": True}, seed=3001,
                      overrides={"max_seq_len": 1024})
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump({"lengths": LENGTHS, "cases": names, "engine_models": list(ENGINE_MODELS)}, f, indent=2)
    print(f"wrote {len(names)} cases to {args.out} in {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
