#!/usr/bin/env python3
"""Writes tiny random Hugging Face BLOOM and MPT checkpoints, as transformers saves them, with
transformers' own float32 outputs for them: the independent reference of tests/hf_checkpoint_test.

  RELGEN_HF_PYTHON tools/make_hf_checkpoints.py --out DIR

Needs transformers 4.46 and tokenizers (tools/bootstrap.sh makes the venv) on Debian's torch.
For every case DIR/<case>/ is the checkpoint (config.json, model.safetensors, tokenizer.json,
generation_config.json) and DIR/<case>-sharded/ the same weights in several shards;
DIR/<case>.reference.safetensors holds, per prompt i, `prompt_i` (I32), `greedy_i` (I32: 64
tokens from transformers' incremental greedy loop over forward with its KV cache) and `logits_i`
(F32 [prompt + 64, vocab]: one forward over the whole sequence). DIR/bad/<name>/ are broken
checkpoints; DIR/manifest.json lists all of it with what each broken one must be refused for.
"""
import argparse
import json
import math
import os
import random
import shutil
import sys

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_testdata  # noqa: E402
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

NEW_TOKENS = 64
PROMPT_LENGTHS = [1, 5, 17, 40, 90]
BLOOM_SPLIT = " ?[^(\\s|[.,!?…。，、।۔،])]+"


def train_tokenizer(texts, style):
    """A tiny byte-level BPE tokenizer: BLOOM's pre-tokenizer, or GPT-NeoX's (NFC + ByteLevel regex)."""
    tok = Tokenizer(models.BPE())
    if style == "bloom":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(BLOOM_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        special = ["<unk>", "<s>", "</s>", "<pad>"]
    else:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        special = ["<|endoftext|>", "<|padding|>"]
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok, special


def randomize(model, seed):
    """Every parameter random and non-zero, with logits spread enough that greedy choices are clear."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or "ln_f" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]) * 1.5)


def add_mpt_biases(model):
    """llm-foundry's no_bias=false model: biases on every dense layer and norm (transformers drops them)."""
    d = model.config.d_model
    for block in model.transformer.blocks:
        for lin in (block.attn.Wqkv, block.attn.out_proj, block.ffn.up_proj, block.ffn.down_proj):
            lin.bias = torch.nn.Parameter(torch.zeros(lin.out_features))
        for norm in (block.norm_1, block.norm_2):
            norm.bias = torch.nn.Parameter(torch.zeros(d))
    model.transformer.norm_f.bias = torch.nn.Parameter(torch.zeros(d))


def honour_alibi_bias_max(model):
    """transformers' MPT builds ALiBi with alibi_bias_max 8 whatever the config says; llm-foundry
    uses the config's value. Rebind the builder so the reference is the original model's math."""
    from transformers.models.mpt import modeling_mpt
    bias_max = model.config.attn_config.alibi_bias_max

    def build(self, num_heads, sequence_length, alibi_bias_max=8, device=None):
        return modeling_mpt.build_mpt_alibi_tensor(num_heads, sequence_length, bias_max, device)
    model.transformer.build_mpt_alibi_tensor = build.__get__(model.transformer)


def greedy(model, prompt):
    """transformers' greedy tokens (incremental, with its cache) and the whole sequence's logits."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model(input_ids=ids, use_cache=True)
        past, tokens, margins = out.past_key_values, [], []
        logits = out.logits[0, -1]
        for _ in range(NEW_TOKENS):
            top = torch.topk(logits, 2).values
            margins.append(float(top[0] - top[1]))
            t = int(torch.argmax(logits))
            tokens.append(t)
            out = model(input_ids=torch.tensor([[t]]), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
        full = model(input_ids=torch.tensor([prompt + tokens])).logits[0]
        # The cache and the whole-sequence pass must choose alike, or the reference is not one.
        assert [int(x) for x in torch.argmax(full[len(prompt) - 1:-1], dim=-1)] == tokens
    return tokens, full, min(margins)


CASES = [
    # name, family, config overrides, extras
    ("bloom-h3", "bloom", dict(hidden_size=48, n_layer=2, n_head=3), {}),
    ("bloom-h6-untied", "bloom", dict(hidden_size=48, n_layer=3, n_head=6, tie_word_embeddings=False), {"pad_vocab": 37}),
    ("bloom-h12", "bloom", dict(hidden_size=96, n_layer=2, n_head=12, seq_length=512), {}),
    ("mpt-h3", "mpt", dict(d_model=48, n_layers=2, n_heads=3, max_seq_len=512), {}),
    ("mpt-h6-bias-untied", "mpt",
     dict(d_model=48, n_layers=3, n_heads=6, max_seq_len=512, no_bias=False, tie_word_embeddings=False,
          attn_config=dict(alibi_bias_max=16, softmax_scale=0.3)), {"biases": True, "pad_vocab": 11}),
    ("mpt-h12", "mpt", dict(d_model=96, n_layers=2, n_heads=12, max_seq_len=512), {}),
]


def make_model(family, overrides, extras, vocab, special_ids, seed):
    common = dict(vocab_size=vocab + extras.get("pad_vocab", 0), **special_ids)
    if family == "bloom":
        config = transformers.BloomConfig(**common, **overrides)
        model = transformers.BloomForCausalLM(config)
    else:
        config = transformers.MptConfig(**common, **overrides)
        model = transformers.MptForCausalLM(config)
        if extras.get("biases"):
            add_mpt_biases(model)
        honour_alibi_bias_max(model)
    randomize(model, seed)
    model.tie_weights()
    return model.eval()


def write_bad(out, good, family, manifest):
    """Broken copies of a good checkpoint, each with what relgen must say when it refuses it."""
    bad = hf_testdata.BrokenCopies(out, good, manifest)
    copy, edit_config, expect = bad.copy, bad.edit_config, bad.expect
    sharded = good + "-sharded"
    bad.missing_shard(f"{family}-missing-shard")
    bad.unknown_key(f"{family}-unknown-key")

    d = copy(f"{family}-index-names-missing-tensor", sharded)
    p = os.path.join(d, "model.safetensors.index.json")
    with open(p) as f:
        index = json.load(f)
    first_shard = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"]["transformer.extra.weight"] = first_shard
    with open(p, "w") as f:
        json.dump(index, f)
    expect(f"{family}-index-names-missing-tensor", d, "transformer.extra.weight", first_shard, "does not hold it")

    d = copy(f"{family}-unknown-model-type")
    edit_config(d, lambda c: c.update(model_type="gpt_bigcode"))
    expect(f"{family}-unknown-model-type", d, "gpt_bigcode", "bloom, mpt, t5 and mt5")

    d = copy(f"{family}-math-key")
    if family == "bloom":
        edit_config(d, lambda c: c.update(apply_residual_connection_post_layernorm=True))
        expect(f"{family}-math-key", d, "apply_residual_connection_post_layernorm", "not implemented")
    else:
        edit_config(d, lambda c: c["attn_config"].update(qk_ln=True))
        expect(f"{family}-math-key", d, "qk_ln", "not implemented")

    d = copy(f"{family}-wrong-dtype")
    p = os.path.join(d, "model.safetensors")
    tensors = load_file(p)
    victim = sorted(k for k in tensors if k.endswith("dense.weight") or k.endswith("out_proj.weight"))[0]
    tensors[victim] = (tensors[victim] * 100).to(torch.int32)
    save_file(tensors, p, metadata={"format": "pt"})
    expect(f"{family}-wrong-dtype", d, victim, "I32", "allowed: F32, F16, BF16")

    d = copy(f"{family}-missing-tensor")
    tensors = load_file(p.replace(os.path.join("bad", f"{family}-wrong-dtype"), os.path.basename(good)))
    victim = sorted(k for k in tensors if "norm" in k and k.endswith("weight"))[-1]
    del tensors[victim]
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    expect(f"{family}-missing-tensor", d, "missing tensor", victim)

    d = copy(f"{family}-unexpected-tensor")
    tensors = load_file(os.path.join(d, "model.safetensors"))
    tensors["transformer.wpe.weight"] = torch.ones(4, 4)
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    expect(f"{family}-unexpected-tensor", d, "unexpected tensor", "transformer.wpe.weight")

    d = copy(f"{family}-bin-only")
    os.remove(os.path.join(d, "model.safetensors"))
    torch.save({"x": torch.zeros(1)}, os.path.join(d, "pytorch_model.bin"))
    expect(f"{family}-bin-only", d, "pytorch_model.bin", "safe_serialization=True")

    d = copy(f"{family}-no-tokenizer")
    os.remove(os.path.join(d, "tokenizer.json"))
    expect(f"{family}-no-tokenizer", d, "tokenizer.json")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    os.makedirs(args.out, exist_ok=True)
    texts = hf_testdata.fortunes()
    rng = random.Random(7)
    manifest = {"transformers": transformers.__version__, "new_tokens": NEW_TOKENS, "cases": [], "bad": []}
    tokenizers_by_style = {s: train_tokenizer(texts, s) for s in ("bloom", "mpt")}
    for name, family, overrides, extras in CASES:
        tok, special = tokenizers_by_style[family]
        vocab = tok.get_vocab_size()
        ids = {"bos_token_id": tok.token_to_id(special[1]) if family == "bloom" else tok.token_to_id(special[0]),
               "eos_token_id": tok.token_to_id(special[2]) if family == "bloom" else tok.token_to_id(special[0]),
               "pad_token_id": tok.token_to_id(special[3]) if family == "bloom" else tok.token_to_id(special[1])}
        # Prompts of the wanted lengths, cut from fortunes tokenized by the checkpoint's tokenizer.
        prompts, texts_used = [], []
        for n in PROMPT_LENGTHS:
            while True:
                t = rng.choice(texts)
                enc = tok.encode(t).ids
                if len(enc) >= n:
                    prompts.append(enc[:n])
                    texts_used.append(t)
                    break
        # A text prompt for the end-to-end test: the tokenizer's ids of it and transformers' greedy.
        text = texts_used[2][:120]
        text_ids = tok.encode(text).ids
        # A seed whose greedy choices are never near a tie (a 1e-6 difference must not flip them),
        # the text prompt's included.
        for seed in range(100):
            model = make_model(family, overrides, extras, vocab, ids, seed)
            results = [greedy(model, p) for p in prompts]
            text_greedy, _, text_margin = greedy(model, text_ids)
            margin = min([r[2] for r in results] + [text_margin])
            if margin > 1e-3:
                break
        else:
            sys.exit(f"{name}: no seed with clear greedy choices")
        d = os.path.join(args.out, name)
        shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(d + "-sharded", ignore_errors=True)
        model.save_pretrained(d, safe_serialization=True)
        model.save_pretrained(d + "-sharded", safe_serialization=True, max_shard_size="40KB")
        for out_dir in (d, d + "-sharded"):
            tok.save(os.path.join(out_dir, "tokenizer.json"))
        assert os.path.exists(os.path.join(d + "-sharded", "model.safetensors.index.json"))
        ref = {}
        for i, (p, (tokens, logits, _)) in enumerate(zip(prompts, results)):
            ref[f"prompt_{i}"] = torch.tensor(p, dtype=torch.int32)
            ref[f"greedy_{i}"] = torch.tensor(tokens, dtype=torch.int32)
            ref[f"logits_{i}"] = logits.float().contiguous()
        save_file(ref, os.path.join(args.out, f"{name}.reference.safetensors"))
        manifest["cases"].append({
            "name": name, "family": family, "dir": d, "sharded_dir": d + "-sharded", "seed": seed,
            "greedy_margin": margin, "vocab_size": model.config.vocab_size,
            "tied": bool(model.config.tie_word_embeddings),
            "reference": os.path.join(args.out, f"{name}.reference.safetensors"), "prompts": len(prompts),
            "text": text, "text_ids": text_ids, "text_greedy": text_greedy,
            "text_greedy_decoded": tok.decode(text_greedy)})
        print(f"{name}: seed {seed}, greedy margin >= {margin:.4f}, "
              f"{sum(p.numel() for p in model.parameters())} parameters", flush=True)
    for family in ("bloom", "mpt"):
        good = next(c["dir"] for c in manifest["cases"] if c["family"] == family)
        write_bad(args.out, good, family, manifest)
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, ensure_ascii=False)
    print(f"{len(manifest['cases'])} checkpoints, {len(manifest['bad'])} broken ones in {args.out}")


if __name__ == "__main__":
    main()
