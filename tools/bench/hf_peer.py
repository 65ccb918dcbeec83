#!/usr/bin/env python3
"""Real-shape Hugging Face checkpoints with random weights, and transformers' own generate on them:
the GPU peer of `relgen-bench engine --device cuda` (tools/gpu_check.sh: make_<shape>, hf_<shape>).

  python3 tools/bench/hf_peer.py make --config tools/bench/shapes/mpt-7b.json --out DIR [--dtype bf16]
  python3 tools/bench/hf_peer.py bench --model DIR --batches 1,8,64 --context 512 --steps 16 [--json F]

`make` builds the model from the config on the device (random weights from transformers' own
initialisation, in --dtype), saves it as save_pretrained does (sharded safetensors), then puts the
config back as written by the transformers that made tools/bench/shapes (every key one relgen knows).
Where that config says the head is untied (T5's `tie_word_embeddings: false`) and save_pretrained
left `lm_head.weight` out (transformers 5.17 did), the head the model computes with is added.
tools/bench/shapes/tiny/ holds the same families at toy widths (gpu_check.sh's dry run).
`bench` times generate() (greedy, sdpa where the family has it, static cache where it has one) per
batch: one sequence's prefill, the whole batch's prefill (max_new_tokens=1) and the decode steps
(the difference to max_new_tokens=1+steps), synchronized, best of --reps after a warm-up.
"""
import argparse
import contextlib
import json
import os
import time

import safetensors
import safetensors.torch
import torch
import transformers

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def auto_class(cfg):
    if cfg.get("is_encoder_decoder") or cfg.get("model_type") == "t5":
        return transformers.AutoModelForSeq2SeqLM
    return transformers.AutoModelForCausalLM


def load(path, dtype, device, attn):
    cfg = json.load(open(os.path.join(path, "config.json")))
    kw = {"attn_implementation": attn} if attn else {}
    try:
        m = auto_class(cfg).from_pretrained(path, dtype=dtype, **kw)
    except TypeError:  # transformers 4.x names it torch_dtype
        m = auto_class(cfg).from_pretrained(path, torch_dtype=dtype, **kw)
    return m.to(device).eval(), cfg


def make(a):
    os.makedirs(a.out, exist_ok=True)
    ours = json.load(open(a.config))
    ours["torch_dtype"] = NAMES[a.dtype]
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(ours, f, indent=2)
    config = transformers.AutoConfig.from_pretrained(a.out)
    t0 = time.perf_counter()
    torch.manual_seed(a.seed)
    # Made on the device where torch can (2.x): a 7B model initialises in seconds there.
    where = torch.device(a.device) if hasattr(torch.device, "__enter__") else contextlib.nullcontext()
    with where:
        try:
            m = auto_class(ours).from_config(config, dtype=DTYPES[a.dtype])
        except TypeError:
            m = auto_class(ours).from_config(config, torch_dtype=DTYPES[a.dtype])
    n = sum(p.numel() for p in m.parameters())
    m.save_pretrained(a.out, max_shard_size=a.max_shard_size, safe_serialization=True)
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(ours, f, indent=2)
    added = add_untied_head(m, a.out, ours)
    size = sum(os.path.getsize(os.path.join(a.out, f)) for f in os.listdir(a.out))
    print(json.dumps({"model": a.out, "parameters": n, "bytes": size, "seconds": time.perf_counter() - t0,
                      "transformers": transformers.__version__, "added": added}))


def saved_keys(out):
    index = os.path.join(out, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return set(json.load(f)["weight_map"])
    with safetensors.safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        return set(f.keys())


def add_untied_head(m, out, ours):
    """The output projection's weight where the config says untied and the checkpoint lacks it: relgen
    refuses an untied checkpoint without its head, and transformers would draw a fresh one at load."""
    if ours.get("tie_word_embeddings", True) is not False:
        return []
    head = m.get_output_embeddings()
    name = next((n for n, mod in m.named_modules() if mod is head), None)
    if head is None or name is None:
        return []
    key = name + ".weight"
    if key in saved_keys(out):
        return []
    # A copy: where transformers tied the two anyway, the weight is the embedding's storage, which
    # safetensors will not save twice in one file.
    w = head.weight.detach().to("cpu").clone().contiguous()
    index = os.path.join(out, "model.safetensors.index.json")
    if os.path.exists(index):
        shard = "model-untied-head.safetensors"
        safetensors.torch.save_file({key: w}, os.path.join(out, shard), metadata={"format": "pt"})
        with open(index) as f:
            idx = json.load(f)
        idx["weight_map"][key] = shard
        idx.setdefault("metadata", {})
        idx["metadata"]["total_size"] = idx["metadata"].get("total_size", 0) + w.numel() * w.element_size()
        with open(index, "w") as f:
            json.dump(idx, f, indent=2)
    else:
        single = os.path.join(out, "model.safetensors")
        tensors = safetensors.torch.load_file(single)
        tensors[key] = w
        safetensors.torch.save_file(tensors, single, metadata={"format": "pt"})
    if key not in saved_keys(out):
        raise SystemExit(f"hf_peer: {key} is still missing from {out}")
    return [key]


def without_fsdp():
    """transformers 4.46's generate asks whether FSDP manages the model by importing torch's FSDP, which
    Debian's torch 1.13 cannot import under Python 3.11; nothing here is sharded, so the answer is no."""
    try:
        import torch.distributed.fsdp  # noqa: F401
    except Exception:
        gen = getattr(transformers.generation, "utils", None)
        if gen is not None and hasattr(gen, "is_fsdp_managed_module"):
            gen.is_fsdp_managed_module = lambda module: False


def bench(a):
    without_fsdp()
    dev = a.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev != "cpu" else (lambda: None)
    m, cfg = None, None
    attn = None
    for attn in ("sdpa", None):
        try:
            m, cfg = load(a.model, DTYPES[a.dtype], dev, attn)
            break
        except (ValueError, ImportError):
            continue
    vocab = cfg["vocab_size"]
    pad = cfg.get("pad_token_id")
    pad = 0 if pad is None else pad
    cache = "static"
    results = []
    g = torch.Generator().manual_seed(0)

    def gen(ids, new):
        nonlocal cache
        # use_cache: some configs (mpt-7b's) say false, which makes generate recompute the prefix.
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad, use_cache=True,
                  attention_mask=torch.ones_like(ids))
        if cache:
            try:
                return m.generate(ids, cache_implementation=cache, **kw)
            except Exception as e:  # a family without a static cache: transformers' default cache
                print(f"hf_peer: static cache refused ({type(e).__name__}: {str(e)[:120]}); default cache")
                cache = None
        return m.generate(ids, **kw)

    def timed(ids, new):
        sync()
        t = time.perf_counter()
        with torch.inference_mode():
            gen(ids, new)
        sync()
        return time.perf_counter() - t

    for b in a.batches:
        ids = torch.randint(5, vocab - 1, (b, a.context), generator=g).to(dev)
        try:
            timed(ids[:1], 2)  # warm-up (cuBLAS, allocator, the static cache's first shapes)
            timed(ids, 1 + a.steps)
            one = min(timed(ids[:1], 1) for _ in range(a.reps))
            pre = min(timed(ids, 1) for _ in range(a.reps))
            full = min(timed(ids, 1 + a.steps) for _ in range(a.reps))
        except Exception as e:  # one batch's failure (memory, say) leaves the others' figures
            print(json.dumps({"batch": b, "error": f"{type(e).__name__}: {str(e)[:300]}"}), flush=True)
            continue
        row = {"batch": b, "context": a.context, "steps": a.steps, "prefill_tokens_per_s": a.context / one,
               "batch_prefill_tokens_per_s": b * a.context / pre,
               "decode_tokens_per_s": b * a.steps / max(full - pre, 1e-9), "decode_step_ms": 1e3 * (full - pre) / a.steps}
        results.append(row)
        print(json.dumps(row), flush=True)
    out = {"model": a.model, "dtype": a.dtype, "attn_implementation": attn or "default", "cache": cache or "default",
           "device": torch.cuda.get_device_name(dev) if dev != "cpu" else "cpu", "torch": torch.__version__,
           "transformers": transformers.__version__, "reps": a.reps, "results": results}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)
    print(json.dumps({k: v for k, v in out.items() if k != "results"}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make")
    mk.add_argument("--config", required=True)
    mk.add_argument("--out", required=True)
    mk.add_argument("--dtype", default="bf16", choices=DTYPES)
    mk.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--max_shard_size", default="5GB")
    b = sub.add_parser("bench")
    b.add_argument("--model", required=True)
    b.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 64])
    b.add_argument("--context", type=int, default=512)
    b.add_argument("--steps", type=int, default=16)
    b.add_argument("--reps", type=int, default=2)
    b.add_argument("--dtype", default="bf16", choices=DTYPES)
    b.add_argument("--device", default="cuda")
    b.add_argument("--json")
    a = ap.parse_args()
    make(a) if a.cmd == "make" else bench(a)


if __name__ == "__main__":
    main()
