#include "engine/tokenizers/unicode.h"

#include <algorithm>
#include <cstring>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/tokenizers/tokenizer.h"
#include "engine/tokenizers/unicode_tables.h"

namespace relgen::unicode {
namespace {

constexpr char32_t kMaxCodePoint = 0x10FFFF;

// A per-code-point byte table in two stages (block index, then shared 256-entry blocks): O(1)
// lookups in about 100 KB instead of 1.1 MB.
class TwoStageTable {
 public:
  explicit TwoStageTable(const std::vector<uint8_t>& flat) {
    std::unordered_map<std::string, uint16_t> seen;
    index_.resize((kMaxCodePoint + 1) >> 8);
    for (size_t block = 0; block < index_.size(); ++block) {
      std::string key(reinterpret_cast<const char*>(flat.data() + block * 256), 256);
      auto [it, inserted] = seen.try_emplace(key, static_cast<uint16_t>(seen.size()));
      if (inserted) blocks_.insert(blocks_.end(), key.begin(), key.end());
      index_[block] = it->second;
    }
  }
  uint8_t Get(char32_t cp) const {
    if (cp > kMaxCodePoint) return 0;
    return static_cast<uint8_t>(blocks_[static_cast<size_t>(index_[cp >> 8]) * 256 + (cp & 0xFF)]);
  }

 private:
  std::vector<uint16_t> index_;
  std::vector<char> blocks_;
};

const TwoStageTable& ClassTable() {
  static const TwoStageTable* table = [] {
    std::vector<uint8_t> flat(kMaxCodePoint + 1, 0);
    auto mark = [&](const CodeRange* ranges, size_t n, uint8_t bit) {
      for (size_t i = 0; i < n; ++i) {
        for (uint32_t cp = ranges[i].lo; cp <= ranges[i].hi; ++cp) flat[cp] |= bit;
      }
    };
    mark(kLetterRanges, kLetterRangesSize, kLetter);
    mark(kNumberRanges, kNumberRangesSize, kNumber);
    mark(kWhiteSpaceRanges, kWhiteSpaceRangesSize, kSpace);
    mark(kWordRanges, kWordRangesSize, kWord);
    return new TwoStageTable(flat);
  }();
  return *table;
}

const TwoStageTable& CccTable() {
  static const TwoStageTable* table = [] {
    std::vector<uint8_t> flat(kMaxCodePoint + 1, 0);
    for (size_t i = 0; i < kCombiningClassRangesSize; ++i) {
      const ClassRange& r = kCombiningClassRanges[i];
      for (uint32_t cp = r.lo; cp <= r.hi; ++cp) flat[cp] = r.ccc;
    }
    return new TwoStageTable(flat);
  }();
  return *table;
}

// Hangul syllables decompose and compose by arithmetic (Unicode 3.12).
constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr char32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount,
                   kSCount = kLCount * kNCount;

struct NfcData {
  // Full canonical decompositions: code point -> [offset, offset + length) of `chars`.
  std::unordered_map<char32_t, std::pair<uint32_t, uint32_t>> decomposition;
  std::vector<char32_t> chars;
  std::unordered_map<uint64_t, char32_t> composition;  // first << 32 | second
};

const NfcData& Nfc() {
  static const NfcData* data = [] {
    auto* d = new NfcData;
    std::unordered_map<char32_t, std::pair<char32_t, char32_t>> one_level;
    for (size_t i = 0; i < kDecompositionsSize; ++i) {
      one_level[kDecompositions[i].cp] = {kDecompositions[i].first, kDecompositions[i].second};
    }
    std::vector<char32_t> out;
    auto expand = [&](auto&& self, char32_t cp) -> void {
      auto it = one_level.find(cp);
      if (it == one_level.end()) {
        out.push_back(cp);
        return;
      }
      self(self, it->second.first);
      if (it->second.second != 0) self(self, it->second.second);
    };
    for (const auto& [cp, unused] : one_level) {
      out.clear();
      expand(expand, cp);
      d->decomposition[cp] = {static_cast<uint32_t>(d->chars.size()),
                              static_cast<uint32_t>(out.size())};
      d->chars.insert(d->chars.end(), out.begin(), out.end());
    }
    for (size_t i = 0; i < kCompositionsSize; ++i) {
      const Composition& c = kCompositions[i];
      d->composition[static_cast<uint64_t>(c.first) << 32 | c.second] = c.composite;
    }
    return d;
  }();
  return *data;
}

char32_t Compose(const NfcData& data, char32_t a, char32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount) {
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  }
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase &&
      b < kTBase + kTCount) {
    return a + (b - kTBase);
  }
  auto it = data.composition.find(static_cast<uint64_t>(a) << 32 | b);
  return it == data.composition.end() ? 0 : it->second;
}

}  // namespace

uint8_t Classes(char32_t cp) { return ClassTable().Get(cp); }

uint8_t CombiningClass(char32_t cp) { return CccTable().Get(cp); }

char32_t NextChar(absl::string_view s, size_t* i) {
  const auto b0 = static_cast<uint8_t>(s[*i]);
  if (b0 < 0x80) {
    ++*i;
    return b0;
  }
  const int len = b0 >= 0xF0 ? 4 : b0 >= 0xE0 ? 3 : 2;
  char32_t cp = b0 & (0x7F >> len);
  for (int k = 1; k < len; ++k) cp = cp << 6 | (static_cast<uint8_t>(s[*i + k]) & 0x3F);
  *i += len;
  return cp;
}

char32_t PrevChar(absl::string_view s, size_t* end) {
  size_t start = *end - 1;
  while (start > 0 && (static_cast<uint8_t>(s[start]) & 0xC0) == 0x80) --start;
  size_t i = start;
  const char32_t cp = NextChar(s, &i);
  *end = start;
  return cp;
}

void AppendUtf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | cp >> 6));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | cp >> 12));
    out->push_back(static_cast<char>(0x80 | (cp >> 6 & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | cp >> 18));
    out->push_back(static_cast<char>(0x80 | (cp >> 12 & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp >> 6 & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool IsValidUtf8(absl::string_view s) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const uint8_t b = p[i];
    if (b < 0x80) {
      ++i;
      continue;
    }
    // Well-formed sequences (Unicode Table 3-7): the lead byte bounds the second byte.
    int len;
    uint8_t lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) {
      len = 2;
    } else if (b >= 0xE0 && b <= 0xEF) {
      len = 3;
      if (b == 0xE0) lo = 0xA0;
      if (b == 0xED) hi = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
      len = 4;
      if (b == 0xF0) lo = 0x90;
      if (b == 0xF4) hi = 0x8F;
    } else {
      return false;
    }
    if (i + len > n || p[i + 1] < lo || p[i + 1] > hi) return false;
    for (int k = 2; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return false;
    }
    i += len;
  }
  return true;
}

std::string ToValidUtf8(absl::string_view s) {
  if (IsValidUtf8(s)) return std::string(s);
  std::string out;
  out.reserve(s.size());
  Utf8Assembler utf8;
  for (char c : s) out += utf8.Push(static_cast<uint8_t>(c));
  return out + utf8.Finish();
}

std::string Nfc(absl::string_view s) {
  // Below U+0300 nothing decomposes, combines or reorders: ASCII and Latin-1 pass unchanged.
  if (std::all_of(s.begin(), s.end(), [](char c) { return static_cast<uint8_t>(c) < 0xCC; })) {
    return std::string(s);
  }
  const NfcData& data = Nfc();
  // Full canonical decomposition.
  std::vector<char32_t> cps;
  cps.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const char32_t cp = NextChar(s, &i);
    if (cp >= kSBase && cp < kSBase + kSCount) {
      const char32_t index = cp - kSBase;
      cps.push_back(kLBase + index / kNCount);
      cps.push_back(kVBase + index % kNCount / kTCount);
      if (index % kTCount != 0) cps.push_back(kTBase + index % kTCount);
      continue;
    }
    auto it = data.decomposition.find(cp);
    if (it == data.decomposition.end()) {
      cps.push_back(cp);
    } else {
      cps.insert(cps.end(), data.chars.begin() + it->second.first,
                 data.chars.begin() + it->second.first + it->second.second);
    }
  }
  // Canonical ordering: a stable sort of each run of non-starters by combining class.
  for (size_t i = 0; i < cps.size();) {
    if (CombiningClass(cps[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < cps.size() && CombiningClass(cps[j]) != 0) ++j;
    std::stable_sort(cps.begin() + i, cps.begin() + j,
                     [](char32_t a, char32_t b) { return CombiningClass(a) < CombiningClass(b); });
    i = j;
  }
  // Canonical composition: each character joins the last starter unless blocked.
  size_t out = 0;
  size_t starter = 0;
  bool have_starter = false;
  int last_class = -1;  // class of the last character kept after the starter; -1: none
  for (size_t i = 0; i < cps.size(); ++i) {
    const char32_t cp = cps[i];
    const int cls = CombiningClass(cp);
    if (have_starter && (last_class == -1 || last_class < cls)) {
      if (const char32_t composite = Compose(data, cps[starter], cp); composite != 0) {
        cps[starter] = composite;
        continue;
      }
    }
    if (cls == 0) {
      starter = out;
      have_starter = true;
      last_class = -1;
    } else {
      last_class = cls;
    }
    cps[out++] = cp;
  }
  cps.resize(out);
  std::string result;
  result.reserve(s.size());
  for (char32_t cp : cps) AppendUtf8(cp, &result);
  return result;
}

}  // namespace relgen::unicode
