// Unicode helpers of the BPE tokenizer: UTF-8 decoding, the character classes its pre-tokenizers
// and added tokens use, and NFC. The data agree with the `tokenizers` library 0.20.x, not with a
// particular Unicode version (tools/gen_unicode_tables.py says how, unicode_tables.cc holds them).
// Thread-safety: all functions are pure; the lookup tables are built once, on first use.
#pragma once

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace relgen::unicode {

// Character class bits.
inline constexpr uint8_t kLetter = 1;  // \p{L} of Oniguruma
inline constexpr uint8_t kNumber = 2;  // \p{N}
inline constexpr uint8_t kSpace = 4;   // \s (White_Space); also Rust's char::is_whitespace
inline constexpr uint8_t kWord = 8;    // a word character for added tokens' single_word

uint8_t Classes(char32_t cp);
uint8_t CombiningClass(char32_t cp);

// Decodes the character at `s[*i]` and advances `*i`. `s` must be valid UTF-8.
char32_t NextChar(absl::string_view s, size_t* i);
// Decodes the character that ends at `s[*end]` (exclusive) and moves `*end` back to its start.
char32_t PrevChar(absl::string_view s, size_t* end);
void AppendUtf8(char32_t cp, std::string* out);

bool IsValidUtf8(absl::string_view s);
// `s` with each maximal invalid subpart replaced by U+FFFD (as Python's
// bytes.decode("utf-8", "replace") and Rust's String::from_utf8_lossy do).
std::string ToValidUtf8(absl::string_view s);

// Canonical composition (NFC) of valid UTF-8.
std::string Nfc(absl::string_view s);

}  // namespace relgen::unicode
