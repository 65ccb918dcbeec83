#!/usr/bin/python3
"""Trains a small decoder on Bach's chorales (tools/chorales.py's grid) with one of four position
schemes, the comparison of Music Transformer's JSB table, and exports the relative ones in the
relgen format.

  python tools/chorales.py build --out /tmp/chorales
  /usr/bin/python3 tools/train_chorales.py --data /tmp/chorales --attention skew|skew_local|shaw|absolute \\
      --out models/chorales [--max-steps N] [--minutes 30] [--seed 0]

  absolute  sinusoidal positions added to the embeddings (the paper's baseline "with timing signal")
  shaw      Shaw et al.'s relative keys, distances clipped at --clip (a table of 2 clip + 1 rows)
  skew      Music Transformer's relative keys with the skew, global, --window rows (distances
            0..window-1; farther ones add nothing)
  skew_local  the same keys, Music Transformer's local attention: a query sees its own block of
            --block tokens and the one before (blocks counted from the chorale's BOS; from a
            training crop's start, which falls anywhere in a chorale)

Trained on crops of --seq tokens, a model is scored on whole chorales of up to 3522 tokens. Global
attention then meets keys farther than any it was trained on: with --window as long as the crop, a
skew model never saw a key without a relative term; give it a shorter window (or clip Shaw's) so that
it did. Local attention never sees more than 2 --block - 1 keys, crop or chorale.

--holds repeat trains on the paper's JSB serialization instead (a long note is its pitch repeated every
sixteenth, no H), for comparing NLLs with its table; such a model is not exported (MIDI out needs H).

Same size, steps, data order and seed for each. A training step takes a batch of chorales, each
transposed by a random shift of -5..+6 semitones that keeps it in the vocabulary's range and cropped
to --seq tokens at a random start (chorales are 386-3522 tokens, median 770); loss on every token
but padding. Evaluation: NLL per token (nats) over whole untransposed chorales of the validation and
test splits, each from its BOS, every token after the BOS predicted (EOS included), as relgen's Score
computes it.

Reproducible: the same seed, data and step count give the same weights (torch's CPU kernels are
deterministic for these ops; one data order). Progress every 25 steps."""
import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import chorales  # noqa: E402
import train  # noqa: E402

PAD, BOS, EOS = chorales.IDS["PAD"], chorales.IDS["BOS"], chorales.IDS["EOS"]
VOCAB = len(chorales.VOCAB)


def load_split(data, part):
    """[(name, grid)] of one split."""
    return [(j["name"], j["grid"]) for j in map(json.loads, open(os.path.join(data, f"{part}.jsonl")))]


HOLDS = "hold"  # --holds


def repeated(grid):
    """The grid with each H replaced by the pitch that sounds (the paper's JSB serialization, where a
    long note is its pitch repeated every sixteenth and a held note cannot be told from a re-struck
    one)."""
    out, last = [], ["R"] * 4
    for step in grid:
        row = []
        for v, t in enumerate(step):
            if t == chorales.HOLD:
                t = last[v]
            row.append(t)
            last[v] = t
        out.append(row)
    return out


def ids_of(grid):
    return [chorales.IDS[t] for t in chorales.tokens_of_grid(repeated(grid) if HOLDS == "repeat" else grid)]


def sinusoid(L, d):
    pos = torch.arange(L, dtype=torch.float32).unsqueeze(1)
    div = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    pe = torch.zeros(L, d)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe


class Layer(nn.Module):
    def __init__(self, d, h, attention, rows):
        super().__init__()
        self.h, self.hd, self.attention = h, d // h, attention
        self.attn_norm, self.ffn_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        # skew: row r is distance rows-1-r; shaw: row r is relative position r - clip (j - i)
        self.rel_k = nn.Parameter(torch.randn(h, rows, self.hd) * 0.02) if attention != "absolute" else None

    def rel_logits(self, q):
        B, H, L, _ = q.shape
        if self.attention in ("skew", "skew_local"):
            M = self.rel_k.shape[1]
            E = self.rel_k[:, max(M - L, 0):]
            if L > M:
                E = F.pad(E, (0, 0, L - M, 0))
            qe = torch.matmul(q, E.transpose(-1, -2))  # [B, H, L, L]: column c is distance L-1-c
            padded = F.pad(qe, (1, 0))
            return padded.reshape(B, H, L + 1, L)[:, :, 1:]
        clip = (self.rel_k.shape[1] - 1) // 2
        i = torch.arange(L).unsqueeze(1)
        j = torch.arange(L).unsqueeze(0)
        idx = torch.clamp(j - i, -clip, clip) + clip  # [L, L]
        qe = torch.matmul(q, self.rel_k.transpose(-1, -2))  # [B, H, L, 2 clip + 1]
        return torch.gather(qe, 3, idx.expand(B, H, L, L))

    def forward(self, x, mask):
        B, L, D = x.shape
        h = self.attn_norm(x)
        q, k, v = (lin(h).view(B, L, self.h, self.hd).transpose(1, 2) for lin in (self.q, self.k, self.v))
        logits = torch.matmul(q, k.transpose(-1, -2))
        if self.rel_k is not None:
            logits = logits + self.rel_logits(q)
        w = torch.softmax((logits / math.sqrt(self.hd)).masked_fill(mask, float("-inf")), dim=-1)
        x = x + self.o(torch.matmul(w, v).transpose(1, 2).reshape(B, L, D))
        return x + self.down(F.gelu(self.up(self.ffn_norm(x))))


class LM(nn.Module):
    def __init__(self, a):
        super().__init__()
        d = a.d_model
        self.attention = a.attention
        rows = a.window if a.attention in ("skew", "skew_local") else 2 * a.clip + 1
        self.embed = nn.Embedding(VOCAB, d)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.layers = nn.ModuleList(Layer(d, a.heads, a.attention, rows) for _ in range(a.layers))
        self.final_norm = nn.LayerNorm(d)
        self.d = d
        self.block = a.block

    def forward(self, tokens):
        L = tokens.shape[1]
        mask = torch.triu(torch.ones(L, L, dtype=torch.bool), diagonal=1)
        if self.attention == "skew_local":  # keys before the previous block are out of sight
            i = torch.arange(L).unsqueeze(1)
            mask = mask | (torch.arange(L).unsqueeze(0) < torch.clamp(i // self.block - 1, min=0) * self.block)
        x = self.embed(tokens)
        if self.attention == "absolute":
            x = x + sinusoid(L, self.d)
        for layer in self.layers:
            x = layer(x, mask)
        return self.final_norm(x) @ self.embed.weight.T

    def export(self, a, out_dir, max_seq_len, dtype="F32"):
        """relgen's format (the tensor names of tools/train.py); relative schemes only."""
        rel = ({"scheme": "skew", "max_relative_position": a.window} if a.attention == "skew"
               else {"scheme": "skew_local", "max_relative_position": a.window, "block_length": a.block}
               if a.attention == "skew_local" else {"scheme": "shaw", "clip": a.clip, "relative_values": False})
        rel.update({"heads_share_table": False, "share_across_layers": False, "scale_with_qk": True})
        cfg = {
            "format_version": 1, "name": f"relgen-chorales-{a.attention}", "vocab_size": VOCAB,
            "d_model": a.d_model, "n_layers": a.layers, "n_heads": a.heads, "head_dim": a.d_model // a.heads,
            "ffn_dim": 4 * a.d_model, "ffn_activation": "gelu", "norm": "layernorm", "norm_placement": "pre",
            "norm_eps": 1e-5, "linear_bias": True, "tie_embeddings": True, "max_seq_len": max_seq_len,
            "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD,
            "tokenizer": {"kind": "word", "file": "vocab.txt"}, "relative_attention": rel,
        }
        # The same modules and tensor names as tools/train.py's decoder: its export writes them.
        train.LM.export(self, cfg, out_dir, dtype=dtype)
        with open(os.path.join(out_dir, "vocab.txt"), "w") as f:
            f.write("\n".join(chorales.VOCAB) + "\n")


def nll(model, items):
    """Mean NLL per predicted token (nats) over whole chorales, and the per-chorale means."""
    model.eval()
    total, count, per = 0.0, 0, {}
    with torch.no_grad():
        for name, grid in items:
            x = torch.tensor(ids_of(grid))
            logits = model(x[:-1].unsqueeze(0))[0]
            s = F.cross_entropy(logits, x[1:], reduction="sum").item()
            total += s
            count += len(x) - 1
            per[name] = s / (len(x) - 1)
    model.train()
    return total / count, per


def batch_of(train, a, rng):
    rows = []
    for _ in range(a.batch):
        _, grid = train[rng.randrange(len(train))]
        shifts = [s for s in chorales.SHIFTS if chorales.fits(grid, s)]
        ids = ids_of(chorales.transpose(grid, rng.choice(shifts)))
        if len(ids) > a.seq + 1:
            start = rng.randrange(len(ids) - a.seq)
            ids = ids[start:start + a.seq + 1]
        rows.append(ids + [PAD] * (a.seq + 1 - len(ids)))
    return torch.tensor(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="tools/chorales.py build's folder")
    ap.add_argument("--attention", choices=("absolute", "shaw", "skew", "skew_local"), required=True)
    ap.add_argument("--out", default="", help="export here (relative schemes; absolute writes training.json only)")
    ap.add_argument("--minutes", type=float, default=30.0, help="training time cap")
    ap.add_argument("--max-steps", type=int, default=0, help="the step count (0: the time cap only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--window", type=int, default=512, help="skew, skew_local: relative table rows")
    ap.add_argument("--block", type=int, default=128, help="skew_local: block length")
    ap.add_argument("--clip", type=int, default=64, help="shaw: clipping distance")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--holds", choices=("hold", "repeat"), default="hold",
                    help="hold: H continues a note (relgen's grid, what MIDI out needs); repeat: the pitch again, "
                         "as the paper's JSB data (for its NLL table only: no export)")
    a = ap.parse_args()
    global HOLDS
    HOLDS = a.holds
    torch.manual_seed(a.seed)
    torch.set_num_threads(a.threads)
    train, val, test = (load_split(a.data, p) for p in ("train", "validation", "test"))
    print(f"chorales: {len(train)} train, {len(val)} validation, {len(test)} test", flush=True)
    model = LM(a)
    params = sum(p.numel() for p in model.parameters())
    print(f"model ({a.attention}): {params / 1e6:.2f}M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.98), weight_decay=0.05)
    rng = random.Random(a.seed)
    t0, step = time.time(), 0
    budget = a.minutes * 60
    while True:
        elapsed = time.time() - t0
        if elapsed > budget or (a.max_steps and step >= a.max_steps):
            break
        frac = step / a.max_steps if a.max_steps else min(elapsed / budget, 1.0)
        lr = a.lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch_of(train, a, rng)
        loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, VOCAB), x[:, 1:].reshape(-1), ignore_index=PAD)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 25 == 0:
            print(f"step {step}  {elapsed / 60:5.1f} min  loss {loss.item():.4f} nats/token  lr {lr:.2e}", flush=True)
    minutes = (time.time() - t0) / 60
    v, _ = nll(model, val)
    t, per_test = nll(model, test)
    print(f"{a.attention}: {step} steps in {minutes:.1f} min; NLL/token validation {v:.4f}, test {t:.4f}", flush=True)
    out = a.out or os.path.join(a.data, f"run-{a.attention}")
    if a.attention != "absolute" and a.holds == "hold":
        longest = max(len(ids_of(g)) for _, g in train + val + test)
        model.export(a, out, max_seq_len=max(2048, 1 << (longest - 1).bit_length()))
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "training.json"), "w") as f:
        json.dump({"attention": a.attention, "holds": a.holds, "steps": step, "minutes": round(minutes, 1), "seed": a.seed,
                   "batch": a.batch, "seq": a.seq, "d_model": a.d_model, "layers": a.layers, "heads": a.heads,
                   "window": a.window, "block": a.block, "clip": a.clip, "lr": a.lr, "parameters": params, "threads": a.threads,
                   "validation_nll_per_token": round(v, 5), "test_nll_per_token": round(t, 5),
                   "test_nll_per_chorale": {k: round(x, 6) for k, x in sorted(per_test.items())},
                   "torch": torch.__version__, "command": " ".join(sys.argv)}, f, indent=1)
        f.write("\n")
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
