// Raw Unicode data of the BPE tokenizer, generated into unicode_tables.cc by
// tools/gen_unicode_tables.py (see there for sources and how they agree with the `tokenizers`
// library). engine/tokenizers/unicode.h gives the lookups built on them.
#pragma once

#include <cstddef>
#include <cstdint>

namespace relgen::unicode {

struct CodeRange {
  uint32_t lo, hi;  // inclusive
};
struct ClassRange {
  uint32_t lo, hi;  // inclusive
  uint8_t ccc;      // canonical combining class
};
struct Decomposition {
  uint32_t cp, first, second;  // canonical, one level; second == 0 for a singleton
};
struct Composition {
  uint32_t first, second, composite;  // primary composites only
};

extern const CodeRange kLetterRanges[];  // \p{L}
extern const size_t kLetterRangesSize;
extern const CodeRange kNumberRanges[];  // \p{N}
extern const size_t kNumberRangesSize;
extern const CodeRange kWhiteSpaceRanges[];  // \s, White_Space
extern const size_t kWhiteSpaceRangesSize;
extern const CodeRange kWordRanges[];  // word characters of added tokens' single_word
extern const size_t kWordRangesSize;
extern const ClassRange kCombiningClassRanges[];
extern const size_t kCombiningClassRangesSize;
extern const Decomposition kDecompositions[];
extern const size_t kDecompositionsSize;
extern const Composition kCompositions[];
extern const size_t kCompositionsSize;

}  // namespace relgen::unicode
