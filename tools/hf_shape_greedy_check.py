#!/usr/bin/env python3
"""Greedy tokens of relgen-server and transformers on one full-size checkpoint with random weights:
bloom-560m's shape stored in float16, or flan-t5-base's stored in float32, served with the
server's defaults (so in the type auto picks: float32 compute for both). Not run by CI (a 1 GB
checkpoint and a few minutes); the tests run the same comparison on tiny checkpoints.

  build-hf-venv/bin/python tools/hf_shape_greedy_check.py --shape bloom-560m --out DIR [--new 16]

Makes DIR with transformers (its own initialisation, seed 0) unless DIR/config.json exists, runs
transformers' greedy loop (forward with its K/V cache, float32 from the stored weights, as relgen
computes) and relgen-server's Generate (temperature 0, the same prompt ids, with each token's
log-probability), and prints both, the first disagreement if any, the smallest top-1 margin
transformers saw (how close a tie came), and each side's largest log-probability error against
transformers in float64 on relgen's tokens (teacher-forced): relgen's should be of the size of
transformers' own float32 error, which says how well conditioned the random model is.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import torch
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = [5, 17, 101, 43, 250, 7, 99, 12]


def make(shape, out):
    cfg = json.load(open(os.path.join(ROOT, "tools", "bench", "shapes", shape + ".json")))
    dtype = torch.float16 if cfg["model_type"] == "bloom" else torch.float32
    cfg["torch_dtype"] = "float16" if dtype == torch.float16 else "float32"
    os.makedirs(out, exist_ok=True)
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    config = transformers.AutoConfig.from_pretrained(out)
    torch.manual_seed(0)
    cls = transformers.T5ForConditionalGeneration if cfg["model_type"] == "t5" else transformers.AutoModelForCausalLM
    m = cls.from_config(config) if cls is transformers.AutoModelForCausalLM else cls(config)
    m.to(dtype).save_pretrained(out, safe_serialization=True)
    fixtures = os.path.join(ROOT, "build")
    if cfg["model_type"] == "t5":
        shutil.copy(os.path.join(fixtures, "t5_checkpoints", "t5-v1_1", "spiece.model"), out)
    else:
        shutil.copy(os.path.join(fixtures, "hf_checkpoints", "bloom-h3", "tokenizer.json"), out)


def reference(out, new):
    cfg = json.load(open(os.path.join(out, "config.json")))
    t5 = cfg["model_type"] == "t5"
    cls = transformers.T5ForConditionalGeneration if t5 else transformers.AutoModelForCausalLM
    m = cls.from_pretrained(out, torch_dtype=torch.float32).eval()
    ids, margins = [], []
    with torch.no_grad():
        if t5:
            enc = m.get_encoder()(input_ids=torch.tensor([PROMPT]))
            tok, past = torch.tensor([[cfg.get("decoder_start_token_id", 0)]]), None
            for _ in range(new):
                o = m(encoder_outputs=enc, decoder_input_ids=tok, past_key_values=past, use_cache=True)
                past, logits = o.past_key_values, o.logits[0, -1]
                top = torch.topk(logits, 2)
                margins.append(float(top.values[0] - top.values[1]))
                ids.append(int(top.indices[0]))
                tok = top.indices[:1].view(1, 1)
        else:
            o = m(input_ids=torch.tensor([PROMPT]), use_cache=True)
            for _ in range(new):
                logits = o.logits[0, -1]
                top = torch.topk(logits, 2)
                margins.append(float(top.values[0] - top.values[1]))
                ids.append(int(top.indices[0]))
                o = m(input_ids=top.indices[:1].view(1, 1), past_key_values=o.past_key_values, use_cache=True)
    return ids, margins


def float64_logprobs(out, tokens):
    """Each token's log-probability from one teacher-forced forward, in float64 and in float32."""
    cfg = json.load(open(os.path.join(out, "config.json")))
    t5 = cfg["model_type"] == "t5"
    cls = transformers.T5ForConditionalGeneration if t5 else transformers.AutoModelForCausalLM
    got = {}
    for dt in (torch.float64, torch.float32):
        m = cls.from_pretrained(out, torch_dtype=torch.float32).to(dt).eval()
        with torch.no_grad():
            if t5:
                start = cfg.get("decoder_start_token_id", 0)
                logits = m(input_ids=torch.tensor([PROMPT]), decoder_input_ids=torch.tensor([[start] + tokens[:-1]])).logits[0]
            else:
                logits = m(input_ids=torch.tensor([PROMPT + tokens[:-1]])).logits[0, len(PROMPT) - 1:]
        ls = torch.log_softmax(logits.double(), -1)
        got[dt] = [float(ls[i, t]) for i, t in enumerate(tokens)]
        del m
    return got[torch.float64], got[torch.float32]


def relgen(out, new):
    server = os.path.join(ROOT, "build", "server", "relgen-server")
    client = os.path.join(ROOT, "build", "client", "relgen-client")
    port = 20000 + os.getpid() % 20000
    t0 = time.time()
    p = subprocess.Popen([server, "--model", out, "--listen", f"127.0.0.1:{port}", "--metrics_listen", "127.0.0.1:0", "--http_listen", "127.0.0.1:0",
                          "--kv_cache_tokens", "4096"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = ""
        while "gRPC on" not in line:
            line = p.stdout.readline()
            if not line:
                raise SystemExit("relgen-server exited before serving")
        start = time.time() - t0
        print(line.strip())
        r = subprocess.run([client, "generate", "--server", f"127.0.0.1:{port}", "--json", "--temperature", "0",
                            "--ignore_eos", "--logprobs", "0", "--max_new_tokens", str(new), "--token_ids",
                            ",".join(map(str, PROMPT))], capture_output=True, text=True, check=True)
        reply = json.loads(r.stdout)
        return reply["token_ids"], [e["logprob"] for e in reply["logprobs"]], start
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", required=True, choices=["bloom-560m", "flan-t5-base"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--new", type=int, default=16)
    a = ap.parse_args()
    torch.set_num_threads(os.cpu_count())
    if not os.path.exists(os.path.join(a.out, "config.json")):
        make(a.shape, a.out)
    want, margins = reference(a.out, a.new)
    got, logprobs, start = relgen(a.out, a.new)
    first = next((i for i, (x, y) in enumerate(zip(want, got)) if x != y), None)
    f64, f32 = float64_logprobs(a.out, got)
    print(json.dumps({"shape": a.shape, "transformers": want, "relgen": got, "equal": want == got,
                      "first_difference": first, "smallest_top1_margin": min(margins),
                      "relgen_logprob_error_vs_float64": max(abs(x - y) for x, y in zip(logprobs, f64)),
                      "transformers_f32_logprob_error_vs_float64": max(abs(x - y) for x, y in zip(f32, f64)),
                      "start_to_serving_s": round(start, 1), "transformers_version": transformers.__version__}))
    sys.exit(0 if want == got else 1)


if __name__ == "__main__":
    main()
