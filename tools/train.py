#!/usr/bin/python3
"""Trains relgen's default model: a small byte-level decoder with Music Transformer (skew) relative
attention, on the text of Debian's `fortunes` package, and exports it in the relgen format.

  /usr/bin/python3 tools/train.py --out models/default [--minutes 40] [--seed 0]

Reproducible: the same seed, corpus and step count give the same weights (single-threaded data
order; torch's CPU kernels are deterministic for these ops). Progress is printed every 25 steps.
The model is the architecture of tools/relgen_ref.py (same tensor names), written as an nn.Module
with the skew in its vectorised form for speed."""
import argparse
import glob
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402

BOS, EOS, PAD = 256, 257, 258
FORTUNE_DIR = "/usr/share/games/fortunes"


def load_corpus(held_out_every=20):
    """Fortunes from every data file, each as BOS + bytes + EOS; every 20th fortune held out."""
    train, held = [], []
    n = 0
    for path in sorted(glob.glob(os.path.join(FORTUNE_DIR, "*"))):
        if path.endswith((".dat", ".u8")) or os.path.isdir(path) or os.path.islink(path):
            continue
        text = open(path, "rb").read()
        for item in text.split(b"\n%\n"):
            item = item.strip()
            if len(item) < 16:
                continue
            ids = [BOS] + list(item) + [EOS]
            (held if n % held_out_every == 0 else train).extend(ids)
            n += 1
    if not train:
        raise SystemExit(f"no fortunes under {FORTUNE_DIR}: apt-get install fortunes")
    return torch.tensor(train, dtype=torch.long), torch.tensor(held, dtype=torch.long), n


def config(args):
    return {
        "format_version": 1, "name": "relgen-default-fortunes", "vocab_size": 259, "d_model": args.d_model,
        "n_layers": args.layers, "n_heads": args.heads, "head_dim": args.d_model // args.heads,
        "ffn_dim": 4 * args.d_model, "ffn_activation": "gelu", "norm": "layernorm", "norm_placement": "pre",
        "norm_eps": 1e-5, "linear_bias": True, "tie_embeddings": True, "max_seq_len": 1024,
        "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD, "tokenizer": {"kind": "byte"},
        "relative_attention": {"scheme": "skew", "max_relative_position": args.window,
                               "heads_share_table": False, "share_across_layers": False, "scale_with_qk": True},
    }


class Layer(nn.Module):
    def __init__(self, d, h, m):
        super().__init__()
        self.h, self.hd = h, d // h
        self.attn_norm, self.ffn_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.rel_k = nn.Parameter(torch.randn(h, m, self.hd) * 0.02)  # row r: distance m-1-r

    def rel_logits(self, q):
        """Skew: S_rel[i, j] = q_i . E[M-1-(i-j)] for i-j < M, else 0 (q: [B, H, L, hd])."""
        B, H, L, _ = q.shape
        M = self.rel_k.shape[1]
        E = self.rel_k[:, max(M - L, 0):]  # distances min(L, M)-1 .. 0
        if L > M:
            E = F.pad(E, (0, 0, L - M, 0))  # farther distances: zero rows
        qe = torch.matmul(q, E.transpose(-1, -2))  # [B, H, L, L]
        padded = F.pad(qe, (1, 0))  # the skew: pad left, reshape, drop the first row
        return padded.reshape(B, H, L + 1, L)[:, :, 1:]

    def forward(self, x, mask):
        B, L, D = x.shape
        h = self.attn_norm(x)
        q, k, v = (lin(h).view(B, L, self.h, self.hd).transpose(1, 2) for lin in (self.q, self.k, self.v))
        logits = (torch.matmul(q, k.transpose(-1, -2)) + self.rel_logits(q)) / math.sqrt(self.hd)
        w = torch.softmax(logits.masked_fill(mask, float("-inf")), dim=-1)
        x = x + self.o(torch.matmul(w, v).transpose(1, 2).reshape(B, L, D))
        return x + self.down(F.gelu(self.up(self.ffn_norm(x))))


class LM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, h, m = cfg["d_model"], cfg["n_heads"], cfg["relative_attention"]["max_relative_position"]
        self.embed = nn.Embedding(cfg["vocab_size"], d)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.layers = nn.ModuleList(Layer(d, h, m) for _ in range(cfg["n_layers"]))
        self.final_norm = nn.LayerNorm(d)

    def forward(self, tokens):
        L = tokens.shape[1]
        mask = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, mask)
        return self.final_norm(x) @ self.embed.weight.T

    @staticmethod
    def load(model_dir):
        """The exported model back as this module (float32 weights as stored, widened)."""
        cfg = json.load(open(os.path.join(model_dir, "config.json")))
        model = LM(cfg)
        t = safetensors_io.load(os.path.join(model_dir, "model.safetensors"))
        state = {}
        for name, value in t.items():
            key = name.replace(".attn.rel_k", ".rel_k").replace(".attn.", ".")
            key = key.replace(".ffn.", ".")
            state[key] = torch.tensor(value.astype("float32"))
        model.load_state_dict(state)
        return cfg, model

    def export(self, cfg, out_dir, dtype="F16"):
        t = {"embed.weight": self.embed.weight, "final_norm.weight": self.final_norm.weight,
             "final_norm.bias": self.final_norm.bias}
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            for name in ("attn_norm", "ffn_norm"):
                t[p + name + ".weight"] = getattr(layer, name).weight
                t[p + name + ".bias"] = getattr(layer, name).bias
            for name in "qkvo":
                t[p + "attn." + name + ".weight"] = getattr(layer, name).weight
                t[p + "attn." + name + ".bias"] = getattr(layer, name).bias
            t[p + "attn.rel_k"] = layer.rel_k
            for name in ("up", "down"):
                t[p + "ffn." + name + ".weight"] = getattr(layer, name).weight
                t[p + "ffn." + name + ".bias"] = getattr(layer, name).bias
        os.makedirs(out_dir, exist_ok=True)
        safetensors_io.save(os.path.join(out_dir, "model.safetensors"),
                            {k: v.detach().float().numpy() for k, v in t.items()}, dtypes={k: dtype for k in t})
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)


def bits_per_byte(model, data, seq, batches=None):
    """Held-out loss in bits per token (= per byte for byte tokens) over non-overlapping windows."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        n = (len(data) - 1) // seq
        for i in range(n if batches is None else min(n, batches)):
            x = data[i * seq:(i + 1) * seq + 1]
            logits = model(x[:-1].unsqueeze(0))
            total += F.cross_entropy(logits[0], x[1:], reduction="sum").item()
            count += seq
    model.train()
    return total / count / math.log(2)


def unigram_bits(train, held):
    counts = torch.bincount(train, minlength=259).double() + 1.0  # add-one smoothing
    logp = torch.log2(counts / counts.sum())
    return -logp[held[1:]].mean().item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models/default")
    ap.add_argument("--minutes", type=float, default=40.0, help="training time budget")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: time budget only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--window", type=int, default=256, help="relative table rows M")
    ap.add_argument("--seq", type=int, default=192)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    train, held, n_fortunes = load_corpus()
    print(f"corpus: {n_fortunes} fortunes, {len(train)} training and {len(held)} held-out bytes", flush=True)
    cfg = config(a)
    model = LM(cfg)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.05)
    gen = torch.Generator().manual_seed(a.seed)
    t0, step = time.time(), 0
    budget = a.minutes * 60
    while True:
        elapsed = time.time() - t0
        if elapsed > budget or (a.max_steps and step >= a.max_steps):
            break
        # Cosine decay over the time budget, after a short warm-up.
        frac = min(elapsed / budget, 1.0) if not a.max_steps else step / a.max_steps
        lr = a.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(train) - a.seq - 1, (a.batch,), generator=gen)
        x = torch.stack([train[s:s + a.seq + 1] for s in starts.tolist()])
        loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, 259), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 25 == 0:
            print(f"step {step}  {elapsed / 60:5.1f} min  loss {loss.item() / math.log(2):.3f} bits/byte  lr {lr:.2e}",
                  flush=True)
    minutes = (time.time() - t0) / 60
    held_bpb = bits_per_byte(model, held, 256)
    uni = unigram_bits(train, held)
    print(f"trained {step} steps in {minutes:.1f} min; held-out {held_bpb:.3f} bits/byte (unigram {uni:.3f})", flush=True)
    model.export(cfg, a.out)
    with open(os.path.join(a.out, "training.json"), "w") as f:
        json.dump({"steps": step, "minutes": round(minutes, 1), "seed": a.seed, "batch": a.batch, "seq": a.seq,
                   "tokens_seen": step * a.batch * a.seq, "held_out_bits_per_byte": round(held_bpb, 4),
                   "unigram_bits_per_byte": round(uni, 4), "parameters": params, "threads": a.threads,
                   "torch": torch.__version__, "command": " ".join(sys.argv)}, f, indent=2)
    print(f"exported {a.out}", flush=True)


if __name__ == "__main__":
    main()
