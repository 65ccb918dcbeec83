#!/usr/bin/python3
"""PyTorch side of `relgen-bench engine`: the same model (same weights, float32) run eagerly with a
KV cache, as a PyTorch user would write it, timed the same way. Prints one JSON object.

  /usr/bin/python3 tools/torch_bench.py --model DIR --batch B --context C --steps N --threads T [--device cuda]

Prefill: one sequence of C tokens (relative logits via the skew, vectorised). Decode: B sequences
at position C, N steps, each with the relative term computed for the step only."""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import relgen_ref  # noqa: E402
import safetensors_io  # noqa: E402


class CachedDecoder:
    def __init__(self, cfg, tensors, max_len, batch, device="cpu"):
        self.cfg = cfg
        self.dev = device
        self.t = {k: torch.tensor(v, dtype=torch.float32, device=device) for k, v in tensors.items()}
        self.h, self.hd = cfg["n_heads"], cfg["head_dim"]
        self.r = cfg["relative_attention"]
        self.scheme = self.r["scheme"]
        if self.scheme == "skew_local":
            raise SystemExit("torch_bench: skew_local is not implemented here")
        self.shared = self.r.get("share_across_layers", self.scheme == "t5")
        self.scale = cfg.get("attention_scale") or 1.0 / math.sqrt(self.hd)
        self.scale_rel = self.r.get("scale_with_qk", True)
        L, W = cfg["n_layers"], self.h * self.hd
        self.k = torch.zeros(L, batch, self.h, max_len, self.hd, device=device)
        self.v = torch.zeros(L, batch, self.h, max_len, self.hd, device=device)
        if self.scheme == "t5":
            nb, md, bi = self.r.get("num_buckets", 32), self.r.get("max_distance", 128), self.r.get("bidirectional", False)
            self.bucket = torch.tensor([relgen_ref.t5_bucket(-d, nb, md, bi) for d in range(max_len)], device=device)
        if self.scheme == "alibi":
            self.slopes = torch.tensor(relgen_ref.alibi_slopes(self.h), device=device).view(1, self.h, 1, 1)

    def table(self, layer, name):
        p = "attn." if self.shared else f"layers.{layer}.attn."
        t = self.t[p + name]
        return t if t.shape[0] == self.h else t.expand(self.h, *t.shape[1:])

    def norm(self, x, p):
        w = self.t[p + ".weight"]
        if self.cfg.get("norm", "layernorm") == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), w, self.t[p + ".bias"], self.cfg.get("norm_eps", 1e-5))
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.get("norm_eps", 1e-5)) * w

    def lin(self, x, p):
        return F.linear(x, self.t[p + ".weight"], self.t.get(p + ".bias"))

    def rel(self, layer, q, qpos, kpos):
        """Relative term [B, H, Lq, Lk] for queries at qpos (1-D) against keys at kpos (1-D)."""
        dist = qpos.view(-1, 1) - kpos.view(1, -1)  # i - j
        if self.scheme == "skew":
            E = self.table(layer, "rel_k")  # [H, M, hd]
            M = E.shape[1]
            nd = min(M, int(dist.max()) + 1)
            qe = torch.matmul(q, E[:, M - nd:].flip(1).transpose(-1, -2))  # [B, H, Lq, nd], column d = distance d
            idx = dist.clamp(0, nd - 1).expand(q.shape[0], self.h, -1, -1)
            out = torch.gather(qe, -1, idx)
            return out.masked_fill((dist >= nd) | (dist < 0), 0.0)
        if self.scheme == "shaw":
            k = self.r["clip"]
            R = self.table(layer, "rel_k")[:, : k + 1]  # causal rows 0..k
            qr = torch.matmul(q, R.transpose(-1, -2))
            idx = ((-dist).clamp(-k, 0) + k).expand(q.shape[0], self.h, -1, -1)
            return torch.gather(qr, -1, idx)
        if self.scheme == "t5":
            b = self.bucket[dist.clamp(min=0)]
            return self.table(layer, "rel_bias")[:, b].unsqueeze(0)
        if self.scheme == "alibi":
            return -self.slopes * dist.clamp(min=0).float()
        return None

    def attend(self, layer, x, start):
        B, T, _ = x.shape
        p = f"layers.{layer}.attn."
        q = self.lin(x, p + "q").view(B, T, self.h, self.hd).transpose(1, 2)
        self.k[layer, :B, :, start:start + T] = self.lin(x, p + "k").view(B, T, self.h, self.hd).transpose(1, 2)
        self.v[layer, :B, :, start:start + T] = self.lin(x, p + "v").view(B, T, self.h, self.hd).transpose(1, 2)
        k, v = self.k[layer, :B, :, : start + T], self.v[layer, :B, :, : start + T]
        logits = torch.matmul(q, k.transpose(-1, -2))
        qpos, kpos = torch.arange(start, start + T, device=self.dev), torch.arange(start + T, device=self.dev)
        rel = self.rel(layer, q, qpos, kpos)
        if rel is not None:
            logits = (logits + rel) * self.scale if self.scale_rel else logits * self.scale + rel
        else:
            logits = logits * self.scale
        if T > 1:
            logits = logits.masked_fill(kpos.view(1, -1) > qpos.view(-1, 1), float("-inf"))
        w = torch.softmax(logits, dim=-1)
        o = torch.matmul(w, v)
        if self.scheme == "shaw" and self.r.get("relative_values", False):
            kk = self.r["clip"]
            idx = (kpos.view(1, -1) - qpos.view(-1, 1)).clamp(-kk, kk) + kk
            RV = self.table(layer, "rel_v")[:, idx]  # [H, T, Lk, hd]
            o = o + torch.einsum("bhtj,htjd->bhtd", w, RV)
        return self.lin(o.transpose(1, 2).reshape(B, T, -1), p + "o")

    def ffn(self, layer, x):
        p = f"layers.{layer}.ffn."
        act = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu,
               "gelu_tanh": lambda z: F.gelu(z, approximate="tanh")}[self.cfg.get("ffn_activation", "gelu")]
        up = self.lin(x, p + "up")
        h = act(self.lin(x, p + "gate")) * up if self.cfg.get("ffn_gated", False) else act(up)
        return self.lin(h, p + "down")

    def forward(self, tokens, start):
        """tokens [B, T] at positions start..; returns the last position's logits [B, V]."""
        x = self.t["embed.weight"][tokens] * self.cfg.get("embedding_scale", 1.0)
        pre = self.cfg.get("norm_placement", "pre") == "pre"
        for l in range(self.cfg["n_layers"]):
            p = f"layers.{l}."
            if pre:
                x = x + self.attend(l, self.norm(x, p + "attn_norm"), start)
                x = x + self.ffn(l, self.norm(x, p + "ffn_norm"))
            else:
                x = self.norm(x + self.attend(l, x, start), p + "attn_norm")
                x = self.norm(x + self.ffn(l, x), p + "ffn_norm")
        x = x[:, -1]
        if pre:
            x = self.norm(x, "final_norm")
        head = self.t["embed.weight"] if self.cfg.get("tie_embeddings", False) else self.t["lm_head.weight"]
        return x @ head.T


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (timings synchronize the device)")
    a = ap.parse_args()
    gpu = a.device != "cpu"
    if gpu and not torch.cuda.is_available():
        raise SystemExit(f"torch_bench: --device {a.device}: this torch ({torch.__version__}) sees no CUDA device")

    def sync():
        if gpu:
            torch.cuda.synchronize(a.device)
    torch.set_num_threads(a.threads)
    cfg = json.load(open(os.path.join(a.model, "config.json")))
    cfg.setdefault("head_dim", cfg["d_model"] // cfg["n_heads"])
    tensors = safetensors_io.load(os.path.join(a.model, "model.safetensors"))
    m = CachedDecoder(cfg, tensors, a.context + a.steps + 1, a.batch, a.device)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (a.batch, a.context), generator=gen).to(a.device)
    with torch.inference_mode():
        if gpu:  # the first call initialises cuBLAS and the caching allocator (as relgen's first Forward)
            m.forward(prompt[:1], 0)
        sync()
        t0 = time.perf_counter()
        m.forward(prompt[:1], 0)
        sync()
        prefill_s = time.perf_counter() - t0
        for b in range(1, a.batch):  # the other sequences' caches (untimed)
            m.k[:, b], m.v[:, b] = m.k[:, 0], m.v[:, 0]
        tok = torch.randint(0, 256, (a.batch, 1), generator=gen).to(a.device)
        m.forward(tok, a.context)  # warm-up step
        sync()
        t0 = time.perf_counter()
        for s in range(a.steps):
            logits = m.forward(tok, a.context + 1 + s)
            tok = logits.argmax(-1, keepdim=True)
        sync()
        decode_s = time.perf_counter() - t0
    print(json.dumps({"prefill_tokens_per_s": a.context / prefill_s,
                      "decode_tokens_per_s": a.batch * a.steps / decode_s, "threads": a.threads,
                      "device": torch.cuda.get_device_name(a.device) if gpu else "cpu",
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()
