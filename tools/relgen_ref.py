"""PyTorch reference of the relgen decoder, written from the seed notes and docs/model-format.md,
independently of the C++ code. Computes in float64, whole sequence at once (no cache).

Relative terms, per head, q [L, d]:
  skew (Music Transformer): both the naive R tensor (Shaw-style, [L, L, d]) and the memory-efficient
    Q E^T + skew (pad one column left, reshape (L+1, L), drop the first row); they must agree.
  skew_local: the naive windowed R tensor, and the blocked form (previous block through the local
    skew of the seed, current block through the global skew); they must agree.
  shaw: naive R tensor with clipped index clip(j-i, -k, k) + k, optional relative values.
  t5: per-head scalar from exact integer buckets; alibi: -slope * (i - j).
"""
import math

import torch
import torch.nn.functional as F


# ---------------------------------------------------------------- position helpers

def t5_bucket(rel, num_buckets, max_distance, bidirectional):
    """T5 bucket of relative position rel = key - query, with exact integer arithmetic."""
    offset = 0
    if bidirectional:
        num_buckets //= 2
        if rel > 0:
            offset = num_buckets
        n = abs(rel)
    else:
        n = max(-rel, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return offset + n
    span = num_buckets - max_exact
    # largest k with (max_distance / max_exact)^k <= (n / max_exact)^span
    k = 0
    while k + 1 < span and max_distance ** (k + 1) * max_exact ** span <= n ** span * max_exact ** (k + 1):
        k += 1
    return offset + min(max_exact + k, num_buckets - 1)


def t5_bucket_float(rel, num_buckets, max_distance, bidirectional):
    """The usual float formulation (as in the seed), for cross-checking the exact one."""
    ret = 0
    n = -rel
    if bidirectional:
        num_buckets //= 2
        ret += (n < 0) * num_buckets
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return ret + n
    v = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return ret + min(v, num_buckets - 1)


def alibi_slopes(n):
    def pow2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]
    if math.log2(n).is_integer():
        return pow2(n)
    p = 2 ** math.floor(math.log2(n))
    return pow2(p) + pow2(2 * p)[0::2][: n - p]


# ---------------------------------------------------------------- skew (seed formulations)

def relative_embeddings_left(E, length):
    """E: [M, d] for distances -(M-1)..0. Returns [length, d] for distances -(length-1)..0,
    zero rows for distances the table does not have (as tensor2tensor's get_relative_embeddings_left)."""
    M = E.shape[0]
    pad = max(length - M, 0)
    start = max(M - length, 0)
    padded = F.pad(E, (0, 0, pad, 0))
    return padded[start:start + length]


def skew_global(qe):
    """Seed 000/001: pad a dummy column on the left, reshape (L+1, L), drop the first row."""
    L = qe.size(0)
    padded = F.pad(qe, (1, 0))
    return padded.reshape(L + 1, L)[1:]


def mask_qe_local(qe):
    """Seed 000: zero the upper-left and lower-right triangles of the [N, 2N-1] local Q E^T."""
    mask = torch.ones_like(qe)
    mask = mask.triu(diagonal=0).flip(0) * mask.triu(diagonal=0).flip(1)
    return qe * mask


def skew_local(qe, N):
    """Seed 000: [N, 2N-1] -> [N, N] logits of a block's queries against the previous block."""
    padded = F.pad(qe, (0, 1))
    flat = F.pad(padded.flatten(), (0, N - 1))
    return flat.reshape(N + 1, 2 * N - 1)[:N, -N:]


def skew_rel_naive(q, E, window_start):
    """S_rel[i, j] = q_i . R[i, j] with R[i, j] = E[M-1-(i-j)] for 0 <= i-j < M (else 0), as an
    explicit [L, L, d] tensor. Entries outside the causal window are zero (masked anyway)."""
    L, d = q.shape
    M = E.shape[0]
    R = torch.zeros(L, L, d, dtype=q.dtype)
    for i in range(L):
        for j in range(window_start(i), i + 1):
            if i - j < M:
                R[i, j] = E[M - 1 - (i - j)]
    return torch.einsum("id,ijd->ij", q, R)


def skew_rel_global(q, E):
    L = q.size(0)
    return skew_global(q @ relative_embeddings_left(E, L).T)


def skew_rel_blocked(q, E, N):
    """Music Transformer local attention computed block by block with the seed's two skews."""
    L, d = q.shape
    M = E.shape[0]
    out = torch.zeros(L, L, dtype=q.dtype)
    # Rows for distances 2N-1 .. 1 (previous block), zero where the table has none.
    dist = torch.arange(2 * N - 1, 0, -1)
    E_prev = torch.stack([E[M - 1 - k] if k < M else torch.zeros(d, dtype=q.dtype) for k in dist.tolist()])
    for b0 in range(0, L, N):
        b1 = min(b0 + N, L)
        qb = F.pad(q[b0:b1], (0, 0, 0, N - (b1 - b0)))  # a short last block: pad queries to N
        cur = skew_global(qb @ relative_embeddings_left(E, N).T)[: b1 - b0, : b1 - b0]
        out[b0:b1, b0:b1] = cur
        if b0 >= N:
            prev = skew_local(mask_qe_local(qb @ E_prev.T), N)[: b1 - b0]
            out[b0:b1, b0 - N:b0] = prev
    return out


# ---------------------------------------------------------------- model

def expected_tensors(cfg):
    """Names and shapes from docs/model-format.md."""
    d, h, hd, f, v = cfg["d_model"], cfg["n_heads"], cfg["head_dim"], cfg["ffn_dim"], cfg["vocab_size"]
    w = h * hd
    r = cfg["relative_attention"]
    hs = 1 if r.get("heads_share_table", False) else h
    scheme = r["scheme"]
    layernorm = cfg.get("norm", "layernorm") == "layernorm"
    bias = cfg.get("linear_bias", True)
    shared = r.get("share_across_layers", scheme == "t5")
    out = {}

    def norm(p):
        out[p + ".weight"] = (d,)
        if layernorm:
            out[p + ".bias"] = (d,)

    def lin(p, o, i):
        out[p + ".weight"] = (o, i)
        if bias:
            out[p + ".bias"] = (o,)

    def rel(p):
        if scheme in ("skew", "skew_local"):
            out[p + "rel_k"] = (hs, r["max_relative_position"], hd)
        elif scheme == "shaw":
            out[p + "rel_k"] = (hs, 2 * r["clip"] + 1, hd)
            if r.get("relative_values", False):
                out[p + "rel_v"] = (hs, 2 * r["clip"] + 1, hd)
        elif scheme == "t5":
            out[p + "rel_bias"] = (hs, r.get("num_buckets", 32))

    out["embed.weight"] = (v, d)
    if shared:
        rel("attn.")
    for l in range(cfg["n_layers"]):
        p = f"layers.{l}."
        norm(p + "attn_norm")
        for n in "qkv":
            lin(p + "attn." + n, w, d)
        lin(p + "attn.o", d, w)
        if not shared:
            rel(p + "attn.")
        norm(p + "ffn_norm")
        lin(p + "ffn.up", f, d)
        if cfg.get("ffn_gated", False):
            lin(p + "ffn.gate", f, d)
        lin(p + "ffn.down", d, f)
    if cfg.get("norm_placement", "pre") == "pre":
        norm("final_norm")
    if not cfg.get("tie_embeddings", False):
        out["lm_head.weight"] = (v, d)
    return out


def random_tensors(cfg, gen):
    """Random non-zero weights scaled so every term (including the relative one) matters."""
    t = {}
    for name, shape in expected_tensors(cfg).items():
        if name.endswith("norm.weight"):
            x = 1.0 + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float64)
        elif name.endswith(".bias") or name.endswith("norm.bias"):
            x = 0.1 * torch.randn(shape, generator=gen, dtype=torch.float64)
        elif name.endswith("rel_k") or name.endswith("rel_v") or name.endswith("rel_bias") or name == "embed.weight":
            x = torch.randn(shape, generator=gen, dtype=torch.float64)
        else:
            x = torch.randn(shape, generator=gen, dtype=torch.float64) / math.sqrt(shape[-1])
        t[name] = x
    return t


class Reference:
    def __init__(self, cfg, tensors):
        self.cfg = cfg
        self.t = {k: torch.tensor(v, dtype=torch.float64) for k, v in tensors.items()}
        self.h, self.hd = cfg["n_heads"], cfg["head_dim"]
        self.r = cfg["relative_attention"]
        self.scheme = self.r["scheme"]
        self.shared = self.r.get("share_across_layers", self.scheme == "t5")
        self.scale = cfg.get("attention_scale") or 1.0 / math.sqrt(self.hd)
        self.checked_paths = 0

    def _norm(self, x, p):
        eps = self.cfg.get("norm_eps", 1e-5)
        w = self.t[p + ".weight"]
        if self.cfg.get("norm", "layernorm") == "layernorm":
            return F.layer_norm(x, (x.shape[-1],), w, self.t[p + ".bias"], eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def _lin(self, x, p):
        return F.linear(x, self.t[p + ".weight"], self.t.get(p + ".bias"))

    def _act(self, x):
        a = self.cfg.get("ffn_activation", "gelu")
        return {"relu": F.relu, "gelu": F.gelu, "silu": F.silu,
                "gelu_tanh": lambda z: F.gelu(z, approximate="tanh")}[a](x)

    def window_start(self, i):
        if self.scheme == "skew_local":
            N = self.r["block_length"]
            return max(i // N - 1, 0) * N
        return 0

    def relative_logits(self, layer, head, q):
        """[L, L] relative term for one head (unscaled), valid inside the causal window."""
        L = q.size(0)
        p = "attn." if self.shared else f"layers.{layer}.attn."
        hh = 0 if self.r.get("heads_share_table", False) else head
        i = torch.arange(L).unsqueeze(1)
        j = torch.arange(L).unsqueeze(0)
        if self.scheme == "skew":
            E = self.t[p + "rel_k"][hh]
            naive = skew_rel_naive(q, E, self.window_start)
            fast = skew_rel_global(q, E)
            tri = torch.tril(torch.ones(L, L, dtype=torch.bool))
            assert torch.allclose(naive[tri], fast[tri], rtol=1e-10, atol=1e-10), "skew != naive R"
            self.checked_paths += 1
            return fast
        if self.scheme == "skew_local":
            E = self.t[p + "rel_k"][hh]
            naive = skew_rel_naive(q, E, self.window_start)
            blocked = skew_rel_blocked(q, E, self.r["block_length"])
            vis = self.visible(L)
            assert torch.allclose(naive[vis], blocked[vis], rtol=1e-10, atol=1e-10), "local skew != naive R"
            self.checked_paths += 1
            return blocked
        if self.scheme == "shaw":
            k = self.r["clip"]
            idx = torch.clamp(j - i, -k, k) + k
            R = self.t[p + "rel_k"][hh][idx]  # [L, L, d]
            return torch.einsum("id,ijd->ij", q, R)
        if self.scheme == "t5":
            nb, md, bi = self.r.get("num_buckets", 32), self.r.get("max_distance", 128), self.r.get("bidirectional", False)
            buckets = torch.tensor([[t5_bucket(jj - ii, nb, md, bi) for jj in range(L)] for ii in range(L)])
            return self.t[p + "rel_bias"][hh][buckets]
        if self.scheme == "alibi":
            return -alibi_slopes(self.h)[head] * (i - j).to(torch.float64)
        return torch.zeros(L, L, dtype=torch.float64)

    def visible(self, L):
        vis = torch.zeros(L, L, dtype=torch.bool)
        for i in range(L):
            vis[i, self.window_start(i): i + 1] = True
        return vis

    def attention(self, layer, x):
        L = x.size(0)
        p = f"layers.{layer}.attn."
        q = self._lin(x, p + "q").view(L, self.h, self.hd)
        k = self._lin(x, p + "k").view(L, self.h, self.hd)
        v = self._lin(x, p + "v").view(L, self.h, self.hd)
        vis = self.visible(L)
        scale_rel = self.r.get("scale_with_qk", True) if self.scheme != "none" else True
        outs = []
        for h in range(self.h):
            qk = q[:, h] @ k[:, h].T
            rel = self.relative_logits(layer, h, q[:, h])
            logits = (qk + rel) * self.scale if scale_rel else qk * self.scale + rel
            logits = logits.masked_fill(~vis, float("-inf"))
            w = torch.softmax(logits, dim=-1)
            o = w @ v[:, h]
            if self.scheme == "shaw" and self.r.get("relative_values", False):
                kk = self.r["clip"]
                idx = torch.clamp(torch.arange(L).unsqueeze(0) - torch.arange(L).unsqueeze(1), -kk, kk) + kk
                hh = 0 if self.r.get("heads_share_table", False) else h
                pp = "attn." if self.shared else p
                RV = self.t[pp + "rel_v"][hh][idx]  # [L, L, d]
                o = o + torch.einsum("ij,ijd->id", w, RV)
            outs.append(o)
        return self._lin(torch.cat(outs, dim=-1), p + "o")

    def ffn(self, layer, x):
        p = f"layers.{layer}.ffn."
        up = self._lin(x, p + "up")
        if self.cfg.get("ffn_gated", False):
            return self._lin(self._act(self._lin(x, p + "gate")) * up, p + "down")
        return self._lin(self._act(up), p + "down")

    def forward(self, tokens):
        x = self.t["embed.weight"][torch.as_tensor(tokens)] * self.cfg.get("embedding_scale", 1.0)
        pre = self.cfg.get("norm_placement", "pre") == "pre"
        for l in range(self.cfg["n_layers"]):
            p = f"layers.{l}."
            if pre:
                x = x + self.attention(l, self._norm(x, p + "attn_norm"))
                x = x + self.ffn(l, self._norm(x, p + "ffn_norm"))
            else:
                x = self._norm(x + self.attention(l, x), p + "attn_norm")
                x = self._norm(x + self.ffn(l, x), p + "ffn_norm")
        if pre:
            x = self._norm(x, "final_norm")
        head = self.t["embed.weight"] if self.cfg.get("tie_embeddings", False) else self.t["lm_head.weight"]
        return x @ head.T
