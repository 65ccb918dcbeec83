#!/usr/bin/env python3
"""Test data for the byte-level BPE tokenizer (tests/bpe_tokenizer_test.cc), from the real
Hugging Face `tokenizers` library (run with the HF venv: build-hf-venv/bin/python).

    make_bpe_cases.py --out DIR

Trains small tokenizers on local text (Debian's fortunes, else text under /usr/share/doc), one per
family below, and writes for each DIR/FAMILY/:
  tokenizer.json   the tokenizer as the library saves it (bloom's merges rewritten to "a b" form)
  encode.jsonl     {"hex": raw bytes, "ids": library ids, "decoded": library decode, hex}; the
                   library encodes raw.decode("utf-8", "replace"), as relgen documents
  decode.jsonl     {"ids": random ids, "decoded": library decode(ids), "decoded_keep": the same
                   with skip_special_tokens=False, hex}
and, the same for every family, exhaustive probes over all code points (surrogates excepted):
  probe_split.json boundaries of a template around each code point under the GPT-2 pattern
                   (ByteLevel) and BLOOM's Split, as runs of code points with equal boundaries
  probe_nfc.json   the library's NFC of templates around each code point where it changes them,
                   and of every mark against a mark of every combining class, and compositions
  probe_word.json  the code points that keep a single_word added token from matching
DIR/stamp holds a hash of this script, the library version and the corpus; when it matches,
the script leaves DIR as it is (the data are deterministic).
"""

import argparse
import glob
import hashlib
import json
import os
import random
import sys
import unicodedata

import tokenizers
from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors, trainers)

BLOOM_PATTERN = " ?[^(\\s|[.,!?…。，、।۔،])]+"
CODE_POINTS = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
PLACEHOLDER = "\uE000"  # in templates: where the probed code point goes


def corpus_files():
    files = sorted(f for f in glob.glob("/usr/share/games/fortunes/*")
                   if os.path.isfile(f) and not f.endswith(".dat") and not f.endswith(".u8"))
    if not files:
        files = sorted(f for f in glob.glob("/usr/share/doc/**/*", recursive=True)
                       if os.path.isfile(f) and not f.endswith(".gz")
                       and os.path.getsize(f) < 200_000)[:400]
    if not files:
        sys.exit("no corpus: install Debian's fortunes (tools/bootstrap.sh) or any docs")
    return files


def read_corpus(files):
    lines = []
    for f in files:
        with open(f, "rb") as fh:
            text = fh.read().decode("utf-8", "replace")
        lines += [line for line in text.split("\n") if line.strip() and line != "%"]
    return lines


# Scripts for synthetic multilingual text, so merges also join pieces of multi-byte characters.
SCRIPTS = [(0x0410, 0x044F), (0x03B1, 0x03C9), (0x05D0, 0x05EA), (0x0627, 0x064A),
           (0x0905, 0x0939), (0x0E01, 0x0E2E), (0x3041, 0x3093), (0x4E00, 0x4E80),
           (0xAC00, 0xAC80), (0x00E0, 0x00FF), (0x1F600, 0x1F64F)]


def synthetic_lines(rng, n):
    out = []
    for _ in range(n):
        lo, hi = rng.choice(SCRIPTS)
        words = ["".join(chr(rng.randint(lo, hi)) for _ in range(rng.randint(1, 6)))
                 for _ in range(rng.randint(2, 10))]
        out.append(" ".join(words) + rng.choice(["", ".", "!", "?", "。", "،"]))
    return out


def train(corpus, vocab_size, pre, normalizer=None, specials=(), alphabet=True, limit=None,
          unk=None):
    tok = Tokenizer(models.BPE(unk_token=unk, fuse_unk=unk is not None))
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    kwargs = dict(vocab_size=vocab_size, min_frequency=2, special_tokens=list(specials),
                  show_progress=False)
    if alphabet:
        kwargs["initial_alphabet"] = pre_tokenizers.ByteLevel.alphabet()
    if limit is not None:
        kwargs["limit_alphabet"] = limit
    tok.train_from_iterator(corpus, trainers.BpeTrainer(**kwargs))
    return tok


def build_families(corpus):
    fams = {}
    # GPT-2: ByteLevel with the regex, no normalizer.
    t = train(corpus, 3000, pre_tokenizers.ByteLevel(add_prefix_space=False),
              specials=["<|endoftext|>"])
    t.post_processor = processors.ByteLevel(trim_offsets=True)
    fams["gpt2"] = (t, {})
    # BLOOM: Split on BLOOM's pattern, then ByteLevel without the regex; merges as "a b".
    t = train(corpus, 3000, pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(BLOOM_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]),
        specials=["<unk>", "<s>", "</s>", "<pad>"])
    t.post_processor = processors.ByteLevel(trim_offsets=True)
    fams["bloom"] = (t, {"string_merges": True})
    # NFC (GPT-NeoX) with add_prefix_space and ignore_merges.
    t = train(corpus, 2500, pre_tokenizers.ByteLevel(add_prefix_space=True),
              normalizer=normalizers.NFC())
    fams["nfc"] = (t, {"ignore_merges": True, "words": corpus})
    # Added tokens, special and not, with every flag, over an NFC Sequence normalizer.
    t = train(corpus, 2000, pre_tokenizers.ByteLevel(add_prefix_space=False),
              normalizer=normalizers.Sequence([normalizers.NFC()]))
    t.add_special_tokens([
        AddedToken("<|endoftext|>", special=True, normalized=False),
        AddedToken("<mask>", special=True, lstrip=True, normalized=False),
        AddedToken("[SEP]", special=True, rstrip=True, normalized=False),
        AddedToken("<pad>", special=True, lstrip=True, rstrip=True, normalized=False),
    ])
    t.add_tokens([
        AddedToken("<w>", single_word=True, normalized=False),
        AddedToken("hello", single_word=True, normalized=True),
        AddedToken("  ", normalized=True),
        AddedToken("    ", normalized=True),
        AddedToken("\t\t", normalized=True),
        AddedToken("cafe\u0301", normalized=True),     # matched as "café" after NFC
        AddedToken("\u2126", normalized=False),        # OHM SIGN: raw text only (NFC makes Ω)
        AddedToken("日本", normalized=False),
        AddedToken("[[", normalized=False),
        AddedToken("[[[", normalized=False),
        AddedToken("a b", lstrip=True, normalized=True),
        AddedToken("\U0001F44D\U0001F3FD", rstrip=True, normalized=True),
        AddedToken("the end", single_word=True, lstrip=True, rstrip=True, normalized=False),
    ])
    fams["added"] = (t, {})
    # TemplateProcessing; BLOOM's Split before a ByteLevel with add_prefix_space (a space before
    # each piece); a small alphabet and no unk: unknown characters drop.
    t = train(corpus, 1500, pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(BLOOM_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)]),
        alphabet=False, limit=60, specials=["<s>", "</s>"])
    t.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", t.token_to_id("<s>")), ("</s>", t.token_to_id("</s>"))])
    fams["template"] = (t, {})
    # A small alphabet with an unk token, fused.
    t = train(corpus, 1200, pre_tokenizers.ByteLevel(add_prefix_space=False), alphabet=False,
              limit=50, specials=["<unk>"], unk="<unk>")
    fams["unk"] = (t, {})
    return fams


def save(tok, opts, path):
    data = json.loads(tok.to_str())
    if opts.get("string_merges"):
        data["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m
                                   for m in data["model"]["merges"]]
    if opts.get("ignore_merges"):
        data["model"]["ignore_merges"] = True
        # Whole words the merges do not build: only ignore_merges maps them to one token.
        vocab = data["model"]["vocab"]
        counts = {}
        for line in opts["words"][:5000]:
            for w in line.split():
                if w.isalpha():
                    counts[w] = counts.get(w, 0) + 1
        byte_char = dict(zip(range(256), bytes_to_chars()))
        added = 0
        for w, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
            token = "".join(byte_char[b] for b in (" " + w).encode())
            if token not in vocab and added < 150:
                vocab[token] = len(vocab)
                added += 1
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, ensure_ascii=False, indent=1)
    return Tokenizer.from_file(path)  # the reference is what the file says


def bytes_to_chars():
    """ByteLevel's character for each byte: printable Latin-1 for itself, the rest from U+0100."""
    out, nxt = [], 256
    for b in range(256):
        if 0x21 <= b <= 0x7E or 0xA1 <= b <= 0xAC or b >= 0xAE:
            out.append(chr(b))
        else:
            out.append(chr(nxt))
            nxt += 1
    return out


# ---- test strings -------------------------------------------------------------------------

WHITESPACE = [" ", " ", " ", "\t", "\n", "\r", "\r\n", "\x0b", "\x0c", "\x85", "\xa0", "\u1680",
              "\u2000", "\u2007", "\u200a", "\u2028", "\u2029", "\u202f", "\u205f", "\u3000",
              "\u200b", "\x1c", "\x1f", "\ufeff"]
DIGITS = "0123456789٠١٢٣٤٥٦٧٨٩०१२३४५६७८९０１２３４５６７８９²³¹¼½¾ⅠⅡⅢ①②③𝟎𝟏𝟐"
PUNCT = ".,!?;:'\"()[]{}<>-_/\\|@#$%^&*+=~`…。，、।۔،«»¿¡"
EMOJI = ["\U0001F468\u200D\U0001F469\u200D\U0001F467", "\U0001F44D\U0001F3FD",
         "\U0001F3F3\uFE0F\u200D\U0001F308", "\U0001F1FA\U0001F1F8", "1\uFE0F\u20E3",
         "\U0001F9D1\U0001F3FF\u200D\U0001F4BB", "\u2764\uFE0F", "\U0001F600", "\U0001FAE0",
         "\U0001F469\U0001F3FB\u200D\u2764\uFE0F\u200D\U0001F48B\u200D\U0001F468\U0001F3FF"]
MARKS = ["\u0300", "\u0301", "\u0302", "\u0303", "\u0308", "\u0316", "\u0323", "\u0327",
         "\u0328", "\u0334", "\u0345", "\u035c", "\u0361", "\u05b0", "\u064b", "\u093c",
         "\u094d", "\u0e38", "\u3099", "\u309a", "\u1df6", "\u1dfb", "\u0c3c", "\u1ac0",
         "\U0001e2ec", "\u20d7", "\U0001d165", "\U0001d16d"]
BASES = ["a", "e", "o", "u", "A", "E", "O", "i", "n", "c", "s", "z", "\u03b1", "\u03c9",
         "\u0415", "\u0438", "\u304b", "\u30cf", "\u1100", "\u1161", "\u11a8", "\uac00",
         "\u0b47", "\u0dd9", "\U00011935", "\U00011099", "\u212b", "\u2126", "\u00c5", "\u1e0b",
         "\u0f71", "\u0915", "\u0627", "\u05d0"]
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'x",
                "''s", "'", "’s", "'ll've", "'dd"]


def plane_sample(rng):
    plane = rng.randint(0, 16)
    while True:
        c = plane << 16 | rng.randint(0, 0xFFFF)
        if not 0xD800 <= c <= 0xDFFF:
            return chr(c)


def text_cases(rng, corpus, tokens):
    cases = []  # raw bytes
    add = lambda s: cases.append(s.encode("utf-8") if isinstance(s, str) else s)
    for line in rng.sample(corpus, min(3000, len(corpus))):
        add(line)
    for _ in range(1000):  # several lines, as a prompt would be
        add("\n".join(rng.sample(corpus, rng.randint(2, 6))))
    for _ in range(1500):  # random bytes, often invalid UTF-8
        n = rng.randint(1, 40)
        kind = rng.random()
        if kind < 0.4:
            add(bytes(rng.randint(0, 255) for _ in range(n)))
        elif kind < 0.7:
            add(bytes(rng.choice([0x20, 0x61, 0x80, 0xBF, 0xC2, 0xC3, 0xE0, 0xE2, 0xED, 0xEF,
                                  0xF0, 0xF4, 0xF5, 0xFF, 0xA0, 0x9F, 0x27, 0x30])
                      for _ in range(n)))
        else:  # valid text with a cut or a stray byte
            s = "".join(rng.choice(SCRIPTS_TEXT) for _ in range(rng.randint(1, 8))).encode()
            cut = rng.randint(0, len(s))
            add(s[:cut] + bytes([rng.choice([0x80, 0xC3, 0xE2, 0xF0, 0xFE])]) + s[cut + 1:])
    for _ in range(1500):  # every plane
        add("".join(plane_sample(rng) if rng.random() < 0.6 else rng.choice(" a1.'\n")
                    for _ in range(rng.randint(1, 20))))
    for _ in range(1000):  # whitespace runs of mixed kinds
        parts = []
        for _ in range(rng.randint(1, 6)):
            parts.append("".join(rng.choice(WHITESPACE) for _ in range(rng.randint(1, 6))))
            parts.append(rng.choice(["", "a", "word", "1", "!", "日本", "é", "'s", "x y"]))
        add("".join(parts))
    for _ in range(800):  # digits
        add("".join(rng.choice([rng.choice(DIGITS), str(rng.randint(0, 10**9)), " ", "abc",
                                rng.choice(PUNCT), "3.14", "1,000", "v2"])
                    for _ in range(rng.randint(1, 8))))
    for _ in range(800):  # contractions
        add("".join(rng.choice([rng.choice(CONTRACTIONS), "I", "don", "we", " ", "they",
                                rng.choice(PUNCT), "\u00e9", "1"])
                    for _ in range(rng.randint(1, 8))))
    for _ in range(1200):  # added tokens embedded in text
        parts = []
        for _ in range(rng.randint(1, 6)):
            parts.append(rng.choice(tokens))
            parts.append(rng.choice(["", " ", "  ", "\t", "\n", "x", "word ", " word", "\u00a0",
                                     "_", "1", "é", "\u0301", "!", "e\u0301", "日", "   \n "]))
        add("".join(parts))
    for _ in range(500):  # emoji with ZWJ, skin tones, flags, keycaps
        add("".join(rng.choice(EMOJI + [" ", "a", "!", "\u200d", "\ufe0f", "\U0001F3FB"])
                    for _ in range(rng.randint(1, 8))))
    for _ in range(1200):  # combining sequences (NFC), Hangul jamo, singletons, late marks
        s = ""
        for _ in range(rng.randint(1, 5)):
            s += rng.choice(BASES) + "".join(rng.choice(MARKS) for _ in range(rng.randint(0, 4)))
            s += rng.choice(["", " ", "", "x"])
        add(s)
    for n in (100, 1000, 5000):  # long words and runs
        for unit in ("a", "ab", "z", "é", "日", "1", "!", " ", "\n", " \t", "\u3000", "'s",
                     "\U0001F600", "e\u0301"):
            add(unit * (n // len(unit)))
        add("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n)))
        add(" ".join("".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 12)))
                     for _ in range(n // 6)))
    add("")
    for c in range(0x80):
        add(chr(c))
    return cases


SCRIPTS_TEXT = ["hello", " world", "日本語", "é", "Ω", "\U0001F600", "ñ", "Ж", "ก", "한국어",
                "🇺🇸", "e\u0301", " ", "\n", "'s"]


# ---- exhaustive probes --------------------------------------------------------------------

SPLIT_TEMPLATES = {
    # Every class (\p{L}, \p{N}, \s, other) gives these templates different boundaries.
    "gpt2": "a\uE0001\uE000!\uE000 \uE000\uE000'\uE000  \uE000\n\uE000",
    "bloom": "a\uE000 \uE000,\uE000  \uE000(\uE000)\uE000",
}


def probe_split():
    out = {}
    for name, template in SPLIT_TEMPLATES.items():
        tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0}, unk_token="[UNK]"))
        if name == "gpt2":
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            tok.pre_tokenizer = pre_tokenizers.Split(Regex(BLOOM_PATTERN), behavior="isolated")
        encs = tok.encode_batch([template.replace(PLACEHOLDER, chr(c)) for c in CODE_POINTS],
                                add_special_tokens=False)
        runs = []
        for c, e in zip(CODE_POINTS, encs):
            ends = ",".join(str(end) for _, end in e.offsets)
            if runs and runs[-1][2] == ends and runs[-1][1] + 1 == c:
                runs[-1][1] = c
            elif runs and runs[-1][2] == ends and runs[-1][1] == 0xD7FF and c == 0xE000:
                runs[-1][1] = c
            else:
                runs.append([c, c, ends])
        out[name] = {"template": template, "runs": runs}
    return out


NFC_TEMPLATES = ["\uE000", "\u0915\uE000\u0334", "\u0915\u0301\uE000", "\uE000\u0301",
                 "a\uE000", "\uE000\u0316\u0301"]


def nfc_batch(strings):
    nfc = normalizers.NFC()
    out = []
    for i in range(0, len(strings), 4000):
        chunk = strings[i:i + 4000]
        if any("\x00" in s for s in chunk):
            out += [nfc.normalize_str(s) for s in chunk]
        else:  # U+0000 never composes: a safe separator
            out += nfc.normalize_str("\x00".join(chunk)).split("\x00")
    return out


def probe_nfc():
    templates = []
    for template in NFC_TEMPLATES:
        inputs = [template.replace(PLACEHOLDER, chr(c)) for c in CODE_POINTS]
        changed = [[c, o] for c, i, o in zip(CODE_POINTS, inputs, nfc_batch(inputs)) if i != o]
        templates.append({"template": template, "changed": changed})
    # Every mark (a non-zero class in unicodedata) after a mark of each class, both orders.
    marks = sorted(c for c in CODE_POINTS if unicodedata.combining(chr(c)))
    classes = {}
    for c in marks:
        if not unicodedata.decomposition(chr(c)):
            classes.setdefault(unicodedata.combining(chr(c)), c)
    pairs = [chr(0x0915) + chr(r) + chr(m) for r in classes.values() for m in marks]
    pairs += [chr(0x0915) + chr(m) + chr(r) for r in classes.values() for m in marks]
    # Compositions: every canonical pair decomposition, adjacent and across a mark.
    comps = []
    for c in CODE_POINTS:
        d = unicodedata.decomposition(chr(c))
        if d and not d.startswith("<"):
            parts = [chr(int(x, 16)) for x in d.split()]
            comps.append("".join(parts))
            comps.append(parts[0] + "\u0316" + "".join(parts[1:]))
            comps.append(unicodedata.normalize("NFD", chr(c)))
    hangul = [chr(0x1100 + l) + chr(0x1161 + v) + (chr(0x11A7 + t) if t else "")
              for l in range(19) for v in range(21) for t in range(0, 28, 3)]
    strings = pairs + comps + hangul
    return {"templates": templates, "strings": [[s, o] for s, o in zip(strings, nfc_batch(strings))]}


def probe_word():
    """Per side, the code points that keep a single_word token from matching when next to it."""
    tok = Tokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    tok.add_tokens([AddedToken("<w>", single_word=True, normalized=False)])
    wid = tok.token_to_id("<w>")

    def runs_of(texts):
        encs = tok.encode_batch(texts, add_special_tokens=False)
        runs = []
        for c, e in zip(CODE_POINTS, encs):
            if wid in e.ids:
                continue
            if runs and runs[-1][1] + 1 == c:
                runs[-1][1] = c
            else:
                runs.append([c, c])
        return runs

    return {"token": "<w>",
            "before_runs": runs_of([chr(c) + "<w>" for c in CODE_POINTS]),
            "after_runs": runs_of(["<w>" + chr(c) for c in CODE_POINTS])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    files = corpus_files()
    h = hashlib.sha256()
    h.update(open(__file__, "rb").read())
    h.update(tokenizers.__version__.encode())
    for f in files:
        h.update(f"{f}:{os.path.getsize(f)}".encode())
    stamp = h.hexdigest()
    stamp_file = os.path.join(args.out, "stamp")
    if os.path.exists(stamp_file) and open(stamp_file).read() == stamp:
        print(f"bpe cases in {args.out} are up to date")
        return
    os.makedirs(args.out, exist_ok=True)
    if os.path.exists(stamp_file):
        os.remove(stamp_file)

    rng = random.Random(20240611)
    corpus = read_corpus(files)
    train_corpus = corpus[:40000] + synthetic_lines(rng, 4000)
    fams = build_families(train_corpus)
    total = 0
    for name, (tok, opts) in fams.items():
        d = os.path.join(args.out, name)
        os.makedirs(d, exist_ok=True)
        ref = save(tok, opts, os.path.join(d, "tokenizer.json"))
        added = [t.content for t in ref.get_added_tokens_decoder().values()]
        tokens = sorted(set(added + ["<|endoftext|>", "<s>", "hello", "  ", "[[", "<w>"]))
        frng = random.Random(f"{name}-cases")
        raws = text_cases(frng, corpus, tokens)
        texts = [r.decode("utf-8", "replace") for r in raws]
        encs = ref.encode_batch(texts)
        decoded = ref.decode_batch([e.ids for e in encs])
        with open(os.path.join(d, "encode.jsonl"), "w") as f:
            for r, e, s in zip(raws, encs, decoded):
                f.write(json.dumps({"hex": r.hex(), "ids": e.ids,
                                    "decoded": s.encode("utf-8").hex()}) + "\n")
        size = ref.get_vocab_size(with_added_tokens=True)
        id_seqs = []
        for _ in range(3000):
            n = frng.randint(1, 30)
            seq = [frng.randrange(size) for _ in range(n)]
            if frng.random() < 0.1:
                seq.insert(frng.randrange(len(seq) + 1), size + frng.randrange(1000))
            id_seqs.append(seq)
        with open(os.path.join(d, "decode.jsonl"), "w") as f:
            kept = ref.decode_batch(id_seqs, skip_special_tokens=False)
            for seq, s, k in zip(id_seqs, ref.decode_batch(id_seqs), kept):
                f.write(json.dumps({"ids": seq, "decoded": s.encode("utf-8").hex(),
                                    "decoded_keep": k.encode("utf-8").hex()}) + "\n")
        total += len(raws)
        print(f"{name}: {len(raws)} strings, {len(id_seqs)} id sequences, vocab {size}")
    for name, fn in (("probe_split.json", probe_split), ("probe_nfc.json", probe_nfc),
                     ("probe_word.json", probe_word)):
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(fn(), f, ensure_ascii=True)
    with open(stamp_file, "w") as f:
        f.write(stamp)
    print(f"{total} strings for {len(fams)} tokenizers, probes of {len(CODE_POINTS)} code points")


if __name__ == "__main__":
    main()
