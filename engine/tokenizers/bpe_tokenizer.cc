// Byte-level BPE from a Hugging Face tokenizer.json (what is supported: bpe_tokenizer.h). The
// stages follow the `tokenizers` library's encode: added tokens are cut out of the raw text,
// then out of each normalized remainder; the pre-tokenizers split what is left; BPE merges each
// piece; the post-processor's template adds special tokens.
#include "engine/tokenizers/bpe_tokenizer.h"

#include <algorithm>
#include <array>
#include <bitset>
#include <cstdint>
#include <fstream>
#include <initializer_list>
#include <memory>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "engine/tokenizers/tokenizer.h"
#include "engine/tokenizers/unicode.h"
#include "nlohmann/json.hpp"

namespace relgen {
namespace bpe {
namespace {

enum Kind : uint8_t { kL, kN, kS, kO };  // letter, number, whitespace, other

// The characters of valid UTF-8 text with their byte offsets (starts[n] == text.size()).
struct Chars {
  std::vector<char32_t> cps;
  std::vector<uint32_t> starts;
};

Chars Decode(absl::string_view text) {
  Chars c;
  c.cps.reserve(text.size());
  c.starts.reserve(text.size() + 1);
  for (size_t i = 0; i < text.size();) {
    c.starts.push_back(static_cast<uint32_t>(i));
    c.cps.push_back(unicode::NextChar(text, &i));
  }
  c.starts.push_back(static_cast<uint32_t>(text.size()));
  return c;
}

Kind KindOf(char32_t cp) {
  const uint8_t cls = unicode::Classes(cp);
  if (cls & unicode::kLetter) return kL;
  if (cls & unicode::kNumber) return kN;
  if (cls & unicode::kSpace) return kS;
  return kO;
}

// Characters that BLOOM's class [^(\s|[.,!?…。，、।۔،])] leaves out.
bool BloomExcluded(char32_t cp) {
  switch (cp) {
    case '(':
    case '|':
    case ')':
    case '.':
    case ',':
    case '!':
    case '?':
    case 0x2026:
    case 0x3002:
    case 0xFF0C:
    case 0x3001:
    case 0x0964:
    case 0x06D4:
    case 0x060C:
      return true;
    default:
      return (unicode::Classes(cp) & unicode::kSpace) != 0;
  }
}

}  // namespace

std::vector<absl::string_view> SplitGpt2(absl::string_view text) {
  const Chars c = Decode(text);
  const size_t n = c.cps.size();
  std::vector<Kind> kind(n);
  for (size_t i = 0; i < n; ++i) kind[i] = KindOf(c.cps[i]);
  auto run = [&](size_t j, Kind k) {
    while (j < n && kind[j] == k) ++j;
    return j;
  };
  // The end of the match that starts at i; the alternatives are tried in the pattern's order.
  auto match = [&](size_t i) -> size_t {
    const char32_t cp = c.cps[i];
    if (cp == '\'' && i + 1 < n) {
      const char32_t a = c.cps[i + 1];
      if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
      if (i + 2 < n) {
        const char32_t b = c.cps[i + 2];
        if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l'))
          return i + 3;
      }
    }
    if (kind[i] != kS) return run(i + 1, kind[i]);  // \p{L}+, \p{N}+, [^\s\p{L}\p{N}]+
    if (cp == ' ' && i + 1 < n && kind[i + 1] != kS) return run(i + 2, kind[i + 1]);  // with ' '
    const size_t end = run(i + 1, kS);
    if (end == n) return n;            // \s+(?!\S) at the end
    if (end - i >= 2) return end - 1;  // \s+(?!\S) leaves the last one to the next piece
    return end;                        // \s+
  };
  std::vector<absl::string_view> pieces;
  for (size_t i = 0; i < n;) {
    const size_t end = match(i);
    pieces.push_back(text.substr(c.starts[i], c.starts[end] - c.starts[i]));
    i = end;
  }
  return pieces;
}

std::vector<absl::string_view> SplitBloom(absl::string_view text) {
  const Chars c = Decode(text);
  const size_t n = c.cps.size();
  std::vector<bool> excluded(n);
  for (size_t i = 0; i < n; ++i) excluded[i] = BloomExcluded(c.cps[i]);
  auto piece = [&](size_t from, size_t to) {
    return text.substr(c.starts[from], c.starts[to] - c.starts[from]);
  };
  std::vector<absl::string_view> pieces;
  size_t gap = 0;  // start of the stretch no match covers
  for (size_t i = 0; i < n;) {
    size_t end = i;
    if (c.cps[i] == ' ' && i + 1 < n && !excluded[i + 1]) {
      end = i + 1;
    } else if (excluded[i]) {
      ++i;
      continue;
    }
    while (end < n && !excluded[end]) ++end;
    if (gap < i) pieces.push_back(piece(gap, i));
    pieces.push_back(piece(i, end));
    i = gap = end;
  }
  if (gap < n) pieces.push_back(piece(gap, n));
  return pieces;
}

}  // namespace bpe

namespace {

using json = nlohmann::json;
constexpr char kBloomPattern[] = " ?[^(\\s|[.,!?…。，、।۔،])]+";

// ByteLevel's reversible map from bytes to printable characters: printable Latin-1 bytes stand
// for themselves, the others (controls, space, 0x7F..0xA0, 0xAD) for U+0100.. in byte order.
struct ByteLevelMap {
  std::array<std::string, 256> to_char;  // UTF-8
  std::array<int16_t, 0x144> to_byte;    // -1: not a byte's character
};

const ByteLevelMap& ByteMap() {
  static const ByteLevelMap* map = [] {
    auto* m = new ByteLevelMap;
    m->to_byte.fill(-1);
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const char32_t cp = printable ? b : next++;
      unicode::AppendUtf8(cp, &m->to_char[b]);
      m->to_byte[cp] = static_cast<int16_t>(b);
    }
    return m;
  }();
  return *map;
}

std::string ToByteLevel(absl::string_view s) {
  const ByteLevelMap& m = ByteMap();
  std::string out;
  out.reserve(s.size() * 2);
  for (char c : s) out += m.to_char[static_cast<uint8_t>(c)];
  return out;
}

// The bytes a token stands for: its characters mapped back through ByteLevel, or, when one of
// them is outside the map, the token's own UTF-8 (as the library's ByteLevel decoder does).
std::string FromByteLevel(absl::string_view token) {
  const ByteLevelMap& m = ByteMap();
  std::string out;
  for (size_t i = 0; i < token.size();) {
    const char32_t cp = unicode::NextChar(token, &i);
    if (cp >= m.to_byte.size() || m.to_byte[cp] < 0) return std::string(token);
    out.push_back(static_cast<char>(m.to_byte[cp]));
  }
  return out;
}

std::string Escaped(absl::string_view s) {
  if (unicode::IsValidUtf8(s)) return std::string(s);
  std::string out;
  for (char c : s) {
    const auto b = static_cast<uint8_t>(c);
    out += b < 0x80 ? std::string(1, c) : absl::StrFormat("\\x%02X", b);
  }
  return out;
}

// Lets string-keyed maps be searched with a string_view.
struct StringHash {
  using is_transparent = void;
  size_t operator()(absl::string_view s) const {
    return std::hash<std::string_view>()(std::string_view(s.data(), s.size()));
  }
};

struct AddedToken {
  std::string content;  // as matched: normalized when `normalized` is set
  int32_t id = 0;
  bool special = false, single_word = false, lstrip = false, rstrip = false, normalized = false;
};

// A byte trie of added-token contents for leftmost-longest matching.
class TokenTrie {
 public:
  TokenTrie() : terminal_(1, -1) {}
  void Add(absl::string_view s, int token) {
    uint32_t node = 0;
    for (char c : s) {
      auto [it, inserted] =
          edges_.try_emplace(Key(node, c), static_cast<uint32_t>(terminal_.size()));
      if (inserted) terminal_.push_back(-1);
      node = it->second;
    }
    terminal_[node] = token;
    first_.set(static_cast<uint8_t>(s[0]));
  }
  bool empty() const { return terminal_.size() == 1; }
  // The longest token starting at text[pos]: {length, token}, or {0, -1}.
  std::pair<size_t, int> Longest(absl::string_view text, size_t pos) const {
    std::pair<size_t, int> best{0, -1};
    if (!first_.test(static_cast<uint8_t>(text[pos]))) return best;
    uint32_t node = 0;
    for (size_t i = pos; i < text.size(); ++i) {
      auto it = edges_.find(Key(node, text[i]));
      if (it == edges_.end()) break;
      node = it->second;
      if (terminal_[node] >= 0) best = {i + 1 - pos, terminal_[node]};
    }
    return best;
  }

 private:
  static uint64_t Key(uint32_t node, char c) {
    return static_cast<uint64_t>(node) << 8 | static_cast<uint8_t>(c);
  }
  std::unordered_map<uint64_t, uint32_t> edges_;
  std::vector<int> terminal_;  // token index at each node, -1 for none
  std::bitset<256> first_;
};

// Merge ranks by pair of ids: open addressing with linear probing, the hot lookup of BPE.
class MergeTable {
 public:
  struct Entry {
    uint32_t rank;
    int32_t new_id;
  };
  // Sets the entry of `key` (a later merge of the same pair replaces an earlier one).
  void Set(uint64_t key, Entry e) {
    if ((size_ + 1) * 2 > keys_.size()) Grow();
    size_t i = Slot(key);
    while (keys_[i] != kEmpty && keys_[i] != key) i = (i + 1) & (keys_.size() - 1);
    if (keys_[i] == kEmpty) ++size_;
    keys_[i] = key;
    values_[i] = e;
  }
  const Entry* Find(uint64_t key) const {
    if (keys_.empty()) return nullptr;
    for (size_t i = Slot(key);; i = (i + 1) & (keys_.size() - 1)) {
      if (keys_[i] == key) return &values_[i];
      if (keys_[i] == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};  // ids are below 2^31: never a key
  size_t Slot(uint64_t key) const {
    return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_);
  }
  void Grow() {
    std::vector<uint64_t> keys = std::move(keys_);
    std::vector<Entry> values = std::move(values_);
    const size_t capacity = keys.empty() ? 64 : keys.size() * 2;
    keys_.assign(capacity, kEmpty);
    values_.assign(capacity, Entry{});
    shift_ = 64 - __builtin_ctzll(capacity);
    size_ = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i] != kEmpty) Set(keys[i], values[i]);
    }
  }
  std::vector<uint64_t> keys_;
  std::vector<Entry> values_;
  size_t size_ = 0;
  int shift_ = 64;
};

struct PreTokenizerStep {
  enum Type { kByteLevel, kBloomSplit } type;
  bool add_prefix_space = false;
  bool use_regex = true;
};

// A piece of text on its way through encoding; id >= 0 once it is an added token.
struct Piece {
  absl::string_view text;
  int32_t id;
};

class BpeTokenizer;

class BpeStream final : public StreamDecoder {
 public:
  BpeStream(const BpeTokenizer* tok, bool keep_special) : tok_(tok), keep_special_(keep_special) {}
  std::string Push(int32_t id) override;
  std::string Finish() override { return utf8_.Finish(); }

 private:
  const BpeTokenizer* tok_;
  bool keep_special_;
  Utf8Assembler utf8_;
};

class BpeTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> Encode(absl::string_view raw) const override {
    std::vector<int32_t> ids;
    const std::string text = unicode::ToValidUtf8(raw);
    std::vector<Piece> outer, inner;
    FindAdded(text, raw_trie_, &outer);
    for (const Piece& p : outer) {
      if (p.id >= 0) {
        ids.push_back(p.id);
        continue;
      }
      const std::string normalized = Normalize(p.text);
      inner.clear();
      FindAdded(normalized, normalized_trie_, &inner);
      for (const Piece& q : inner) {
        if (q.id >= 0) {
          ids.push_back(q.id);
        } else {
          EncodeText(q.text, &ids);
        }
      }
    }
    if (!has_template_) return ids;
    std::vector<int32_t> out;
    out.reserve(ids.size() + 8);
    for (const auto& item : template_) {
      if (item.empty()) {
        out.insert(out.end(), ids.begin(), ids.end());
      } else {
        out.insert(out.end(), item.begin(), item.end());
      }
    }
    return out;
  }

  std::unique_ptr<StreamDecoder> NewStream() const override { return std::make_unique<BpeStream>(this, false); }
  std::unique_ptr<StreamDecoder> NewStreamWithSpecials() const override {
    return std::make_unique<BpeStream>(this, true);
  }

  std::string TokenText(int32_t id) const override {
    if (id < 0 || id >= static_cast<int32_t>(display_.size()) || !known_[id]) {
      return absl::StrCat("<", id, ">");
    }
    return display_[id];
  }

  // What decoding `id` contributes (empty for unknown ids, and for special tokens unless kept).
  absl::string_view Bytes(int32_t id, bool keep_special) const {
    if (id < 0 || id >= static_cast<int32_t>(bytes_.size())) return {};
    return keep_special && !special_bytes_[id].empty() ? special_bytes_[id] : bytes_[id];
  }

 private:
  friend class Loader;

  // The library's AddedVocabulary split: leftmost-longest matches, each kept or dropped by
  // single_word, widened over whitespace by lstrip / rstrip; the text between them stays text.
  void FindAdded(absl::string_view s, const TokenTrie& trie, std::vector<Piece>* out) const {
    if (s.empty()) return;
    if (trie.empty()) {
      out->push_back({s, -1});
      return;
    }
    size_t start_offset = 0;
    for (size_t pos = 0; pos < s.size();) {
      const auto [len, index] = trie.Longest(s, pos);
      if (len == 0) {
        ++pos;
        continue;
      }
      size_t start = pos, stop = pos + len;
      pos = stop;  // the search resumes after the match, whatever stripping takes
      const AddedToken& t = added_[index];
      if (t.single_word) {
        size_t before = start, after = stop;
        const bool word_before =
            start > 0 && (unicode::Classes(unicode::PrevChar(s, &before)) & unicode::kWord);
        const bool word_after =
            stop < s.size() && (unicode::Classes(unicode::NextChar(s, &after)) & unicode::kWord);
        if (word_before || word_after) continue;
      }
      if (t.lstrip) {
        size_t new_start = start;
        while (new_start > 0) {
          size_t prev = new_start;
          if (!(unicode::Classes(unicode::PrevChar(s, &prev)) & unicode::kSpace)) break;
          new_start = prev;
        }
        start = std::max(new_start, start_offset);
      }
      if (t.rstrip) {
        while (stop < s.size()) {
          size_t next = stop;
          if (!(unicode::Classes(unicode::NextChar(s, &next)) & unicode::kSpace)) break;
          stop = next;
        }
      }
      start = std::min(start, stop);  // only whitespace tokens after an rstrip can overlap
      if (start > start_offset) out->push_back({s.substr(start_offset, start - start_offset), -1});
      out->push_back({s.substr(start, stop - start), t.id});
      start_offset = stop;
    }
    if (start_offset < s.size()) out->push_back({s.substr(start_offset), -1});
  }

  std::string Normalize(absl::string_view s) const {
    std::string out(s);
    for (int i = 0; i < nfc_count_; ++i) out = unicode::Nfc(out);
    return out;
  }

  void EncodeText(absl::string_view text, std::vector<int32_t>* ids) const {
    std::vector<std::string> pieces{std::string(text)}, next;
    for (const PreTokenizerStep& step : pre_tokenizers_) {
      next.clear();
      for (std::string& piece : pieces) {
        if (step.type == PreTokenizerStep::kBloomSplit) {
          for (absl::string_view p : bpe::SplitBloom(piece)) next.emplace_back(p);
          continue;
        }
        if (step.add_prefix_space && piece[0] != ' ') piece.insert(0, " ");
        if (!step.use_regex) {
          next.push_back(ToByteLevel(piece));
          continue;
        }
        for (absl::string_view p : bpe::SplitGpt2(piece)) next.push_back(ToByteLevel(p));
      }
      pieces.swap(next);
    }
    Scratch scratch;
    for (const std::string& piece : pieces) {
      if (!piece.empty()) Merge(piece, &scratch, ids);
    }
  }

  // Reused across the pre-tokens of one Encode call.
  struct Symbol {
    int32_t id;
    int32_t prev, next;
    bool alive;
  };
  struct Candidate {
    uint32_t rank;
    int32_t pos;
    int32_t new_id;
  };
  struct Scratch {
    std::vector<Symbol> symbols;
    std::vector<Candidate> heap;
  };

  int32_t CharId(absl::string_view ch, char32_t cp) const {
    if (cp < small_char_id_.size()) return small_char_id_[cp];
    auto it = vocab_.find(ch);
    return it == vocab_.end() ? -1 : it->second;
  }

  // BPE of one pre-token: its characters, then the lowest-ranked merge first (leftmost on ties),
  // with a heap of candidate pairs checked against the current symbols when they come up.
  void Merge(absl::string_view word, Scratch* scratch, std::vector<int32_t>* ids) const {
    if (ignore_merges_) {
      if (auto it = vocab_.find(word); it != vocab_.end()) {
        ids->push_back(it->second);
        return;
      }
    }
    std::vector<Symbol>& symbols = scratch->symbols;
    symbols.clear();
    bool last_is_unk = false;  // the last symbol is an unknown-character run (for fuse_unk)
    for (size_t i = 0; i < word.size();) {
      const size_t start = i;
      const char32_t cp = unicode::NextChar(word, &i);
      if (const int32_t id = CharId(word.substr(start, i - start), cp); id >= 0) {
        symbols.push_back({id, 0, 0, true});
        last_is_unk = false;
      } else if (unk_id_ >= 0) {
        // Without an unk token the library drops the character.
        if (!(fuse_unk_ && last_is_unk)) symbols.push_back({unk_id_, 0, 0, true});
        last_is_unk = true;
      }
    }
    const auto n = static_cast<int32_t>(symbols.size());
    for (int32_t i = 0; i < n; ++i) {
      symbols[i].prev = i - 1;
      symbols[i].next = i + 1 < n ? i + 1 : -1;
    }
    std::vector<Candidate>& heap = scratch->heap;
    heap.clear();
    auto later = [](const Candidate& a, const Candidate& b) {
      return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
    };
    auto consider = [&](int32_t pos) {
      const int32_t next = symbols[pos].next;
      if (next < 0) return;
      if (const MergeTable::Entry* m = merges_.Find(PairKey(symbols[pos].id, symbols[next].id))) {
        heap.push_back({m->rank, pos, m->new_id});
        std::push_heap(heap.begin(), heap.end(), later);
      }
    };
    for (int32_t i = 0; i + 1 < n; ++i) consider(i);
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), later);
      const Candidate top = heap.back();
      heap.pop_back();
      Symbol& left = symbols[top.pos];
      if (!left.alive || left.next < 0) continue;
      Symbol& right = symbols[left.next];
      const MergeTable::Entry* m = merges_.Find(PairKey(left.id, right.id));
      if (m == nullptr || m->new_id != top.new_id) continue;  // stale
      left.id = top.new_id;
      right.alive = false;
      left.next = right.next;
      if (left.next >= 0) symbols[left.next].prev = top.pos;
      if (left.prev >= 0) consider(left.prev);
      consider(top.pos);
    }
    for (const Symbol& sym : symbols) {
      if (sym.alive) ids->push_back(sym.id);
    }
  }

  static uint64_t PairKey(int32_t a, int32_t b) {
    return static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32 | static_cast<uint32_t>(b);
  }

  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> vocab_;
  MergeTable merges_;
  std::array<int32_t, 0x144> small_char_id_;  // ids of the one-character tokens below U+0144
  int32_t unk_id_ = -1;
  bool fuse_unk_ = false;
  bool ignore_merges_ = false;
  std::vector<AddedToken> added_;
  TokenTrie raw_trie_, normalized_trie_;
  int nfc_count_ = 0;  // NFC is idempotent, but a Sequence may name it more than once
  std::vector<PreTokenizerStep> pre_tokenizers_;
  bool has_template_ = false;
  std::vector<std::vector<int32_t>> template_;  // special-token ids; empty for the sequence
  std::vector<std::string> bytes_;              // per id: what decoding emits
  // Per id: a special token's bytes, decoded as the byte-level decoder decodes any token (its
  // bytes join the stream's, so an unfinished character before it becomes U+FFFD).
  std::vector<std::string> special_bytes_;
  std::vector<std::string> display_;            // per id: TokenText
  std::vector<bool> known_;                     // per id: in the vocabulary or added
};

std::string BpeStream::Push(int32_t id) {
  std::string out;
  for (char c : tok_->Bytes(id, keep_special_)) out += utf8_.Push(static_cast<uint8_t>(c));
  return out;
}

// Reads tokenizer.json into a BpeTokenizer, refusing what it does not support.
class Loader {
 public:
  Loader(std::string file, int vocab_size) : file_(std::move(file)), vocab_size_(vocab_size) {}

  absl::StatusOr<std::unique_ptr<Tokenizer>> Load() {
    std::ifstream in(file_, std::ios::binary);
    if (!in) return absl::InvalidArgumentError(absl::StrCat("cannot read tokenizer file ", file_));
    std::stringstream ss;
    ss << in.rdbuf();
    const json root = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
    if (root.is_discarded()) {
      return absl::InvalidArgumentError(absl::StrCat(file_, ": not valid JSON"));
    }
    tok_ = std::make_unique<BpeTokenizer>();
    if (absl::Status s = LoadAll(root); !s.ok()) return s;
    return std::unique_ptr<Tokenizer>(std::move(tok_));
  }

 private:
  absl::Status Refuse(absl::string_view path, absl::string_view found,
                      absl::string_view supported) const {
    return absl::InvalidArgumentError(
        absl::StrCat(file_, ": ", path, ": found ", found, "; supported: ", supported));
  }
  static std::string Show(const json& j) {
    std::string s = j.dump();
    if (s.size() > 80) s = s.substr(0, 77) + "...";
    return s;
  }
  // A JSON value found (a template, so strings never convert to JSON).
  template <typename J, std::enable_if_t<std::is_same_v<J, json>, int> = 0>
  absl::Status Refuse(absl::string_view path, const J& found, absl::string_view supported) const {
    return Refuse(path, Show(found), supported);
  }

  absl::Status Object(const json& j, absl::string_view path,
                      std::initializer_list<const char*> keys) const {
    if (!j.is_object()) return Refuse(path, j, "an object");
    for (auto it = j.begin(); it != j.end(); ++it) {
      const std::string& key = it.key();
      if (std::find_if(keys.begin(), keys.end(), [&](const char* k) { return key == k; }) ==
          keys.end()) {
        return Refuse(absl::StrCat(path, ".", key), "an unknown key",
                      absl::StrCat("the keys ", absl::StrJoin(keys, ", ")));
      }
    }
    return absl::OkStatus();
  }

  // A boolean member; `fallback` when missing (-1: required).
  absl::Status Bool(const json& obj, absl::string_view path, const char* key, int fallback,
                    bool* out) const {
    const std::string where = absl::StrCat(path, ".", key);
    if (!obj.contains(key)) {
      if (fallback < 0) return Refuse(where, "nothing (the key is missing)", "true or false");
      *out = fallback != 0;
      return absl::OkStatus();
    }
    if (!obj[key].is_boolean()) return Refuse(where, obj[key], "true or false");
    *out = obj[key].get<bool>();
    return absl::OkStatus();
  }

  // A member that must be absent, null or `allowed`.
  absl::Status NullOr(const json& obj, absl::string_view path, const char* key, const json& allowed,
                      absl::string_view supported) const {
    if (!obj.contains(key) || obj[key].is_null() || obj[key] == allowed) return absl::OkStatus();
    return Refuse(absl::StrCat(path, ".", key), obj[key], supported);
  }

  absl::Status Id(const json& j, absl::string_view path, int32_t* out) const {
    if (!j.is_number_integer() || j.get<int64_t>() < 0 || j.get<int64_t>() > INT32_MAX) {
      return Refuse(path, j, "a token id (an integer from 0 to 2^31-1)");
    }
    *out = static_cast<int32_t>(j.get<int64_t>());
    return absl::OkStatus();
  }

  absl::Status Type(const json& j, absl::string_view path, std::string* type,
                    absl::string_view supported) const {
    if (!j.is_object()) return Refuse(path, j, supported);
    if (!j.contains("type") || !j["type"].is_string()) {
      return Refuse(absl::StrCat(path, ".type"), j.contains("type") ? Show(j["type"]) : "nothing",
                    supported);
    }
    *type = j["type"].get<std::string>();
    return absl::OkStatus();
  }

  absl::Status LoadAll(const json& root) {
    if (absl::Status s = Object(root, "(top level)",
                                {"version", "truncation", "padding", "added_tokens", "normalizer",
                                 "pre_tokenizer", "post_processor", "decoder", "model"});
        !s.ok()) {
      return s;
    }
    for (const char* key : {"truncation", "padding"}) {
      if (root.contains(key) && !root[key].is_null()) {
        return Refuse(key, root[key], absl::StrCat("null (no ", key, ")"));
      }
    }
    if (!root.contains("model")) return Refuse("model", "nothing", "a BPE model");
    if (absl::Status s = LoadModel(root["model"]); !s.ok()) return s;
    if (root.contains("normalizer")) {
      if (absl::Status s = LoadNormalizer(root["normalizer"], "normalizer"); !s.ok()) return s;
    }
    if (!root.contains("pre_tokenizer") || root["pre_tokenizer"].is_null()) {
      return Refuse("pre_tokenizer", "null", "ByteLevel, Split (BLOOM's pattern), Sequence");
    }
    if (absl::Status s = LoadPreTokenizer(root["pre_tokenizer"], "pre_tokenizer"); !s.ok()) {
      return s;
    }
    if (root.contains("added_tokens")) {
      if (absl::Status s = LoadAddedTokens(root["added_tokens"]); !s.ok()) return s;
    }
    if (root.contains("post_processor") && !root["post_processor"].is_null()) {
      if (absl::Status s = LoadPostProcessor(root["post_processor"]); !s.ok()) return s;
    }
    if (!root.contains("decoder")) return Refuse("decoder", "nothing", "ByteLevel");
    std::string type;
    const json& decoder = root["decoder"];
    if (absl::Status s = Type(decoder, "decoder", &type, "ByteLevel"); !s.ok()) return s;
    if (type != "ByteLevel") return Refuse("decoder.type", decoder["type"], "ByteLevel");
    if (absl::Status s = ByteLevelFields(decoder, "decoder", nullptr, nullptr); !s.ok()) return s;
    return Finish();
  }

  absl::Status LoadModel(const json& model) {
    if (absl::Status s = Object(
            model, "model",
            {"type", "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix",
             "fuse_unk", "byte_fallback", "ignore_merges", "vocab", "merges"});
        !s.ok()) {
      return s;
    }
    if (model.contains("type") && model["type"] != "BPE") {
      return Refuse("model.type", model["type"], "BPE");
    }
    if (absl::Status s = NullOr(model, "model", "dropout", nullptr, "null (no dropout)"); !s.ok()) {
      return s;
    }
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      if (absl::Status s = NullOr(model, "model", key, "", "null or \"\""); !s.ok()) return s;
    }
    bool byte_fallback = false;
    if (absl::Status s = Bool(model, "model", "byte_fallback", 0, &byte_fallback); !s.ok())
      return s;
    if (byte_fallback) return Refuse("model.byte_fallback", "true", "false");
    if (absl::Status s = Bool(model, "model", "fuse_unk", 0, &tok_->fuse_unk_); !s.ok()) return s;
    if (absl::Status s = Bool(model, "model", "ignore_merges", 0, &tok_->ignore_merges_); !s.ok()) {
      return s;
    }
    if (!model.contains("vocab") || !model["vocab"].is_object()) {
      return Refuse("model.vocab", model.contains("vocab") ? Show(model["vocab"]) : "nothing",
                    "an object of token -> id");
    }
    std::unordered_map<int32_t, std::string> by_id;
    for (const auto& [token, id_json] : model["vocab"].items()) {
      int32_t id;
      const std::string where = absl::StrCat("model.vocab[", json(token).dump(), "]");
      if (absl::Status s = Id(id_json, where, &id); !s.ok()) return s;
      if (auto [it, inserted] = by_id.try_emplace(id, token); !inserted) {
        return Refuse(where,
                      absl::StrCat("id ", id, ", which ", json(it->second).dump(), " has too"),
                      "one token per id");
      }
      tok_->vocab_[token] = id;
      Define(id, token);
    }
    if (model.contains("unk_token") && !model["unk_token"].is_null()) {
      const json& unk = model["unk_token"];
      if (!unk.is_string() || !tok_->vocab_.contains(unk.get<std::string>())) {
        return Refuse("model.unk_token", unk, "null or a token of the vocabulary");
      }
      tok_->unk_id_ = tok_->vocab_[unk.get<std::string>()];
    }
    if (!model.contains("merges") || !model["merges"].is_array()) {
      return Refuse("model.merges", model.contains("merges") ? Show(model["merges"]) : "nothing",
                    "a list of merges");
    }
    const json& merges = model["merges"];
    for (size_t rank = 0; rank < merges.size(); ++rank) {
      const json& m = merges[rank];
      const std::string where = absl::StrCat("model.merges[", rank, "]");
      std::string a, b;
      if (m.is_string()) {
        const std::string line = m.get<std::string>();
        const size_t space = line.find(' ');
        if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
          return Refuse(where, m, "\"a b\" (two tokens and one space) or [\"a\", \"b\"]");
        }
        a = line.substr(0, space);
        b = line.substr(space + 1);
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        a = m[0].get<std::string>();
        b = m[1].get<std::string>();
      } else {
        return Refuse(where, m, "\"a b\" or [\"a\", \"b\"]");
      }
      auto ia = tok_->vocab_.find(a), ib = tok_->vocab_.find(b), iab = tok_->vocab_.find(a + b);
      if (ia == tok_->vocab_.end() || ib == tok_->vocab_.end() || iab == tok_->vocab_.end()) {
        return Refuse(where, m, "merges of two vocabulary tokens whose concatenation is one too");
      }
      // A repeated pair takes its last rank, as in the library's map.
      tok_->merges_.Set(BpeTokenizer::PairKey(ia->second, ib->second),
                        {static_cast<uint32_t>(rank), iab->second});
    }
    return absl::OkStatus();
  }

  absl::Status LoadNormalizer(const json& n, const std::string& path) {
    if (n.is_null()) return absl::OkStatus();
    constexpr absl::string_view kSupported = "null, NFC, Sequence (of those)";
    std::string type;
    if (absl::Status s = Type(n, path, &type, kSupported); !s.ok()) return s;
    if (type == "NFC") {
      ++tok_->nfc_count_;
      return Object(n, path, {"type"});
    }
    if (type == "Sequence") {
      if (absl::Status s = Object(n, path, {"type", "normalizers"}); !s.ok()) return s;
      if (!n.contains("normalizers") || !n["normalizers"].is_array()) {
        return Refuse(path + ".normalizers", "no list", "a list of normalizers");
      }
      for (size_t i = 0; i < n["normalizers"].size(); ++i) {
        const std::string where = absl::StrCat(path, ".normalizers[", i, "]");
        if (n["normalizers"][i].is_null()) return Refuse(where, "null", kSupported);
        if (absl::Status s = LoadNormalizer(n["normalizers"][i], where); !s.ok()) return s;
      }
      return absl::OkStatus();
    }
    return Refuse(path + ".type", n["type"], kSupported);
  }

  absl::Status ByteLevelFields(const json& j, const std::string& path, bool* add_prefix_space,
                               bool* use_regex) const {
    if (absl::Status s = Object(j, path, {"type", "add_prefix_space", "trim_offsets", "use_regex"});
        !s.ok()) {
      return s;
    }
    bool unused;
    if (absl::Status s =
            Bool(j, path, "add_prefix_space", -1, add_prefix_space ? add_prefix_space : &unused);
        !s.ok()) {
      return s;
    }
    if (absl::Status s = Bool(j, path, "trim_offsets", -1, &unused); !s.ok()) return s;
    return Bool(j, path, "use_regex", 1, use_regex ? use_regex : &unused);
  }

  absl::Status LoadPreTokenizer(const json& p, const std::string& path) {
    constexpr absl::string_view kSupported = "ByteLevel, Split (BLOOM's pattern), Sequence";
    std::string type;
    if (absl::Status s = Type(p, path, &type, kSupported); !s.ok()) return s;
    if (type == "ByteLevel") {
      PreTokenizerStep step{PreTokenizerStep::kByteLevel};
      if (absl::Status s = ByteLevelFields(p, path, &step.add_prefix_space, &step.use_regex);
          !s.ok()) {
        return s;
      }
      tok_->pre_tokenizers_.push_back(step);
      return absl::OkStatus();
    }
    if (type == "Split") {
      if (absl::Status s = Object(p, path, {"type", "pattern", "behavior", "invert"}); !s.ok()) {
        return s;
      }
      const json pattern = p.contains("pattern") ? p["pattern"] : json();
      if (!(pattern.is_object() && pattern.size() == 1 && pattern.contains("Regex") &&
            pattern["Regex"] == kBloomPattern)) {
        return Refuse(path + ".pattern", pattern,
                      absl::StrCat("{\"Regex\": ", json(kBloomPattern).dump(), "} (BLOOM's)"));
      }
      if (!p.contains("behavior") || p["behavior"] != "Isolated") {
        return Refuse(path + ".behavior", p.contains("behavior") ? Show(p["behavior"]) : "nothing",
                      "\"Isolated\"");
      }
      bool invert = false;
      if (absl::Status s = Bool(p, path, "invert", 0, &invert); !s.ok()) return s;
      if (invert) return Refuse(path + ".invert", "true", "false");
      tok_->pre_tokenizers_.push_back({PreTokenizerStep::kBloomSplit});
      return absl::OkStatus();
    }
    if (type == "Sequence") {
      if (absl::Status s = Object(p, path, {"type", "pretokenizers"}); !s.ok()) return s;
      if (!p.contains("pretokenizers") || !p["pretokenizers"].is_array()) {
        return Refuse(path + ".pretokenizers", "no list", "a list of pre-tokenizers");
      }
      for (size_t i = 0; i < p["pretokenizers"].size(); ++i) {
        if (absl::Status s = LoadPreTokenizer(p["pretokenizers"][i],
                                              absl::StrCat(path, ".pretokenizers[", i, "]"));
            !s.ok()) {
          return s;
        }
      }
      return absl::OkStatus();
    }
    return Refuse(path + ".type", p["type"], kSupported);
  }

  absl::Status LoadAddedTokens(const json& list) {
    if (!list.is_array()) return Refuse("added_tokens", list, "a list of added tokens");
    std::unordered_set<std::string> contents;
    for (size_t i = 0; i < list.size(); ++i) {
      const json& t = list[i];
      const std::string path = absl::StrCat("added_tokens[", i, "]");
      if (absl::Status s =
              Object(t, path,
                     {"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"});
          !s.ok()) {
        return s;
      }
      AddedToken a;
      if (absl::Status s = Id(t.contains("id") ? t["id"] : json(), path + ".id", &a.id); !s.ok()) {
        return s;
      }
      if (!t.contains("content") || !t["content"].is_string() ||
          t["content"].get<std::string>().empty()) {
        return Refuse(path + ".content", t.contains("content") ? Show(t["content"]) : "nothing",
                      "a non-empty string");
      }
      const std::string content = t["content"].get<std::string>();
      if (!contents.insert(content).second) {
        return Refuse(path + ".content", t["content"], "each content once");
      }
      for (auto [key, field] : {std::pair{"single_word", &a.single_word},
                                {"lstrip", &a.lstrip},
                                {"rstrip", &a.rstrip},
                                {"normalized", &a.normalized},
                                {"special", &a.special}}) {
        if (absl::Status s = Bool(t, path, key, -1, field); !s.ok()) return s;
      }
      // Normalized tokens are looked for in normalized text, so their content is normalized too.
      a.content = a.normalized ? tok_->Normalize(content) : content;
      (a.normalized ? tok_->normalized_trie_ : tok_->raw_trie_)
          .Add(a.content, static_cast<int>(tok_->added_.size()));
      Define(a.id, content);
      if (a.special) special_.insert(content);
      tok_->added_.push_back(std::move(a));
    }
    return absl::OkStatus();
  }

  absl::Status LoadPostProcessor(const json& p) {
    constexpr absl::string_view kSupported = "null, ByteLevel, TemplateProcessing";
    std::string type;
    if (absl::Status s = Type(p, "post_processor", &type, kSupported); !s.ok()) return s;
    if (type == "ByteLevel") return ByteLevelFields(p, "post_processor", nullptr, nullptr);
    if (type != "TemplateProcessing") return Refuse("post_processor.type", p["type"], kSupported);
    if (absl::Status s = Object(p, "post_processor", {"type", "single", "pair", "special_tokens"});
        !s.ok()) {
      return s;
    }
    const json specials = p.contains("special_tokens") ? p["special_tokens"] : json();
    if (!specials.is_object()) {
      return Refuse("post_processor.special_tokens", specials, "an object of name -> ids");
    }
    const json single = p.contains("single") ? p["single"] : json();
    if (!single.is_array()) return Refuse("post_processor.single", single, "a template list");
    tok_->has_template_ = true;
    bool has_sequence = false;
    for (size_t i = 0; i < single.size(); ++i) {
      const json& item = single[i];
      const std::string path = absl::StrCat("post_processor.single[", i, "]");
      constexpr absl::string_view kItems =
          "{\"Sequence\": {\"id\": \"A\", ...}} or {\"SpecialToken\": {\"id\": NAME, ...}}";
      if (!item.is_object() || item.size() != 1) return Refuse(path, item, kItems);
      if (item.contains("Sequence")) {
        const json& seq = item["Sequence"];
        if (!seq.is_object() || !seq.contains("id") || seq["id"] != "A" || has_sequence) {
          return Refuse(path, item, "one sequence, A, in the single template");
        }
        has_sequence = true;
        tok_->template_.emplace_back();
        continue;
      }
      if (!item.contains("SpecialToken") || !item["SpecialToken"].is_object() ||
          !item["SpecialToken"].contains("id") || !item["SpecialToken"]["id"].is_string()) {
        return Refuse(path, item, kItems);
      }
      const std::string name = item["SpecialToken"]["id"].get<std::string>();
      if (!specials.contains(name) || !specials[name].is_object() ||
          !specials[name].contains("ids") || !specials[name]["ids"].is_array() ||
          specials[name]["ids"].empty()) {
        return Refuse(absl::StrCat("post_processor.special_tokens[", json(name).dump(), "]"),
                      specials.contains(name) ? Show(specials[name]) : "nothing",
                      "an entry with a non-empty list of ids");
      }
      std::vector<int32_t> ids;
      for (const json& id_json : specials[name]["ids"]) {
        int32_t id;
        if (absl::Status s =
                Id(id_json,
                   absl::StrCat("post_processor.special_tokens[", json(name).dump(), "].ids"), &id);
            !s.ok()) {
          return s;
        }
        max_id_ = std::max(max_id_, id);
        ids.push_back(id);
      }
      tok_->template_.push_back(std::move(ids));
    }
    if (!has_sequence) return Refuse("post_processor.single", single, "a template with $A");
    return absl::OkStatus();
  }

  // Records the text of token `id`; an added token's content overrides the vocabulary's.
  void Define(int32_t id, const std::string& token) {
    max_id_ = std::max(max_id_, id);
    tokens_[id] = token;
  }

  absl::Status Finish() {
    if (max_id_ >= vocab_size_) {
      return absl::InvalidArgumentError(absl::StrCat(
          file_, ": the largest token id is ", max_id_, ", not below the model's vocab_size ",
          vocab_size_, " (the tokenizer may have fewer ids than the model, not more)"));
    }
    for (char32_t cp = 0; cp < tok_->small_char_id_.size(); ++cp) {
      std::string ch;
      unicode::AppendUtf8(cp, &ch);
      auto it = tok_->vocab_.find(ch);
      tok_->small_char_id_[cp] = it == tok_->vocab_.end() ? -1 : it->second;
    }
    const size_t size = static_cast<size_t>(max_id_ + 1);
    tok_->bytes_.assign(size, "");
    tok_->special_bytes_.assign(size, "");
    tok_->display_.assign(size, "");
    tok_->known_.assign(size, false);
    for (const auto& [id, token] : tokens_) {
      tok_->known_[id] = true;
      // Decoding skips special tokens, or whatever id has a special token's text.
      if (special_.contains(token)) {
        tok_->display_[id] = Escaped(token);
        tok_->special_bytes_[id] = FromByteLevel(token);
        continue;
      }
      tok_->bytes_[id] = FromByteLevel(token);
      tok_->display_[id] = Escaped(tok_->bytes_[id]);
    }
    return absl::OkStatus();
  }

  std::string file_;
  int vocab_size_;
  std::unique_ptr<BpeTokenizer> tok_;
  int32_t max_id_ = -1;
  std::unordered_map<int32_t, std::string> tokens_;  // id -> token text (added ones last)
  std::unordered_set<std::string> special_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> NewBpeTokenizer(const std::string& path,
                                                           int vocab_size) {
  return Loader(path, vocab_size).Load();
}

}  // namespace relgen
