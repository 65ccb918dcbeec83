// Internals of the byte-level BPE tokenizer (bpe_tokenizer.cc), exposed for tests. The public
// entry point is NewBpeTokenizer in tokenizer.h.
//
// NewBpeTokenizer reads a Hugging Face `tokenizer.json` as `tokenizers` 0.20.x writes it and
// encodes exactly as that library's `Tokenizer.encode(text)` (special tokens added) does, for the
// features below; any other feature is refused at load with an InvalidArgumentError that names
// the file, the JSON path, what was found and what is supported.
//   model           BPE: vocab, merges ("a b" or ["a", "b"]), unk_token, fuse_unk, ignore_merges;
//                   dropout null, no continuing_subword_prefix / end_of_word_suffix, no
//                   byte_fallback
//   normalizer      null, NFC, or a Sequence of those
//   pre_tokenizer   ByteLevel (add_prefix_space, use_regex with the GPT-2 pattern), Split with
//                   BLOOM's pattern (Isolated, not inverted), or a Sequence of those
//   added_tokens    special or not, with single_word, lstrip, rstrip and normalized
//   post_processor  null, ByteLevel, or TemplateProcessing (its `single` template)
//   decoder         ByteLevel
//   truncation, padding: null
// Input that is not valid UTF-8 is first made valid by replacing each maximal invalid subpart with
// U+FFFD: Encode(raw) equals the library's encode(raw.decode("utf-8", "replace")).
// Decoding equals the library's decode(ids, skip_special_tokens=True): special added tokens and ids
// outside the vocabulary give nothing; a stream never splits a UTF-8 character.
// Thread-safety: the tokenizer is immutable after load (no cache), so threads may share it.
// Cost: linear in the text but for BPE merges, O(n log n) in a pre-token's length (a heap of
// candidate pairs), so long words and whitespace runs stay cheap.
#pragma once

#include <vector>

#include "absl/strings/string_view.h"

namespace relgen::bpe {

// The pieces of valid UTF-8 `text` under the GPT-2 pattern of the ByteLevel pre-tokenizer,
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// as views of `text` that cover it in order.
std::vector<absl::string_view> SplitGpt2(absl::string_view text);

// The pieces of valid UTF-8 `text` under BLOOM's Split pattern, Isolated: the matches of
//    ?[^(\s|[.,!?…。，、।۔،])]+
// (Oniguruma reads the inner brackets as a nested class, so the class excludes whitespace, the
// listed punctuation and the characters ( | ) themselves) and the stretches between them.
std::vector<absl::string_view> SplitBloom(absl::string_view text);

}  // namespace relgen::bpe
