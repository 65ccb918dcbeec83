#!/usr/bin/env python3
"""Writes tiny random Hugging Face T5 / mT5 encoder-decoder checkpoints, as transformers saves them,
with transformers' own float32 outputs for them: the independent reference of relgen's T5 tests.

  RELGEN_HF_PYTHON tools/make_t5_checkpoints.py --out DIR

Needs transformers 4.46, tokenizers and sentencepiece (tools/bootstrap.sh makes the venv) on
Debian's torch; nothing is downloaded. A tiny unigram SentencePiece model (T5's ids: pad 0, eos 1,
unk 2, no bos) is trained on Debian's fortunes and wrapped in T5Tokenizer with EXTRA_IDS
<extra_id_N> tokens at the top of the vocabulary, as real T5 has 100.
For every case DIR/<case>/ is the checkpoint (config.json, generation_config.json,
model.safetensors, spiece.model, tokenizer_config.json, special_tokens_map.json and, where the fast
tokenizer converts offline, tokenizer.json) and DIR/<case>-sharded/ the same weights in several
shards; DIR/<case>.reference.safetensors holds, per encoder input i, `input_i` (I32 encoder ids: the
tokenizer's ids of fortunes, no eos, cut to 1, 7, 64, 200 and 500 tokens),
`greedy_i` (I32: 48 tokens of transformers' incremental greedy loop: the encoder once, the decoder
step by step with its cache from decoder_start_token_id, not stopping at eos), `logits_i` (F32
[48, vocab]: one decoder forward over [decoder_start] + greedy[:-1]) and `encoder_out_i` (F32
[len, d_model]: the encoder's final hidden states). Each case's seed is the first whose greedy
choices are all clear (top-1 minus top-2 logit > 1e-3) and not one token repeated (>= 16 distinct
tokens over the inputs). DIR/bad/<name>/ are broken checkpoints;
DIR/manifest.json lists all of it with what each broken one must be refused for, and where
transformers' float32 relative-position buckets differ from exact arithmetic.
"""
import argparse
import copy
import glob
import io
import json
import math
import os
import random
import shutil
import sys
import tempfile

import sentencepiece as spm
import torch
import transformers
from safetensors.torch import save_file
from transformers.modeling_outputs import BaseModelOutput
from transformers.models.t5.modeling_t5 import T5Attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_testdata  # noqa: E402

NEW_TOKENS = 48
INPUT_LENGTHS = [1, 7, 64, 200, 500]
EXTRA_IDS = 8
SPM_VOCAB = 400
MIN_MARGIN = 1e-3
MIN_DISTINCT = 16  # distinct greedy tokens over all inputs: not one token repeated (tied heads tend to)
BUCKET_DISTANCES = 1000


def train_spiece(texts, path):
    """A tiny unigram SentencePiece model with T5's special pieces (every 8th fortune: ~2 s on one core)."""
    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts[::8]), model_writer=proto, vocab_size=SPM_VOCAB, model_type="unigram",
        pad_id=0, eos_id=1, unk_id=2, bos_id=-1, pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>",
        num_threads=1, minloglevel=2)
    with open(path, "wb") as f:
        f.write(proto.getvalue())


def make_tokenizer(spiece):
    """T5TokenizerFast converted from the slow one where protobuf is at hand, else the slow T5Tokenizer."""
    from transformers import convert_slow_tokenizer
    slow = transformers.T5Tokenizer(spiece, extra_ids=EXTRA_IDS)
    try:
        convert_slow_tokenizer.import_protobuf()
    except ImportError:
        # sentencepiece 0.2.x's generated module wants protobuf >= 5; Debian has 4.21. transformers
        # carries the same ModelProto generated for older protobuf: convert with that one.
        from transformers.utils import sentencepiece_model_pb2_new
        convert_slow_tokenizer.import_protobuf = lambda error_message="": sentencepiece_model_pb2_new
    try:
        converted = transformers.T5TokenizerFast(vocab_file=spiece, extra_ids=EXTRA_IDS, from_slow=True)
        # Built again from its tokenizer.json, as from_pretrained loads a download: the converted one
        # would save add_prefix_space, which makes every later load convert from the slow one again.
        tokenizer_json = os.path.join(os.path.dirname(spiece), "tokenizer.json")
        converted.backend_tokenizer.save(tokenizer_json)
        fast = transformers.T5TokenizerFast(vocab_file=spiece, tokenizer_file=tokenizer_json, extra_ids=EXTRA_IDS)
    except Exception as e:  # no protobuf at all: no tokenizer.json, as with some real downloads
        print(f"no fast tokenizer ({type(e).__name__}: {e}); saving the slow one only", flush=True)
        fast = None
    return slow, fast


def randomize(model, seed):
    """Every parameter random and non-zero: RMSNorm weights 1 +- 0.3, relative bias tables N(0, 1),
    matrices N(0, 1) / sqrt(fan_in) (q also / sqrt(d_kv): T5 does not scale scores; o and wo 4 times that,
    so the residual stream is not just the input token's embedding, which the tied head would repeat)."""
    g = torch.Generator().manual_seed(seed)
    c = model.config
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("layer_norm.weight"):
                p.copy_(1.0 + 0.3 * r)
            elif name.endswith("relative_attention_bias.weight"):
                p.copy_(r)
            elif name == "shared.weight":
                p.copy_(r)
            elif name == "lm_head.weight":
                p.copy_(3.0 * r / math.sqrt(c.d_model))
            elif name.endswith(".q.weight"):
                p.copy_(1.5 * r / math.sqrt(p.shape[-1] * c.d_kv))
            elif name.endswith((".o.weight", ".wo.weight")):
                p.copy_(4.0 * r / math.sqrt(p.shape[-1]))
            else:
                assert p.dim() == 2, name
                p.copy_(r / math.sqrt(p.shape[-1]))


def greedy(model, ids, min_margin=0.0):
    """transformers' greedy tokens (encoder once, decoder incremental with its cache), the logits of one
    decoder pass over [start] + tokens[:-1], the encoder output and the smallest top-1/top-2 margin.
    None as soon as a margin is below min_margin."""
    with torch.no_grad():
        enc = model.get_encoder()(input_ids=torch.tensor([ids])).last_hidden_state
        enc_out = BaseModelOutput(last_hidden_state=enc)
        start = model.config.decoder_start_token_id
        out = model(encoder_outputs=enc_out, decoder_input_ids=torch.tensor([[start]]), use_cache=True)
        tokens, margin = [], math.inf
        for step in range(NEW_TOKENS):
            logits = out.logits[0, -1]
            top = torch.topk(logits, 2).values
            margin = min(margin, float(top[0] - top[1]))
            if margin < min_margin:
                return None
            tokens.append(int(torch.argmax(logits)))
            if step + 1 < NEW_TOKENS:
                out = model(encoder_outputs=enc_out, decoder_input_ids=torch.tensor([[tokens[-1]]]),
                            past_key_values=out.past_key_values, use_cache=True)
        full = model(encoder_outputs=enc_out, decoder_input_ids=torch.tensor([[start] + tokens[:-1]]),
                     use_cache=False).logits[0]
        # The cache and the whole-sequence pass must choose alike, or the reference is not one.
        assert [int(x) for x in torch.argmax(full, dim=-1)] == tokens
    return tokens, full, enc[0], margin


def exact_bucket(rel, bidirectional, num_buckets, max_distance):
    """T5's bucket of relative position rel (memory - query) in exact integer arithmetic:
    floor(log(n / max_exact) / log(max_distance / max_exact) * (nb - max_exact)) >= k
    <=> n^(nb - max_exact) * max_exact^k >= max_distance^k * max_exact^(nb - max_exact)."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        bucket += num_buckets if rel > 0 else 0
        n = abs(rel)
    else:
        n = max(-rel, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return bucket + n
    span = num_buckets - max_exact
    k = 0
    while k < span and n ** span * max_exact ** (k + 1) >= max_distance ** (k + 1) * max_exact ** span:
        k += 1
    return bucket + min(max_exact + k, num_buckets - 1)


def bucket_differences(num_buckets, max_distance):
    """Where transformers' float32 torch.log buckets differ from the exact ones, distances 0..1000 both ways."""
    rel = torch.arange(-BUCKET_DISTANCES, BUCKET_DISTANCES + 1)
    found = {}
    for direction, bidirectional in (("bidirectional", True), ("causal", False)):
        hf = T5Attention._relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=num_buckets,
                                                   max_distance=max_distance).tolist()
        found[direction] = [
            {"relative_position": r, "transformers": b, "exact": exact_bucket(r, bidirectional, num_buckets,
                                                                             max_distance)}
            for r, b in zip(rel.tolist(), hf) if b != exact_bucket(r, bidirectional, num_buckets, max_distance)]
    return found


CASES = [
    # name, config class, model class, config overrides, vocabulary padding past the tokenizer's
    ("t5-v1_0", "T5Config", "T5ForConditionalGeneration",
     dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, feed_forward_proj="relu",
          tie_word_embeddings=True), 0),
    ("t5-v1_1", "T5Config", "T5ForConditionalGeneration",
     dict(d_model=48, d_kv=16, d_ff=96, num_layers=3, num_heads=2, feed_forward_proj="gated-gelu",
          tie_word_embeddings=False, relative_attention_num_buckets=16, relative_attention_max_distance=40), 0),
    ("mt5", "MT5Config", "MT5ForConditionalGeneration",
     dict(d_model=64, d_kv=8, d_ff=128, num_layers=2, num_decoder_layers=3, num_heads=6,
          feed_forward_proj="gated-gelu", tie_word_embeddings=False), 0),
]


def make_model(config_class, model_class, overrides, vocab, seed):
    config = getattr(transformers, config_class)(
        vocab_size=vocab, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, **overrides)
    model = getattr(transformers, model_class)(config)
    randomize(model, seed)
    model.tie_weights()
    return model.eval()


def write_bad(out, good, prefix, manifest):
    """Broken copies of a good checkpoint, each with what relgen must say when it refuses it."""
    bad = hf_testdata.BrokenCopies(out, good, manifest)
    copy, edit_config, expect = bad.copy, bad.edit_config, bad.expect
    bad.missing_shard(f"{prefix}-missing-shard")
    bad.unknown_key(f"{prefix}-unknown-key")

    # transformers takes feed_forward_proj "[gated-]ACT" for any ACT2FN name and saves the derived
    # is_gated_act and dense_act_fn too (which win when loaded); relgen implements "relu" and
    # "gated-gelu" (gelu_new) only. As T5Config(feed_forward_proj="gated-silu") saves it:
    d = copy(f"{prefix}-math-value")
    edit_config(d, lambda c: c.update(feed_forward_proj="gated-silu", dense_act_fn="silu", is_gated_act=True))
    expect(f"{prefix}-math-value", d, "gated-silu", "not implemented")

    d = copy(f"{prefix}-no-spiece")
    os.remove(os.path.join(d, "spiece.model"))
    expect(f"{prefix}-no-spiece", d, "spiece.model")


def decode_cases(slow, fast, rng, count=400):
    """Id sequences as a model may emit them, as T5TokenizerFast decodes them: lone and leading
    "▁" pieces, short pieces, <pad>/</s>/<unk> (skip_special_tokens drops them) and sentinels
    (kept as text, so those sequences hold no other special ids and decode without skipping);
    text_keep: every case decoded with skip_special_tokens=False."""
    pieces = slow.sp_model.get_piece_size()
    special = {slow.pad_token_id, slow.eos_token_id, slow.unk_token_id}
    short = [i for i in range(pieces) if len(slow.sp_model.id_to_piece(i)) <= 2]
    spaces = [i for i in range(pieces) if slow.sp_model.id_to_piece(i).strip("▁") == ""]
    assert spaces, "the SentencePiece model has no lone ▁ piece"
    cases = []
    for n in range(count):
        ids = [rng.choice(spaces) if r < 0.15 else rng.choice(short) if r < 0.6 else rng.randrange(pieces)
               for r in (rng.random() for _ in range(rng.randint(1, 10)))]
        if n % 3 == 0:
            ids = [i for i in ids if i not in special]
            for _ in range(rng.randint(1, 2)):
                ids.insert(rng.randint(0, len(ids)), fast.convert_tokens_to_ids(f"<extra_id_{rng.randrange(3)}>"))
            text = fast.decode(ids, skip_special_tokens=False)
        else:
            if n % 3 == 1:  # specials among the pieces (what skip_special_tokens=False writes)
                for _ in range(rng.randint(1, 2)):
                    ids.insert(rng.randint(0, len(ids)), rng.choice(sorted(special)))
            text = fast.decode(ids, skip_special_tokens=True)
        cases.append({"ids": ids, "text": text, "text_keep": fast.decode(ids, skip_special_tokens=False)})
    assert any(c["text"].startswith(" ") for c in cases) and any("  " in c["text"] for c in cases)
    return cases


def write_case(out, name, model, tok, inputs, results, text, text_ids, text_result, seed, dtype="F32"):
    """Saves the checkpoint (whole and sharded) and its reference; returns its manifest entry."""
    d = os.path.join(out, name)
    for out_dir in (d, d + "-sharded"):
        shutil.rmtree(out_dir, ignore_errors=True)
    model.save_pretrained(d, safe_serialization=True)
    shard = sum(p.numel() * p.element_size() for p in model.state_dict().values()) // 5
    model.save_pretrained(d + "-sharded", safe_serialization=True, max_shard_size=shard)
    for out_dir in (d, d + "-sharded"):
        tok.save_pretrained(out_dir)
        assert os.path.exists(os.path.join(out_dir, "spiece.model"))
    assert len(glob.glob(os.path.join(d + "-sharded", "model-*.safetensors"))) >= 3
    ref = {}
    for i, (ids, (tokens, logits, enc, _)) in enumerate(zip(inputs, results)):
        ref[f"input_{i}"] = torch.tensor(ids, dtype=torch.int32)
        ref[f"greedy_{i}"] = torch.tensor(tokens, dtype=torch.int32)
        ref[f"logits_{i}"] = logits.float().contiguous()
        ref[f"encoder_out_{i}"] = enc.float().contiguous()
    reference = os.path.join(out, f"{name}.reference.safetensors")
    save_file(ref, reference)
    c = model.config
    margin = min(r[3] for r in results + [text_result])
    print(f"{name}: seed {seed}, greedy margin >= {margin:.4f}, {dtype}, "
          f"{sum(p.numel() for p in model.parameters())} parameters", flush=True)
    return {
        "name": name, "model_type": c.model_type, "dir": d, "sharded_dir": d + "-sharded", "dtype": dtype,
        "reference": reference, "inputs": len(inputs), "seed": seed, "greedy_margin": margin,
        "vocab_size": c.vocab_size, "tied": bool(c.tie_word_embeddings), "d_model": c.d_model,
        "d_kv": c.d_kv, "d_ff": c.d_ff, "num_heads": c.num_heads, "num_layers": c.num_layers,
        "num_decoder_layers": c.num_decoder_layers, "feed_forward_proj": c.feed_forward_proj,
        "relative_attention_num_buckets": c.relative_attention_num_buckets,
        "relative_attention_max_distance": c.relative_attention_max_distance,
        "decoder_start_token_id": c.decoder_start_token_id, "eos_token_id": c.eos_token_id,
        "text": text, "text_ids": text_ids, "text_greedy": text_result[0],
        "text_greedy_decoded": tok.decode(text_result[0], skip_special_tokens=True),
        "bucket_differences": bucket_differences(c.relative_attention_num_buckets,
                                                 c.relative_attention_max_distance)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    os.makedirs(args.out, exist_ok=True)
    texts = hf_testdata.fortunes()
    rng = random.Random(7)
    with tempfile.TemporaryDirectory() as tmp:
        spiece = os.path.join(tmp, "spiece.model")
        train_spiece(texts, spiece)
        slow, fast = make_tokenizer(spiece)
        tok = fast or slow
        vocab = len(tok)
        assert vocab == SPM_VOCAB + EXTRA_IDS and tok.convert_tokens_to_ids("<extra_id_0>") == vocab - 1

        def encode(text, special=False):
            ids = tok(text, add_special_tokens=special).input_ids
            assert ids == slow(text, add_special_tokens=special).input_ids, text
            return ids

        # Encoder inputs of the wanted lengths, cut from fortunes (joined where one is too short).
        inputs = []
        for n in INPUT_LENGTHS:
            ids = []
            while len(ids) < n:
                ids += encode(rng.choice(texts))
            inputs.append(ids[:n])
        # A short one-line fortune for the end-to-end test, tokenized with its eos.
        short = [t for t in texts if 30 <= len(t) <= 100 and "\n" not in t.strip() and t.isascii()]
        text = rng.choice(short).strip()
        text_ids = encode(text, special=True)
        assert text_ids[-1] == 1
        manifest = {"transformers": transformers.__version__, "new_tokens": NEW_TOKENS,
                    "input_lengths": INPUT_LENGTHS, "extra_ids": EXTRA_IDS, "tokenizer_json": fast is not None,
                    "cases": [], "bad": []}
        for name, config_class, model_class, overrides, pad_vocab in CASES:
            # A seed whose greedy choices are never near a tie (a 1e-6 difference must not flip them).
            for seed in range(100):
                model = make_model(config_class, model_class, overrides, vocab + pad_vocab, seed)
                results = []
                for ids in inputs + [text_ids]:
                    results.append(greedy(model, ids, MIN_MARGIN))
                    if results[-1] is None:
                        break
                if results[-1] is not None and len({t for r in results for t in r[0]}) >= MIN_DISTINCT:
                    break
            else:
                sys.exit(f"{name}: no seed with clear greedy choices")
            text_result = results.pop()
            manifest["cases"].append(write_case(args.out, name, model, tok, inputs, results, text, text_ids,
                                                text_result, seed))
            if name == "t5-v1_1":
                # The same weights stored as float16: relgen widens them to float32 at load, so the
                # reference is transformers in float32 on the f16-rounded weights.
                half = copy.deepcopy(model).half()
                rounded = copy.deepcopy(half).float().eval()
                results = [greedy(rounded, ids) for ids in inputs + [text_ids]]
                text_result = results.pop()
                assert min(r[3] for r in results + [text_result]) > 1e-4, "f16 copy: near-tie"
                manifest["cases"].append(write_case(args.out, name + "-f16", half, tok, inputs, results, text,
                                                    text_ids, text_result, seed, dtype="F16"))
        # Texts with sentinels, as T5's span-corruption inputs have them.
        manifest["sentinel_texts"] = [
            {"text": t, "ids": encode(t, special=True)}
            for t in ("The <extra_id_0> walks in <extra_id_1> park", "<extra_id_0>", "a<extra_id_7>b <extra_id_1>.",
                      "not a sentinel: <extra_id_99> <extra_id_x>")]
        manifest["decode_cases"] = decode_cases(slow, fast, random.Random(11)) if fast is not None else []
    for prefix in ("t5", "mt5"):
        good = next(c["dir"] for c in manifest["cases"]
                    if c["model_type"] == prefix and not c["tied"] and c["dtype"] == "F32")
        write_bad(args.out, good, prefix, manifest)
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1, ensure_ascii=False)
    print(f"{len(manifest['cases'])} checkpoints, {len(manifest['bad'])} broken ones in {args.out}")


if __name__ == "__main__":
    main()
