#!/usr/bin/env python3
"""Writes tiny random Hugging Face base checkpoints with random PEFT LoRA adapters for them, and PEFT's
own float32 outputs: the independent reference of relgen's multi-LoRA tests.

  RELGEN_HF_PYTHON tools/make_lora_adapters.py --out DIR

Needs transformers 4.46, peft 0.13, tokenizers and sentencepiece (tools/bootstrap.sh makes the venv)
on Debian's torch; nothing is downloaded. The bases are built, tokenized and saved as
tools/make_t5_checkpoints.py and tools/make_hf_checkpoints.py make their cases (their configurations,
weights, tokenizers and greedy loops): DIR/t5/ (T5, relu FFN, tied), DIR/t5-gated/ (T5 v1.1,
gated-gelu, untied), DIR/bloom/ and DIR/mpt/, each its first seed whose greedy choices are all clear.
DIR/<base>/adapters/<name>/ are three adapters per base, as PeftModel.save_pretrained writes them
(adapter_config.json, adapter_model.safetensors): ranks 8, 2 and 4, scalings 2, 3 and (rsLoRA,
lora_alpha / sqrt(r)) 4, different target modules, the rank-2 one on layer 1 only. PEFT starts
lora_B at zero; here every lora_A and lora_B is random, sized so the adapter's change to a module's
output is about LORA_SIZE of the module's own, and each adapter's seed is the first whose greedy choices
are all clear and differ from the base's for all prompts but at most one.
DIR/<base>/reference/base.safetensors is the base alone and DIR/<base>/reference/<adapter>.safetensors
the PeftModel with that adapter (eval mode, float32), for the same 1-, 7- and 30-token prompts (the
tokenizer's ids of fortunes), in the formats of the tools' own references: decoder-only `prompt_i`
(I32), `greedy_i` (I32: 16 tokens of the incremental greedy loop over forward with the KV cache, not
stopping at eos) and `logits_i` (F32 [prompt + 16, vocab]: one forward over the whole sequence); T5
`input_i`, `greedy_i`, `logits_i` (F32 [16, vocab]: one decoder pass over [decoder_start] +
greedy[:-1]) and `encoder_out_i`. Every adapter is loaded back with PeftModel.from_pretrained onto the
saved base and must reproduce its reference. DIR/bad/<name>/ are broken adapters; DIR/manifest.json
lists all of it with what each broken one must be refused for.
"""
import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile

import peft
import torch
import transformers
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_testdata  # noqa: E402
import make_hf_checkpoints as hf_ck  # noqa: E402
import make_t5_checkpoints as t5_ck  # noqa: E402

NEW_TOKENS = 16
PROMPT_LENGTHS = [1, 7, 30]
MIN_MARGIN = 1e-3
MIN_DISTINCT = 8  # distinct greedy tokens over the prompts: no reference that repeats one token
LORA_SIZE = 0.6
RELOAD_TOLERANCE = 1e-5
MAX_RANK = 16  # relgen's tests load adapters with this limit; the too-large one exceeds it

# Both tools' greedy loops take their length from their module's NEW_TOKENS.
hf_ck.NEW_TOKENS = t5_ck.NEW_TOKENS = NEW_TOKENS

T5_ATTN = ("q", "k", "v", "o")
BASES = [
    # name, family, the tool's case it is built as
    ("t5", "t5", "t5-v1_0"),
    ("t5-gated", "t5", "t5-v1_1"),
    ("bloom", "bloom", "bloom-h3"),
    ("mpt", "mpt", "mpt-h3"),
]
# Per base: name, rank, lora_alpha, target_modules and any other LoraConfig fields. PEFT applies
# layers_to_transform to the first "<name>.<digits>." of a module's path unless told layers_pattern:
# in T5 that would be layer.N (the sub-layer), not block.N.
ADAPTERS = {
    "t5": [
        ("self-attn", 8, 16, [f"SelfAttention.{m}" for m in T5_ATTN], {}),
        ("cross-ffn-layer1", 2, 6, [f"EncDecAttention.{m}" for m in T5_ATTN] + ["wi", "wo"],
         dict(layers_to_transform=[1], layers_pattern="block")),
        ("qv-wo-rslora", 4, 8, ["q", "v", "wo"], dict(use_rslora=True)),
    ],
    "t5-gated": [
        ("self-attn", 8, 16, [f"SelfAttention.{m}" for m in T5_ATTN], {}),
        ("cross-ffn-layer1", 2, 6, [f"EncDecAttention.{m}" for m in T5_ATTN] + ["wi_0", "wi_1", "wo"],
         dict(layers_to_transform=[1], layers_pattern="block")),
        ("ko-gate-rslora", 4, 8, ["k", "o", "wi_0", "wi_1"], dict(use_rslora=True)),
    ],
    "bloom": [
        ("attn", 8, 16, ["query_key_value", "dense"], {}),
        ("mlp-layer1", 2, 6, ["dense_h_to_4h", "dense_4h_to_h"], dict(layers_to_transform=[1])),
        ("all-rslora", 4, 8, ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"], dict(use_rslora=True)),
    ],
    "mpt": [
        ("attn", 8, 16, ["Wqkv", "out_proj"], {}),
        ("ffn-layer1", 2, 6, ["up_proj", "down_proj"], dict(layers_to_transform=[1])),
        ("all-rslora", 4, 8, ["Wqkv", "out_proj", "up_proj", "down_proj"], dict(use_rslora=True)),
    ],
}


class Base:
    """One base checkpoint: the tool's case it is built as, its tokenizer and the prompts."""

    def __init__(self, out, name, family, case_name, texts, tokenizers):
        self.name, self.family, self.dir = name, family, os.path.join(out, name)
        self.seed, self.adapters = None, {}  # its seed and, per adapter, (spec, seed) once written
        rng = random.Random(7)
        if family == "t5":
            case = next(c for c in t5_ck.CASES if c[0] == case_name)
            _, self.config_class, self.model_class, self.overrides, pad_vocab = case
            self.tok = tokenizers["t5"]
            self.vocab = len(self.tok) + pad_vocab
            self.prompts = []
            for n in PROMPT_LENGTHS:  # joined where one fortune is too short, as the T5 tool does
                ids = []
                while len(ids) < n:
                    ids += self.tok(rng.choice(texts), add_special_tokens=False).input_ids
                self.prompts.append(ids[:n])
        else:
            case = next(c for c in hf_ck.CASES if c[0] == case_name)
            _, _, self.overrides, self.extras = case
            self.tok, special = tokenizers[family]
            self.vocab = self.tok.get_vocab_size()
            bloom = family == "bloom"
            self.special_ids = {"bos_token_id": self.tok.token_to_id(special[1] if bloom else special[0]),
                                "eos_token_id": self.tok.token_to_id(special[2] if bloom else special[0]),
                                "pad_token_id": self.tok.token_to_id(special[3] if bloom else special[1])}
            self.prompts = []
            for n in PROMPT_LENGTHS:
                while True:
                    enc = self.tok.encode(rng.choice(texts)).ids
                    if len(enc) >= n:
                        self.prompts.append(enc[:n])
                        break

    def build(self, seed):
        if self.family == "t5":
            return t5_ck.make_model(self.config_class, self.model_class, self.overrides, self.vocab, seed)
        return hf_ck.make_model(self.family, self.overrides, self.extras, self.vocab, self.special_ids, seed)

    def run(self, model):
        """The greedy tokens, whole-sequence logits (and encoder output) per prompt; None where a choice
        is not clear or the tokens are nearly one repeated."""
        results = []
        for ids in self.prompts:
            try:
                if self.family == "t5":
                    r = t5_ck.greedy(model, ids, MIN_MARGIN)
                    if r is None:
                        return None
                    results.append({"tokens": r[0], "logits": r[1], "encoder_out": r[2], "margin": r[3]})
                else:
                    tokens, logits, margin = hf_ck.greedy(model, ids)
                    if margin < MIN_MARGIN:
                        return None
                    results.append({"tokens": tokens, "logits": logits, "margin": margin})
            except AssertionError:  # the cached and whole-sequence passes chose apart: a near-tie
                return None
        if len({t for r in results for t in r["tokens"]}) < MIN_DISTINCT:
            return None
        return results

    def save(self, model, d):
        shutil.rmtree(d, ignore_errors=True)
        model.save_pretrained(d, safe_serialization=True)
        if self.family == "t5":
            self.tok.save_pretrained(d)
        else:
            self.tok.save(os.path.join(d, "tokenizer.json"))

    def load(self, d):
        if self.family == "t5":
            return getattr(transformers, self.model_class).from_pretrained(d).eval()
        cls = transformers.BloomForCausalLM if self.family == "bloom" else transformers.MptForCausalLM
        model = cls.from_pretrained(d).eval()
        if self.family == "mpt":
            hf_ck.honour_alibi_bias_max(model)
        return model

    def write_reference(self, path, results):
        ref = {}
        for i, (ids, r) in enumerate(zip(self.prompts, results)):
            ref[f"input_{i}" if self.family == "t5" else f"prompt_{i}"] = torch.tensor(ids, dtype=torch.int32)
            ref[f"greedy_{i}"] = torch.tensor(r["tokens"], dtype=torch.int32)
            ref[f"logits_{i}"] = r["logits"].float().contiguous()
            if self.family == "t5":
                ref[f"encoder_out_{i}"] = r["encoder_out"].float().contiguous()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_file(ref, path)

    def entry(self, model, d, reference, seed, results):
        """Its manifest entry, with the fields tests/hf_reference.h and tests/t5_reference.h read."""
        c = model.config
        e = {"name": self.name, "family": self.family, "model_type": c.model_type, "dir": d,
             "reference": reference, "prompts": len(self.prompts), "new_tokens": NEW_TOKENS, "seed": seed,
             "greedy_margin": min(r["margin"] for r in results), "vocab_size": c.vocab_size,
             "tied": bool(c.tie_word_embeddings), "eos_token_id": c.eos_token_id}
        if self.family == "t5":
            e.update(inputs=len(self.prompts), decoder_start_token_id=c.decoder_start_token_id, d_model=c.d_model,
                     d_kv=c.d_kv, d_ff=c.d_ff, num_heads=c.num_heads, num_layers=c.num_layers,
                     num_decoder_layers=c.num_decoder_layers, feed_forward_proj=c.feed_forward_proj)
        return e


def lora_config(base, rank, alpha, targets, extra):
    return peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                           task_type="SEQ_2_SEQ_LM" if base.family == "t5" else "CAUSAL_LM", **extra)


def randomize_lora(model, seed):
    """lora_A N(0, 1/in) and lora_B sized so that scaling * B @ A changes the module's output by about
    LORA_SIZE of the base weight's own (whatever the rank and alpha: relgen must apply them)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in model.named_modules():
            if not isinstance(m, LoraLayer):
                continue
            for adapter in m.lora_A:
                a, b = m.lora_A[adapter].weight, m.lora_B[adapter].weight
                rank, fan_in = a.shape
                gain = float(m.get_base_layer().weight.pow(2).mean().sqrt()) * math.sqrt(fan_in)
                a.copy_(torch.randn(a.shape, generator=g) / math.sqrt(fan_in))
                b.copy_(torch.randn(b.shape, generator=g) * LORA_SIZE * gain / math.sqrt(rank) / m.scaling[adapter])


def make_adapter(base, base_seed, spec, seed, **changes):
    _, rank, alpha, targets, extra = spec
    model = base.build(base_seed)
    # adapter_config.json's base_model_name_or_path; a local directory also keeps PEFT's save from
    # asking the Hub whether the base's vocabulary was resized.
    model.name_or_path = model.config.name_or_path = base.dir
    model = peft.get_peft_model(model, lora_config(base, rank, alpha, targets, {**extra, **changes}))
    randomize_lora(model, seed)
    return model.eval()


def save_adapter(model, d):
    shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(d, safe_serialization=True)
    # PEFT keeps target_modules as a set and writes it in hash order: sorted, the file is the same every run.
    p = os.path.join(d, "adapter_config.json")
    with open(p) as f:
        c = json.load(f)
    c["target_modules"] = sorted(c["target_modules"])
    with open(p, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)


def first_clear(name, build, run, accept=lambda results: True):
    for seed in range(100):
        model = build(seed)
        results = run(model)
        if results is not None and accept(results):
            return seed, model, results
    sys.exit(f"{name}: no seed with clear greedy choices (an adapter's differing from the base's)")


def max_diff(a, b):
    return float((a - b).abs().max())


def check_reload(base, adapter_dir, results):
    """The saved adapter on the saved base, as PeftModel.from_pretrained loads it, must give the reference."""
    model = peft.PeftModel.from_pretrained(base.load(base.dir), adapter_dir).eval()
    again = base.run(model)
    assert again is not None, adapter_dir
    for r, s in zip(results, again):
        assert r["tokens"] == s["tokens"], adapter_dir
        assert max_diff(r["logits"], s["logits"]) < RELOAD_TOLERANCE, adapter_dir
        if "encoder_out" in r:
            assert max_diff(r["encoder_out"], s["encoder_out"]) < RELOAD_TOLERANCE, adapter_dir


def adapter_keys(d):
    return sorted(load_file(os.path.join(d, "adapter_model.safetensors")))


def write_base(base):
    seed, model, results = first_clear(base.name, base.build, base.run)
    base.save(model, base.dir)
    reference = os.path.join(base.dir, "reference", "base.safetensors")
    base.write_reference(reference, results)
    entry = base.entry(model, base.dir, reference, seed, results)
    entry["adapters"] = []
    base.seed = seed
    for index, spec in enumerate(ADAPTERS[base.name]):
        name, rank, alpha, targets, extra = spec

        def changed(adapted):
            # The adapter must show in the greedy tokens of all prompts but at most one.
            return sum(a["tokens"] != b["tokens"] for a, b in zip(adapted, results)) >= len(results) - 1

        first = 1000 * (index + 1)
        aseed, peft_model, aresults = first_clear(
            f"{base.name}/{name}", lambda s: make_adapter(base, seed, spec, first + s), base.run, changed)
        aseed += first
        d = os.path.join(base.dir, "adapters", name)
        save_adapter(peft_model, d)
        areference = os.path.join(base.dir, "reference", f"{name}.safetensors")
        base.write_reference(areference, aresults)
        check_reload(base, d, aresults)
        base.adapters[name] = (spec, aseed)
        cfg = peft_model.peft_config["default"]
        a = {k: v for k, v in entry.items() if k != "adapters"}
        a.update(name=name, dir=d, base=base.name, base_dir=base.dir, rank=rank, lora_alpha=alpha,
                 use_rslora=bool(cfg.use_rslora), scaling=alpha / (math.sqrt(rank) if cfg.use_rslora else rank),
                 targets=list(targets), layers_to_transform=cfg.layers_to_transform, reference=areference,
                 seed=aseed, greedy_margin=min(r["margin"] for r in aresults),
                 changed_prompts=sum(x["tokens"] != y["tokens"] for x, y in zip(aresults, results)),
                 modules=sorted({key.split(".lora_")[0] for key in adapter_keys(d)}))
        entry["adapters"].append(a)
    return entry


class BadAdapters:
    """Broken copies of good adapters under OUT/bad/, each with the base it is given against and the
    substrings relgen's refusal must contain."""

    def __init__(self, out, bases, manifest):
        self.root = os.path.join(out, "bad")
        self.bases = {b.name: b for b in bases}
        self.manifest = manifest
        shutil.rmtree(self.root, ignore_errors=True)
        os.makedirs(self.root)

    def good(self, base, adapter):
        return os.path.join(self.bases[base].dir, "adapters", adapter)

    def copy(self, name, base, adapter):
        d = os.path.join(self.root, name)
        shutil.copytree(self.good(base, adapter), d)
        return d

    def regenerate(self, name, base, adapter, **changes):
        """The good adapter made again by PEFT with a config change, so the file holds what PEFT saves for it."""
        b = self.bases[base]
        spec, seed = b.adapters[adapter]
        d = os.path.join(self.root, name)
        save_adapter(make_adapter(b, b.seed, spec, seed, **changes), d)
        return d

    @staticmethod
    def edit_config(d, fn):
        hf_testdata.BrokenCopies.edit_config(d, fn, "adapter_config.json")

    @staticmethod
    def edit_tensors(d, fn):
        p = os.path.join(d, "adapter_model.safetensors")
        tensors = load_file(p)
        fn(tensors)
        save_file(tensors, p, metadata={"format": "pt"})

    def expect(self, name, d, base, *substrings):
        self.manifest["bad"].append({"name": name, "dir": d, "base": base, "expect": list(substrings)})


def write_bad(out, bases, manifest):
    bad = BadAdapters(out, bases, manifest)
    g = torch.Generator().manual_seed(99)

    d = bad.copy("bloom-lora-b-wrong-shape", "bloom", "attn")
    key = "base_model.model.transformer.h.0.self_attention.dense.lora_B.weight"
    bad.edit_tensors(d, lambda t: t.update({key: torch.randn(t[key].shape[0] + 3, t[key].shape[1], generator=g)}))
    bad.expect("bloom-lora-b-wrong-shape", d, "bloom", key)

    # lm_head is an nn.Linear PEFT could adapt; relgen adapts none but the attention and FFN projections.
    d = bad.copy("t5-unknown-module", "t5", "self-attn")
    t5 = bad.bases["t5"]
    key = "base_model.model.lm_head.lora_A.weight"

    def add_head(t):
        t[key] = torch.randn(8, t5.overrides["d_model"], generator=g)
        t[key.replace("lora_A", "lora_B")] = torch.randn(t5.vocab, 8, generator=g)
    bad.edit_tensors(d, add_head)
    bad.expect("t5-unknown-module", d, "t5", key)

    d = bad.copy("mpt-rank-64", "mpt", "all-rslora")

    def widen(t):
        for k in t:
            shape = (64, t[k].shape[1]) if ".lora_A." in k else (t[k].shape[0], 64)
            t[k] = torch.randn(shape, generator=g) / 8
    bad.edit_tensors(d, widen)
    bad.edit_config(d, lambda c: c.update(r=64))
    bad.expect("mpt-rank-64", d, "mpt", "rank", "64")

    d = bad.regenerate("bloom-modules-to-save", "bloom", "attn", modules_to_save=["ln_f"])
    assert "base_model.model.transformer.ln_f.weight" in adapter_keys(d)
    bad.expect("bloom-modules-to-save", d, "bloom", "modules_to_save")

    d = bad.regenerate("t5-gated-dora", "t5-gated", "self-attn", use_dora=True)
    assert any("lora_magnitude_vector" in k for k in adapter_keys(d))
    bad.expect("t5-gated-dora", d, "t5-gated", "use_dora")

    d = bad.regenerate("bloom-bias-all", "bloom", "attn", bias="all")
    assert any(k.endswith(".bias") for k in adapter_keys(d))
    bad.expect("bloom-bias-all", d, "bloom", "bias")

    d = bad.copy("mpt-not-lora", "mpt", "attn")
    bad.edit_config(d, lambda c: c.update(peft_type="LOHA"))
    bad.expect("mpt-not-lora", d, "mpt", "peft_type")

    d = bad.copy("t5-no-weights", "t5", "qv-wo-rslora")
    os.remove(os.path.join(d, "adapter_model.safetensors"))
    bad.expect("t5-no-weights", d, "t5", "adapter_model.safetensors")

    # Rank 4 in the config and in lora_A, 3 in this lora_B: each tensor alone could pass a shape check.
    d = bad.copy("t5-gated-rank-mismatch", "t5-gated", "ko-gate-rslora")
    key = "base_model.model.decoder.block.1.layer.2.DenseReluDense.wi_1.lora_B.weight"
    bad.edit_tensors(d, lambda t: t.update({key: t[key][:, :-1].contiguous()}))
    bad.expect("t5-gated-rank-mismatch", d, "t5-gated", key)

    d = bad.copy("bloom-on-t5", "bloom", "all-rslora")
    bad.expect("bloom-on-t5", d, "t5", adapter_keys(d)[0])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    os.makedirs(out, exist_ok=True)
    texts = hf_testdata.fortunes()
    tokenizers = {s: hf_ck.train_tokenizer(texts, s) for s in ("bloom", "mpt")}
    with tempfile.TemporaryDirectory() as tmp:
        spiece = os.path.join(tmp, "spiece.model")
        t5_ck.train_spiece(texts, spiece)
        slow, fast = t5_ck.make_tokenizer(spiece)
        tokenizers["t5"] = fast or slow
        bases = [Base(out, name, family, case, texts, tokenizers) for name, family, case in BASES]
        manifest = {"transformers": transformers.__version__, "peft": peft.__version__, "new_tokens": NEW_TOKENS,
                    "max_rank": MAX_RANK, "bases": [write_base(b) for b in bases], "bad": []}
    write_bad(out, bases, manifest)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
