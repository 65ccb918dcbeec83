#!/usr/bin/env python3
"""CTranslate2 side of `relgen-bench engine --peer ct2`: a relgen model (docs/model-format.md)
converted to a CTranslate2 decoder (its Python spec API), checked against relgen's float64
reference, and timed as relgen's engine bench times relgen. CTranslate2 (pip install ctranslate2) is
a benchmark peer only; nothing in the server uses it.

  PY=build-hf-venv/bin/python
  $PY tools/bench/ct2_peer.py convert --model DIR --out CT2DIR [--quantization int8]
  $PY tools/bench/ct2_peer.py check   --model DIR [--prompt 64] [--new 32]
  $PY tools/bench/ct2_peer.py bench   --model DIR --batch B --context C --steps N --threads T
                                      [--compute_type float32|int8]

How each scheme maps (exact = the same function, checked by `check`):
  t5     CTranslate2's T5 bias (bucket table per head, max_distance), queries_scale = relgen's scale
  alibi  CTranslate2's ALiBi (positive positions: softmax-equal to -slope * distance)
  shaw   CTranslate2's relative_position_keys/values (one table per layer, shared by the heads):
         exact when the model's tables are shared by the heads (heads_share_table); keys-only
         models get zero value tables (exact, at the cost of the value term)
  skew   no CTranslate2 equivalent: mapped to Shaw keys+values with the same reach, for speed only
bench prints one JSON object: prefill_tokens_per_s (one sequence of C tokens), batch_prefill_tokens_per_s
(B sequences of C tokens in one call), decode_tokens_per_s (B sequences at position C, N steps)."""
import argparse
import json
import math
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import safetensors_io  # noqa: E402


def load(model_dir):
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    cfg.setdefault("head_dim", cfg["d_model"] // cfg["n_heads"])
    t = {k: np.array(v, dtype=np.float32) for k, v in safetensors_io.load(os.path.join(model_dir, "model.safetensors")).items()}
    return cfg, t


def vocabulary(cfg):
    toks = [f"t{i}" for i in range(cfg["vocab_size"])]
    names = {"bos_token_id": "<s>", "eos_token_id": "</s>", "pad_token_id": "<unk>"}
    for key, name in names.items():
        if cfg.get(key) is not None and 0 <= cfg[key] < len(toks):
            toks[cfg[key]] = name
    if "<unk>" not in toks:
        toks.append("<unk>")  # CTranslate2 requires one; never produced (no logit row)
    return toks


def build_spec(cfg, t):
    """Returns (spec, exact): exact is False where the mapping is for speed only."""
    from ctranslate2.specs import common_spec, transformer_spec

    r = cfg["relative_attention"]
    scheme = r["scheme"]
    h, hd, L = cfg["n_heads"], cfg["head_dim"], cfg["n_layers"]
    if scheme not in ("t5", "alibi", "shaw", "skew"):
        raise SystemExit(f"ct2_peer: scheme {scheme} has no CTranslate2 mapping (t5, alibi, shaw, skew)")
    scale = cfg.get("attention_scale") or 1.0 / math.sqrt(hd)
    scale_rel = r.get("scale_with_qk", True)
    act = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU,
           "gelu_tanh": common_spec.Activation.GELUTanh, "silu": common_spec.Activation.SWISH}[cfg.get("ffn_activation", "gelu")]
    pre = cfg.get("norm_placement", "pre") == "pre"
    rms = cfg.get("norm", "layernorm") == "rmsnorm"
    dec = transformer_spec.TransformerDecoderSpec(
        L, h, pre_norm=pre, activation=act, with_encoder_attention=False,
        relative_position=scheme in ("shaw", "skew"), relative_attention_bias=scheme == "t5",
        ffn_glu=cfg.get("ffn_gated", False), rms_norm=rms, alibi=scheme == "alibi",
        alibi_use_positive_positions=True, scale_alibi=scheme == "alibi" and scale_rel,
        head_dim=hd if hd * h != cfg["d_model"] else None)
    spec = transformer_spec.TransformerDecoderModelSpec(dec)
    exact = True

    def lin(s, p):
        s.weight = t[p + ".weight"]
        if p + ".bias" in t:
            s.bias = t[p + ".bias"]

    def norm(s, p):
        s.gamma = t[p + ".weight"]
        if not rms:
            s.beta = t[p + ".bias"]

    emb = t["embed.weight"] * np.float32(cfg.get("embedding_scale", 1.0))
    dec.scale_embeddings = False
    dec.embeddings.weight = emb
    dec.projection.weight = t["embed.weight"] if cfg.get("tie_embeddings", False) else t["lm_head.weight"]
    if pre:
        norm(dec.layer_norm, "final_norm")
    shared = r.get("share_across_layers", scheme == "t5")
    for l, layer in enumerate(dec.layer):
        p = f"layers.{l}."
        rp = "attn." if shared else p + "attn."
        att = layer.self_attention
        norm(att.layer_norm, p + "attn_norm")
        att.linear[0].weight = np.concatenate([t[p + f"attn.{n}.weight"] for n in "qkv"])
        if p + "attn.q.bias" in t:
            att.linear[0].bias = np.concatenate([t[p + f"attn.{n}.bias"] for n in "qkv"])
        lin(att.linear[1], p + "attn.o")
        if scheme == "t5":
            if r.get("bidirectional", False):
                raise SystemExit("ct2_peer: a bidirectional T5 table has no causal CTranslate2 equivalent")
            bias = t[rp + "rel_bias"]  # [hs, buckets]
            bias = np.broadcast_to(bias, (h, bias.shape[1])) * np.float32(scale if scale_rel else 1.0)
            att.relative_attention_bias = np.ascontiguousarray(bias.T)  # [buckets, heads]
            att.relative_attention_max_distance = np.dtype("int32").type(r.get("max_distance", 128))
            att.queries_scale = np.dtype("float32").type(scale)
        elif scheme == "alibi":
            att.queries_scale = np.dtype("float32").type(scale)
        elif scheme == "shaw":
            rk = t[rp + "rel_k"]  # [hs, 2k+1, hd]
            if rk.shape[0] != 1:
                exact = False  # per-head tables: CTranslate2 has one per layer
            att.relative_position_keys = np.ascontiguousarray(rk[0])
            rv = t.get(rp + "rel_v")
            att.relative_position_values = np.ascontiguousarray(rv[0]) if rv is not None else np.zeros_like(rk[0])
            if not scale_rel:
                exact = False
            att.queries_scale = np.dtype("float32").type(scale)
        else:  # skew: Shaw with the same reach, for speed only
            m = r["max_relative_position"]
            rows = np.zeros((2 * m - 1, hd), np.float32)
            rows[:m] = t[rp + "rel_k"][0]  # values irrelevant: only the cost is compared
            att.relative_position_keys = rows
            att.relative_position_values = np.zeros_like(rows)
            att.queries_scale = np.dtype("float32").type(scale)
            exact = False
        ffn = layer.ffn
        norm(ffn.layer_norm, p + "ffn_norm")
        if cfg.get("ffn_gated", False):
            lin(ffn.linear_0, p + "ffn.gate")
            lin(ffn.linear_0_noact, p + "ffn.up")
        else:
            lin(ffn.linear_0, p + "ffn.up")
        lin(ffn.linear_1, p + "ffn.down")
    spec.register_vocabulary(vocabulary(cfg))
    spec.config.bos_token = "<s>"
    spec.config.eos_token = "</s>"
    spec.config.unk_token = "<unk>"
    spec.config.layer_norm_epsilon = cfg.get("norm_eps", 1e-5)
    return spec, exact


def convert(model_dir, out_dir, quantization=None):
    cfg, t = load(model_dir)
    spec, exact = build_spec(cfg, t)
    spec.validate()
    spec.optimize(quantization=quantization)
    spec.save(out_dir)
    return cfg, exact


def generator(ct2_dir, threads, compute_type):
    import ctranslate2
    return ctranslate2.Generator(ct2_dir, device="cpu", compute_type=compute_type, intra_threads=threads, inter_threads=1)


def toks(ids):
    return [f"t{i}" for i in ids]


def cmd_check(a):
    """Logits at every position of one sequence against relgen's float64 reference; greedy agreement."""
    import torch
    import relgen_ref

    cfg, t = load(a.model)
    with tempfile.TemporaryDirectory() as d:
        _, exact = convert(a.model, d)
        gen = generator(d, a.threads, "float32")
        vocab = vocabulary(cfg)
        rng = np.random.default_rng(1)
        prompt = [int(x) for x in rng.integers(0, 256, a.prompt)]
        ref = relgen_ref.Reference(cfg, {k: v.astype(np.float64) for k, v in t.items()})
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(a.new):  # the reference's greedy continuation
                seq.append(int(torch.argmax(ref.forward(seq)[-1])))
            want = ref.forward(seq).numpy()
        got = np.array(gen.forward_batch([[vocab[i] for i in seq]]))[0]
        err = np.abs(got - want).max() / np.abs(want).max()
        agree = int((got[len(prompt) - 1:-1].argmax(-1) == np.array(seq[len(prompt):])).sum())
        out = gen.generate_batch([[vocab[i] for i in prompt]], max_length=a.new, sampling_topk=1,
                                 include_prompt_in_result=False, end_token=[])[0].sequences_ids[0]
        first = next((i for i, (x, y) in enumerate(zip(out, seq[len(prompt):])) if x != y), None)
    res = {"scheme": cfg["relative_attention"]["scheme"], "exact_mapping": exact, "max_rel_logit_err": float(err),
           "argmax_agree": f"{agree}/{a.new}", "greedy_equal": first is None and len(out) == a.new,
           "first_divergence": first}
    print(json.dumps(res))
    return 0 if not exact or (err < 1e-4 and res["greedy_equal"]) else 1


def hf_converted(model_dir, quantization):
    """A Hugging Face checkpoint (BLOOM, MPT, ...) through CTranslate2's own converter, once per
    checkpoint and quantization (cached under /tmp: converting bloom-560m takes a minute)."""
    import hashlib
    import ctranslate2
    st = os.stat(os.path.join(model_dir, "model.safetensors"))
    key = hashlib.sha256(f"{os.path.abspath(model_dir)}:{st.st_size}:{st.st_mtime_ns}:{quantization}".encode()).hexdigest()[:16]
    out = os.path.join(tempfile.gettempdir(), f"relgen-ct2-{key}")
    if not os.path.exists(os.path.join(out, "model.bin")):
        print(f"ct2_peer: converting {model_dir} ({quantization or 'float32'}) to {out}", file=sys.stderr)

        class Converter(ctranslate2.converters.TransformersConverter):
            def load_model(self, model_class, path, **kwargs):  # transformers before 4.56 names it torch_dtype
                if "dtype" in kwargs:
                    kwargs["torch_dtype"] = kwargs.pop("dtype")
                return model_class.from_pretrained(path, **kwargs)

        Converter(model_dir).convert(out + ".part", quantization=quantization, force=True)
        os.replace(out + ".part", out)
    return out


def cmd_bench(a):
    cfg = json.load(open(os.path.join(a.model, "config.json")))
    with tempfile.TemporaryDirectory() as d:
        if "model_type" in cfg:  # a Hugging Face checkpoint
            d = hf_converted(a.model, None if a.compute_type == "float32" else a.compute_type)
        else:
            convert(a.model, d, None if a.compute_type == "float32" else a.compute_type)
        gen = generator(d, a.threads, a.compute_type)
        rng = np.random.default_rng(0)
        if "model_type" in cfg:  # token strings of the converted vocabulary
            vocab = json.load(open(os.path.join(d, "vocabulary.json")))
            prompt = [vocab[int(i)] for i in rng.integers(100, 256, a.context)]
        else:
            prompt = toks(rng.integers(0, 256, a.context))

        def run(batch, new):
            t0 = time.perf_counter()
            gen.generate_batch([prompt] * batch, max_length=new, min_length=new, sampling_topk=1,
                               include_prompt_in_result=False, end_token=[])
            return time.perf_counter() - t0

        run(1, 1)  # warm-up: first-call allocations
        prefill_s = run(1, 1)
        batch_prefill_s = run(a.batch, 1)
        decode_s = max(run(a.batch, a.steps + 1) - batch_prefill_s, 1e-9)
    import ctranslate2
    print(json.dumps({"prefill_tokens_per_s": a.context / prefill_s,
                      "batch_prefill_tokens_per_s": a.batch * a.context / batch_prefill_s,
                      "decode_tokens_per_s": a.batch * a.steps / decode_s, "threads": a.threads,
                      "compute_type": a.compute_type, "ctranslate2": ctranslate2.__version__}))
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert")
    c.add_argument("--model", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--quantization", default=None, choices=[None, "int8", "int8_float32", "bfloat16"])
    k = sub.add_parser("check")
    k.add_argument("--model", required=True)
    k.add_argument("--prompt", type=int, default=64)
    k.add_argument("--new", type=int, default=32)
    k.add_argument("--threads", type=int, default=os.cpu_count())
    b = sub.add_parser("bench")
    b.add_argument("--model", required=True)
    b.add_argument("--batch", type=int, default=1)
    b.add_argument("--context", type=int, default=512)
    b.add_argument("--steps", type=int, default=16)
    b.add_argument("--threads", type=int, default=os.cpu_count())
    b.add_argument("--compute_type", default="float32", choices=["float32", "int8", "int8_float32", "bfloat16"])
    a = ap.parse_args()
    if a.cmd == "convert":
        cfg, exact = convert(a.model, a.out, a.quantization)
        print(f"wrote {a.out}: {cfg['relative_attention']['scheme']}, {'exact' if exact else 'speed-only'} mapping")
        return 0
    return cmd_check(a) if a.cmd == "check" else cmd_bench(a)


if __name__ == "__main__":
    sys.exit(main())
