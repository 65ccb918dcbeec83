#!/usr/bin/env python3
"""Many LoRA adapters on one T5 against the base alone: relgen-server's output throughput when 16
concurrent clients spread their requests over 8 adapters of rank 16, and when the same clients run
the base model, on one server, interleaved.

  build-hf-venv/bin/python tools/bench/lora_bench.py --work /tmp/lora-bench
      [--server build/server/relgen-server] [--adapters 8] [--rank 16] [--targets q,v|all] [--clients 16]
      [--requests 32] [--input_len 128] [--new 64] [--threads 2] [--reps 3] [--json FILE]

The checkpoint is tools/bench/t5_bench.py's flan-t5-base shape (d_model 768, 12 + 12 layers, gated
FFN of 2048, seeded random weights, float32), written once under --work. The adapters are written
here in PEFT's format (adapter_config.json + adapter_model.safetensors, keys
base_model.model.<module>.lora_A/B.weight): rank --rank, lora_alpha 2 x rank, the modules of
--targets: `q,v` (PEFT's default for T5: self- and cross-attention q and v of both stacks) or `all`
(every module relgen adapts: q, k, v, o of self- and cross-attention, wi_0, wi_1, wo). A and B are
seeded N(0, 0.02), one seed each; their values do not change the arithmetic's cost.

Workload per timed run: --clients threads, each sending --requests / --clients requests one after
another over gRPC: an input of --input_len random ids (seeded, different per request), greedy,
exactly --new tokens (ignore_eos). "lora": client i's requests name adapter i mod --adapters; "base":
none. Throughput = clients' generated tokens / wall time of the run. One untimed warm-up run of each
mode, then --reps repetitions of base, lora (interleaved). The server runs with --max_loras
--adapters (every adapter resident). Memory: the server's resident set after the runs, and what 8
servers of merged weights (one per adapter) would hold instead.
"""
import argparse
import concurrent.futures
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
from safetensors.numpy import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests"))
import t5_bench  # noqa: E402
from openai_api_test import Server, relgen_client  # noqa: E402


def write_adapter(path, cfg, rank, seed, targets):
    """A PEFT LoRA adapter of `targets` (module names: q, k, v, o, wi_0, wi_1, wo), N(0, 0.02) values."""
    rng = np.random.default_rng(seed)
    d, inner, ff = cfg.d_model, cfg.num_heads * cfg.d_kv, cfg.d_ff
    tensors = {}

    def add(module, n_in, n_out):
        if module.rsplit(".", 1)[1] not in targets:
            return
        tensors[f"base_model.model.{module}.lora_A.weight"] = rng.normal(0, 0.02, (rank, n_in)).astype(np.float32)
        tensors[f"base_model.model.{module}.lora_B.weight"] = rng.normal(0, 0.02, (n_out, rank)).astype(np.float32)

    for stack, layers in (("encoder", cfg.num_layers), ("decoder", cfg.num_decoder_layers)):
        for l in range(layers):
            p = f"{stack}.block.{l}.layer."
            for m in "qkv":
                add(f"{p}0.SelfAttention.{m}", d, inner)
            add(f"{p}0.SelfAttention.o", inner, d)
            ffn = "1" if stack == "encoder" else "2"
            if stack == "decoder":
                for m in "qkv":
                    add(f"{p}1.EncDecAttention.{m}", d, inner)
                add(f"{p}1.EncDecAttention.o", inner, d)
            add(f"{p}{ffn}.DenseReluDense.wi_0", d, ff)
            add(f"{p}{ffn}.DenseReluDense.wi_1", d, ff)
            add(f"{p}{ffn}.DenseReluDense.wo", ff, d)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none", "use_rslora": False,
                   "target_modules": sorted(targets), "modules_to_save": None}, f)
    return sum(t.nbytes for t in tensors.values())


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--server", default="build/server/relgen-server")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="q,v", help="modules adapted: q,v (PEFT's default for T5) or all")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--input_len", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()

    ckpt = os.path.join(args.work, "flan-t5-base-shape")
    t5_bench.make_checkpoint(ckpt, small=False, seed=0)
    cfg = t5_bench.t5_config(False)
    targets = ["q", "k", "v", "o", "wi_0", "wi_1", "wo"] if args.targets == "all" else args.targets.split(",")
    adapter_bytes = 0
    modules = []
    for i in range(args.adapters):
        path = os.path.join(args.work, f"adapter-r{args.rank}-{args.targets.replace(',', '')}-{i}")
        adapter_bytes += write_adapter(path, cfg, args.rank, 100 + i, targets)
        modules.append(f"a{i}={path}")
    os.environ["RELGEN_SERVER_BIN"] = os.path.abspath(args.server)
    server = Server("--lora_modules", ",".join(modules), "--max_loras", str(args.adapters), "--max_lora_rank",
                    str(args.rank), "--threads", str(args.threads), "--max_num_seqs", str(args.clients), model=ckpt)
    rng = np.random.default_rng(1)
    per_client = args.requests // args.clients
    inputs = [[rng.integers(3, 32000, args.input_len).tolist() for _ in range(per_client)] for _ in range(args.clients)]
    clients = [relgen_client.Client(server.grpc, timeout=3600) for _ in range(args.clients)]

    def run(mode):
        def client(i):
            adapter = f"a{i % args.adapters}" if mode == "lora" else ""
            n = 0
            for prompt in inputs[i]:
                r = clients[i].generate(prompt, temperature=0, max_new_tokens=args.new, ignore_eos=True, adapter=adapter)
                n += len(r.token_ids)
            return n
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            tokens = sum(pool.map(client, range(args.clients)))
        return tokens / (time.monotonic() - start)

    results = {"base": [], "lora": []}
    try:
        run("base")
        run("lora")
        for rep in range(args.reps):
            for mode in ("base", "lora"):
                results[mode].append(run(mode))
                print(f"rep {rep} {mode}: {results[mode][-1]:.1f} tokens/s", flush=True)
        rss = rss_bytes(server.proc.pid)
    finally:
        for c in clients:
            c.close()
        server.stop()
    weights = os.path.getsize(os.path.join(ckpt, "model.safetensors"))
    out = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "args": vars(args),
        "tokens_per_s": {m: {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": v}
                         for m, v in results.items()},
        "ratio_lora_over_base": statistics.median(results["lora"]) / statistics.median(results["base"]),
        "server_rss_bytes": rss,
        "adapter_bytes_total": adapter_bytes,
        "checkpoint_bytes": weights,
        "merged_servers_weight_bytes": weights * args.adapters,
    }
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
