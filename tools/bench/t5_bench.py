#!/usr/bin/env python3
"""T5 encoder-decoder throughput: relgen vs transformers vs CTranslate2, side by side in one run.

  build-hf-venv/bin/python tools/bench/t5_bench.py --work /tmp/t5-bench [--small] [--input_len 128]
      [--new 64] [--batch 16] [--threads 2] [--reps 3] [--beams 1] [--skip_relgen]
      [--relgen_bench build/tools/relgen-bench] [--json FILE]

Needs the venv of tools/bootstrap.sh (Debian's torch 1.13, transformers 4.46) plus
`build-hf-venv/bin/pip install ctranslate2` (4.x). Nothing else is downloaded: the checkpoint is a
flan-t5-base-shaped T5 (or, with --small, a 2-layer d_model 128 one) with seeded random weights,
written once under --work as transformers saves it (float32 safetensors, plus a placeholder
spiece.model with T5's special ids, which relgen's T5 loader requires) and converted once to
CTranslate2 float32 with the same id <-> token mapping.

Workload: --batch requests, each encoder input --input_len random ids in 3..31999 (seeded, different
per request), greedy (or beam search with --beams k, returning the best sequence), exactly --new
tokens each (eos never ends a sequence or, with beams, a beam). transformers and
CTranslate2 get the same ids. relgen-bench's `batching` command makes its own prompts,
(s*31 + i*7) % 256, so relgen sees other ids (including 0 and 1) of the same shape: equal work for
throughput, but its tokens cannot be compared with the peers'.

Throughput = batch * new / wall time of the whole batch (encoder included). Each repetition runs
transformers, CTranslate2, relgen in that order after one untimed warm-up of each peer; relgen-bench
warms itself up in every process (one 8-token request, untimed) and only its "N concurrent" line is
used.
"""
import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
import transformers
from transformers import T5Config, T5ForConditionalGeneration
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAD, EOS = 0, 1
PIECES, EXTRA_IDS, VOCAB = 32000, 100, 32128  # as T5: SentencePiece pieces, <extra_id_N>, padded embedding


def t5_config(small):
    shape = dict(d_model=128, d_kv=32, d_ff=256, num_layers=2, num_decoder_layers=2, num_heads=4) if small else \
        dict(d_model=768, d_kv=64, d_ff=2048, num_layers=12, num_decoder_layers=12, num_heads=12)
    return T5Config(**shape, feed_forward_proj="gated-gelu", tie_word_embeddings=False, vocab_size=VOCAB,
                    pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD,
                    relative_attention_num_buckets=32, relative_attention_max_distance=128)


def make_checkpoint(path, small, seed):
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        torch.manual_seed(seed)
        model = T5ForConditionalGeneration(t5_config(small))  # transformers' own init: normal, scaled per layer
        with torch.no_grad():
            for name, p in model.named_parameters():
                # Its layer norms are all ones and its relative biases tiny (std d_model^-0.5): perturb
                # them so that a loader that drops a norm or transposes the bias table changes outputs.
                if name.endswith("layer_norm.weight"):
                    p.add_(0.1 * torch.randn_like(p))
                elif name.endswith("relative_attention_bias.weight"):
                    p.normal_(0.0, 0.5)
        model.save_pretrained(path, safe_serialization=True)
    if not os.path.exists(os.path.join(path, "spiece.model")):
        write_spiece(os.path.join(path, "spiece.model"))


def id_tokens():
    """One unique string per id, as T5Tokenizer names them over write_spiece's model: CTranslate2
    works on token strings, so id i is id_tokens()[i] on both sides."""
    return (["<pad>", "</s>", "<unk>"] + ["t%d" % i for i in range(3, PIECES)]
            + ["<extra_id_%d>" % n for n in reversed(range(EXTRA_IDS))]
            + ["<unused_%d>" % i for i in range(PIECES + EXTRA_IDS, VOCAB)])


def write_spiece(path):
    """relgen's T5 loader wants the checkpoint's spiece.model. Training one of 32000 pieces needs a
    corpus we do not have, so write the protobuf directly: T5's special ids (pad 0, eos 1, unk 2,
    no bos), then placeholder pieces; only ids matter here."""
    from transformers.utils import sentencepiece_model_pb2_new as pb  # works with Debian's protobuf 4
    m = pb.ModelProto()
    kinds = [m.SentencePiece.CONTROL, m.SentencePiece.CONTROL, m.SentencePiece.UNKNOWN]
    for i, piece in enumerate(id_tokens()[:PIECES]):
        kind = kinds[i] if i < len(kinds) else m.SentencePiece.NORMAL
        m.pieces.add(piece=piece, type=kind, score=0.0 if i < len(kinds) else -i / PIECES)
    t = m.trainer_spec
    t.model_type, t.vocab_size = pb.TrainerSpec.UNIGRAM, PIECES
    t.pad_id, t.eos_id, t.unk_id, t.bos_id = PAD, EOS, 2, -1
    m.normalizer_spec.name, m.normalizer_spec.add_dummy_prefix = "identity", False
    with open(path, "wb") as f:
        f.write(m.SerializeToString())


class IdTokenizer:
    """The little of a tokenizer that CTranslate2's T5 loader reads (no SentencePiece model needed)."""
    pad_token, eos_token, unk_token = "<pad>", "</s>", "<unk>"

    def __init__(self):
        self.tokens = id_tokens()

    def get_vocab(self):
        return {t: i for i, t in enumerate(self.tokens)}

    def convert_ids_to_tokens(self, i):
        return self.tokens[i]


def convert_ct2(hf_dir, ct2_dir):
    vocab = os.path.join(ct2_dir, "shared_vocabulary.json")
    if os.path.exists(os.path.join(ct2_dir, "model.bin")) and os.path.exists(vocab):
        with open(vocab) as f:
            if json.load(f) == id_tokens():  # else a conversion by an older version of this script
                return
    from ctranslate2.converters import TransformersConverter

    class Converter(TransformersConverter):
        # The stock load_model passes `dtype=`, which transformers 4.46 hands on to the model's
        # __init__ (TypeError); the stock load_tokenizer wants tokenizer files we do not have.
        def load_model(self, model_class, path, **kwargs):
            return T5ForConditionalGeneration.from_pretrained(path, torch_dtype=torch.float32)

        def load_tokenizer(self, tokenizer_class, path, **kwargs):
            return IdTokenizer()

    Converter(hf_dir).convert(ct2_dir, quantization="float32", force=True)


def workload(batch, input_len, seed):
    return np.random.RandomState(seed).randint(3, 32000, size=(batch, input_len)).tolist()


class HF:
    name = "transformers"

    def __init__(self, hf_dir, inputs, new, mode, beams=1):
        self.model = T5ForConditionalGeneration.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
        self.ids = torch.tensor(inputs, dtype=torch.long)
        self.new = new
        self.beams = beams
        self.tried = False
        self.mode = mode  # "generate" falls back to "loop" if the warm-up's generate() fails

    def generate(self):
        # min_new_tokens masks eos until `new` tokens, as CTranslate2's min_decoding_length does.
        # synced_gpus=False: left as None, generate() asks whether the model is FSDP-sharded, and
        # importing torch.distributed.fsdp fails on torch 1.13 under Python 3.11.
        out = self.model.generate(self.ids, attention_mask=torch.ones_like(self.ids), do_sample=False,
                                  num_beams=self.beams, max_new_tokens=self.new, min_new_tokens=self.new,
                                  synced_gpus=False)
        return out[:, 1:]  # drop decoder_start

    def loop(self):
        # What generate() does for greedy: the encoder once, then the decoder one token at a time
        # with its self- and cross-attention cache, eos masked so every sequence runs `new` steps.
        m, mask = self.model, torch.ones_like(self.ids)
        enc = m.get_encoder()(input_ids=self.ids, attention_mask=mask)
        step = torch.full((self.ids.shape[0], 1), m.config.decoder_start_token_id, dtype=torch.long)
        past, out = EncoderDecoderCache(DynamicCache(), DynamicCache()), []  # as generate() makes it
        for _ in range(self.new):
            o = m(encoder_outputs=enc, attention_mask=mask, decoder_input_ids=step, past_key_values=past,
                  use_cache=True)
            logits = o.logits[:, -1, :]
            logits[:, EOS] = -float("inf")
            step = logits.argmax(-1, keepdim=True)
            past = o.past_key_values
            out.append(step)
        return torch.cat(out, 1)

    def timed(self, run):
        with torch.inference_mode():
            t0 = time.perf_counter()
            tokens = run()
            return time.perf_counter() - t0, tokens.tolist()

    def __call__(self):
        if self.mode == "generate":
            try:
                return self.timed(self.generate)
            except Exception as e:
                if self.tried:
                    raise
                print("transformers generate() failed (%s: %s); using the incremental greedy loop"
                      % (type(e).__name__, str(e).splitlines()[0][:120]), flush=True)
                self.mode = "loop"
            finally:
                self.tried = True
        return self.timed(self.loop)


class CT2:
    name = "CTranslate2"

    def __init__(self, ct2_dir, inputs, new, threads, beams=1):
        import ctranslate2
        self.beams = beams
        self.tr = ctranslate2.Translator(ct2_dir, device="cpu", compute_type="float32", intra_threads=threads,
                                         inter_threads=1)
        vocab = id_tokens()
        self.index = {t: i for i, t in enumerate(vocab)}
        self.src = [[vocab[i] for i in row] for row in inputs]
        self.new = new

    def __call__(self):
        t0 = time.perf_counter()
        res = self.tr.translate_batch(self.src, beam_size=self.beams, min_decoding_length=self.new,
                                      max_decoding_length=self.new, return_scores=False)
        dt = time.perf_counter() - t0
        return dt, [[self.index[t] for t in r.hypotheses[0]] for r in res]


class RelgenError(RuntimeError):
    pass


class Relgen:
    name = "relgen"

    def __init__(self, binary, model_dir, batch, input_len, new, threads, beams=1):
        self.cmd = [binary, "batching", "--model", model_dir, "--sequences", str(batch), "--prompt",
                    str(input_len), "--new", str(new), "--threads", str(threads), "--sequential", "0",
                    "--beams", str(beams)]
        self.line = re.compile(r"^\s*%d concurrent:\s+(\d+) tokens in\s+([\d.]+) s" % batch, re.M)
        self.expect = batch * new

    def __call__(self):
        """(seconds, None), or raises RelgenError with relgen-bench's own words."""
        try:
            p = subprocess.run(self.cmd, capture_output=True, text=True)
        except OSError as e:
            raise RelgenError(str(e))
        m = self.line.search(p.stdout)
        if p.returncode != 0 or not m:
            raise RelgenError("exit %d: %s" % (p.returncode, (p.stderr + p.stdout).strip()[-800:]))
        if int(m.group(1)) != self.expect:
            raise RelgenError("relgen-bench counted %s tokens, expected %d" % (m.group(1), self.expect))
        return float(m.group(2)), None


def machine():
    model, cpus = platform.processor(), os.cpu_count()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = re.search(r"Model name:\s*(.+)", out).group(1).strip()
        cpus = int(re.search(r"^CPU\(s\):\s*(\d+)", out, re.M).group(1))
    except Exception:
        pass
    return {"cpu": model, "cpus": cpus}


def others_busy(seconds=0.5):
    """CPUs' worth of time used by other processes over `seconds`: on a 2-core machine a compile
    next door stalls the spinning OpenMP / DNNL threads of every system here, so each timed run
    is preceded by this sample (None where /proc/stat is missing)."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4], time.process_time()  # all jiffies, idle + iowait, ours
    try:
        t0, i0, p0 = sample()
        time.sleep(seconds)
        t1, i1, p1 = sample()
    except OSError:
        return None
    busy = (1 - (i1 - i0) / max(t1 - t0, 1)) * (os.cpu_count() or 1)
    return max(0.0, busy - (p1 - p0) / seconds)  # minus our own threads still spinning down


def common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def summary(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default="/tmp/t5-bench", help="checkpoints are made here once and reused")
    ap.add_argument("--small", action="store_true", help="2 layers, d_model 128: for trying the harness")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--input_len", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--beams", type=int, default=1, help="beam search with this many beams (1: greedy)")
    ap.add_argument("--relgen_bench", default=os.path.join(REPO, "build/tools/relgen-bench"))
    ap.add_argument("--skip_relgen", action="store_true")
    ap.add_argument("--hf_mode", choices=["generate", "loop"], default="generate",
                    help="transformers: generate(), or the same greedy decode written out (fallback)")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()

    import ctranslate2
    torch.set_num_threads(args.threads)
    stem = os.path.join(args.work, "t5-%s-seed%d" % ("small" if args.small else "base", args.seed))
    hf_dir, ct2_dir = stem + "-hf", stem + "-ct2"
    t0 = time.perf_counter()
    make_checkpoint(hf_dir, args.small, args.seed)
    convert_ct2(hf_dir, ct2_dir)
    print("checkpoints ready in %.1f s: %s, %s" % (time.perf_counter() - t0, hf_dir, ct2_dir), flush=True)

    inputs = workload(args.batch, args.input_len, args.seed)
    if args.beams > 1 and args.hf_mode == "loop":
        ap.error("--hf_mode loop is greedy only")
    systems = [HF(hf_dir, inputs, args.new, args.hf_mode, args.beams),
               CT2(ct2_dir, inputs, args.new, args.threads, args.beams)]
    if not args.skip_relgen:
        systems.append(Relgen(args.relgen_bench, hf_dir, args.batch, args.input_len, args.new, args.threads,
                              args.beams))

    tokens = {}
    for s in systems[:2]:  # relgen-bench warms up inside each run
        _, tokens[s.name] = s()
    for name, out in tokens.items():
        assert len(out) == args.batch and all(len(r) == args.new for r in out), "%s: wrong output shape" % name
    hf_tok, ct2_tok = tokens["transformers"], tokens["CTranslate2"]
    agree = [common_prefix(a, b) for a, b in zip(hf_tok, ct2_tok)]
    print(("greedy" if args.beams == 1 else "best-beam") + " agreement transformers vs CTranslate2: request 0 first %d of %d tokens; all requests: "
          "median %d, min %d, %d of %d identical" % (agree[0], args.new, statistics.median(agree), min(agree),
                                                     sum(a == args.new for a in agree), args.batch))
    print("  transformers[0][:10] %s\n  CTranslate2[0][:10]  %s" % (hf_tok[0][:10], ct2_tok[0][:10]), flush=True)

    per_rep = {s.name: [] for s in systems}
    busy = {s.name: [] for s in systems}
    relgen_error = None
    for rep in range(args.reps):
        for s in systems:
            if s.name == "relgen" and relgen_error:
                continue
            others = others_busy()
            try:
                dt, _ = s()
            except RelgenError as e:
                relgen_error = str(e)
                print("relgen-bench failed, continuing without it: %s" % relgen_error, flush=True)
                continue
            per_rep[s.name].append(args.batch * args.new / dt)
            busy[s.name].append(others)
            print("rep %d %-12s %7.2f s  %8.1f tokens/s  (other processes: %s CPUs busy just before)"
                  % (rep + 1, s.name, dt, per_rep[s.name][-1], "?" if others is None else "%.2f" % others), flush=True)

    versions = {"python": platform.python_version(), "torch": torch.__version__,
                "transformers": transformers.__version__, "ctranslate2": ctranslate2.__version__}
    results = {n: summary(v) for n, v in per_rep.items() if v}
    ratios = {}
    if per_rep.get("relgen"):
        for peer in ("transformers", "CTranslate2"):
            ratios["relgen/" + peer] = summary([r / p for r, p in zip(per_rep["relgen"], per_rep[peer])])

    cfg = t5_config(args.small)
    cmd = " ".join([os.path.relpath(sys.executable, REPO) if sys.executable.startswith(REPO) else sys.executable,
                    os.path.relpath(os.path.abspath(__file__), REPO)] + sys.argv[1:])
    m = machine()
    worst = max([b for v in busy.values() for b in v if b is not None], default=0.0)
    if worst > 0.25:
        print("\nwarning: other processes kept up to %.2f CPUs busy between runs: timings are suspect" % worst)
    print("\n```sh\n%s\n```\n" % cmd)
    print("Machine: %s, %d CPUs; %d threads each. Versions: %s. transformers ran %s."
          % (m["cpu"], m["cpus"], args.threads, ", ".join("%s %s" % kv for kv in versions.items()),
             "generate()" if systems[0].mode == "generate" else "this script's greedy loop (generate() failed)"))
    print("Model: T5 d_model %d, %d+%d layers, %d heads, d_ff %d, gated-gelu, vocab %d, float32, random weights; "
          "%d requests x (%d input + %d new tokens), %s, eos ignored; repetitions: %d.\n"
          % (cfg.d_model, cfg.num_layers, cfg.num_decoder_layers, cfg.num_heads, cfg.d_ff, cfg.vocab_size,
             args.batch, args.input_len, args.new, "greedy" if args.beams == 1 else "beam search, %d beams" % args.beams,
             args.reps))
    print("| system | tokens/s (median) | min - max | relgen / system (median, min - max) |")
    print("| --- | ---: | ---: | ---: |")
    for name in per_rep:
        if name not in results:
            print("| %s | failed | | |" % name)
            continue
        r, ratio = results[name], ratios.get("relgen/" + name)
        cell = "%.2fx (%.2f - %.2f)" % (ratio["median"], ratio["min"], ratio["max"]) if ratio else ""
        print("| %s | %.1f | %.1f - %.1f | %s |" % (name, r["median"], r["min"], r["max"], cell))
    if relgen_error:
        print("\nrelgen failed: %s" % relgen_error)

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": cmd, "machine": m, "versions": versions, "args": vars(args),
                       "transformers_mode": systems[0].mode, "model": cfg.to_dict(),
                       "tokens_per_s": per_rep, "others_busy_cpus": busy, "summary": results, "ratios": ratios,
                       "agreement_prefix": agree, "relgen_error": relgen_error,
                       "first_request_tokens": {"transformers": hf_tok[0], "CTranslate2": ct2_tok[0]}},
                      f, indent=2)


if __name__ == "__main__":
    main()
