#!/usr/bin/env python3
"""Writes engine/tokenizers/unicode_tables.cc: the Unicode data the BPE tokenizer needs.

Run with the Hugging Face venv's interpreter (it needs the `tokenizers` library):
    build-hf-venv/bin/python tools/gen_unicode_tables.py engine/tokenizers/unicode_tables.cc

The data comes from Python's `unicodedata` (Unicode 14.0.0 in Python 3.11); the `tokenizers`
library (0.20.x) is probed over every code point to make the tables agree with what it does:

- \\p{L}, \\p{N} and \\s of its regexes (Oniguruma): general categories L* and N* and White_Space
  of unicodedata; the script checks that Oniguruma agrees on every code point and stops if not.
- NFC (its normalizer uses Unicode 9.0 normalization data): canonical decompositions, combining
  classes and compositions from unicodedata, less the code points the library's normalizer does
  not know (all assigned after Unicode 9.0). Each one is checked to be treated by the library as
  having no normalization data at all (class 0, no decomposition) before it is dropped.
- Word characters of added tokens' `single_word` test (a newer Unicode than Python's, with
  Alphabetic and Join_Control, which unicodedata lacks): probed from the library directly.
"""

import sys
import unicodedata

from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers

CODE_POINTS = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
ALL_TEXT = "".join(chr(c) for c in CODE_POINTS)


def category(c):
    return unicodedata.category(chr(c))


def library_class(pattern):
    """The code points the library's regex `pattern` (one character) matches."""
    rest = pre_tokenizers.Split(Regex(pattern), behavior="removed").pre_tokenize_str(ALL_TEXT)
    unmatched = set()
    for piece, _ in rest:
        unmatched.update(ord(ch) for ch in piece)
    return set(CODE_POINTS) - unmatched


def white_space(c):
    # The White_Space property: Zs, Zl, Zp and the C0/C1 controls TAB..CR and NEL.
    return category(c) in ("Zs", "Zl", "Zp") or 0x09 <= c <= 0x0D or c == 0x85


def check_regex_classes(letters, numbers, spaces):
    for name, ours, pattern in (("letter", letters, r"\p{L}"), ("number", numbers, r"\p{N}"),
                                ("space", spaces, r"\s")):
        theirs = library_class(pattern)
        if theirs != ours:
            diff = sorted(theirs ^ ours)[:20]
            sys.exit(f"{name}: unicodedata and the library's {pattern} differ at "
                     + " ".join(f"U+{c:04X}" for c in diff))


def probe_word_characters():
    """Code points that keep a `single_word` added token from matching when next to it."""
    tok = Tokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    tok.add_tokens([AddedToken("<w>", single_word=True)])
    wid = tok.token_to_id("<w>")
    before = tok.encode_batch([chr(c) + "<w>" for c in CODE_POINTS], add_special_tokens=False)
    after = tok.encode_batch(["<w>" + chr(c) for c in CODE_POINTS], add_special_tokens=False)
    word = {c for c, e in zip(CODE_POINTS, before) if wid not in e.ids}
    if word != {c for c, e in zip(CODE_POINTS, after) if wid not in e.ids}:
        sys.exit("single_word: the word characters before and after a token differ")
    return word


def probe_strip_spaces():
    tok = Tokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    tok.add_tokens([AddedToken("<s>", lstrip=True, rstrip=True)])
    encs = tok.encode_batch(["<s>" + chr(c) for c in CODE_POINTS], add_special_tokens=False)
    return {c for c, e in zip(CODE_POINTS, encs) if e.offsets[0] == (0, 4)}


def canonical_decomposition(c):
    d = unicodedata.decomposition(chr(c))
    if not d or d.startswith("<"):
        return None
    return [int(x, 16) for x in d.split()]


def nfc_unknown_to_library(decomp, ccc):
    """Code points with normalization data in unicodedata that the library's NFC lacks."""
    nfd = normalizers.NFD()
    unknown = set()
    for c in CODE_POINTS:
        if c in decomp and nfd.normalize_str(chr(c)) != unicodedata.normalize("NFD", chr(c)):
            unknown.add(c)
        if ccc.get(c, 0):
            # A mark of class > 1 moves after U+0334 (class 1), one of class 1 after U+0301 (230)
            # stays put; the library leaving them in place means it reads class 0.
            s = "\u0915" + chr(c) + "\u0334" if ccc[c] > 1 else "\u0915\u0301" + chr(c)
            if nfd.normalize_str(s) != unicodedata.normalize("NFD", s):
                unknown.add(c)
    for c in unknown:
        # Unknown means no data at all: no decomposition, and class 0 against every mark class.
        if nfd.normalize_str(chr(c)) != chr(c):
            sys.exit(f"U+{c:04X}: the library decomposes it differently from unicodedata")
        for mark in ("\u0334", "\u0301", "\u0345", "\u0316"):
            s = "\u0915" + chr(c) + mark
            if nfd.normalize_str(s) != s:
                sys.exit(f"U+{c:04X}: the library gives it a combining class unicodedata does not")
    return unknown


def ranges(members):
    out = []
    for c in sorted(members):
        if out and out[-1][1] == c - 1:
            out[-1][1] = c
        else:
            out.append([c, c])
    return out


def emit_rows(lines, name, ctype, rows, per_line):
    lines.append(f"const {ctype} {name}[] = {{")
    for i in range(0, len(rows), per_line):
        lines.append("    " + " ".join(rows[i:i + per_line]))
    lines.append("};")
    lines.append(f"const size_t {name}Size = sizeof({name}) / sizeof({name}[0]);")
    lines.append("")


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: gen_unicode_tables.py OUT.cc")
    letters = {c for c in CODE_POINTS if category(c)[0] == "L"}
    numbers = {c for c in CODE_POINTS if category(c)[0] == "N"}
    spaces = {c for c in CODE_POINTS if white_space(c)}
    check_regex_classes(letters, numbers, spaces)
    if probe_strip_spaces() != spaces:
        sys.exit("lstrip/rstrip: the library's whitespace is not White_Space")
    word = probe_word_characters()

    decomp = {c: d for c in CODE_POINTS if (d := canonical_decomposition(c))}
    ccc = {c: unicodedata.combining(chr(c)) for c in CODE_POINTS if unicodedata.combining(chr(c))}
    unknown = nfc_unknown_to_library(decomp, ccc)
    for c in unknown:
        decomp.pop(c, None)
        ccc.pop(c, None)
    # Primary composites: a pair decomposition that NFC recomposes (not excluded, not a singleton).
    compositions = sorted((d[0], d[1], c) for c, d in decomp.items()
                          if len(d) == 2 and unicodedata.normalize("NFC", chr(c)) == chr(c))

    lines = [
        "// Generated by tools/gen_unicode_tables.py; do not edit. Unicode data of the BPE",
        f"// tokenizer from Python's unicodedata {unicodedata.unidata_version}, made to agree with",
        "// the `tokenizers` library (see the script): regex classes as Oniguruma reads them, NFC",
        "// with the library's Unicode 9.0 normalization data (code points assigned later that",
        "// carry normalization data in " + unicodedata.unidata_version + " are left out: "
        + ", ".join(f"U+{c:04X}" for c in sorted(unknown)[:4]) + f" and {len(unknown) - 4} more),",
        "// and the word characters of `single_word` as probed from the library.",
        '#include "engine/tokenizers/unicode_tables.h"',
        "",
        "namespace relgen::unicode {",
        "",
    ]

    def range_rows(members):
        return [f"{{0x{a:X}, 0x{b:X}}}," for a, b in ranges(members)]

    emit_rows(lines, "kLetterRanges", "CodeRange", range_rows(letters), 6)
    emit_rows(lines, "kNumberRanges", "CodeRange", range_rows(numbers), 6)
    emit_rows(lines, "kWhiteSpaceRanges", "CodeRange", range_rows(spaces), 6)
    emit_rows(lines, "kWordRanges", "CodeRange", range_rows(word), 6)
    ccc_rows = []
    for value in sorted(set(ccc.values())):
        ccc_rows += [f"{{0x{a:X}, 0x{b:X}, {value}}},"
                     for a, b in ranges(c for c, v in ccc.items() if v == value)]
    emit_rows(lines, "kCombiningClassRanges", "ClassRange", ccc_rows, 5)
    emit_rows(lines, "kDecompositions", "Decomposition",
              [f"{{0x{c:X}, 0x{d[0]:X}, 0x{d[1] if len(d) > 1 else 0:X}}},"
               for c, d in sorted(decomp.items())], 4)
    emit_rows(lines, "kCompositions", "Composition",
              [f"{{0x{a:X}, 0x{b:X}, 0x{c:X}}}," for a, b, c in compositions], 4)
    lines.append("}  // namespace relgen::unicode")
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{len(letters)} letters, {len(numbers)} numbers, {len(spaces)} spaces, {len(word)} word "
          f"characters, {len(ccc)} marks, {len(decomp)} decompositions, {len(compositions)} "
          f"compositions, {len(unknown)} code points left out of NFC")


if __name__ == "__main__":
    main()
