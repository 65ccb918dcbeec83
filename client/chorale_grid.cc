#include "client/chorale_grid.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <map>
#include <tuple>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace relgen::client::grid {
namespace {

constexpr const char* kVoiceNames[kVoices] = {"soprano", "alto", "tenor", "bass"};
constexpr char kVoiceLetters[kVoices] = {'S', 'A', 'T', 'B'};

// A file's bytes, read with bounds checks: a truncated or lying length is an error, never a read past
// the end.
class Reader {
 public:
  Reader(const std::string& bytes, size_t begin, size_t end) : b_(bytes), pos_(begin), end_(end) {}
  bool done() const { return pos_ >= end_; }
  size_t pos() const { return pos_; }
  bool Byte(uint8_t* v) {
    if (pos_ >= end_) return false;
    *v = static_cast<uint8_t>(b_[pos_++]);
    return true;
  }
  bool Peek(uint8_t* v) const {
    if (pos_ >= end_) return false;
    *v = static_cast<uint8_t>(b_[pos_]);
    return true;
  }
  bool BigEndian(int n, uint32_t* v) {
    *v = 0;
    for (int i = 0; i < n; ++i) {
      uint8_t c;
      if (!Byte(&c)) return false;
      *v = (*v << 8) | c;
    }
    return true;
  }
  // A variable-length quantity: at most 4 bytes (28 bits), as the format allows.
  bool VarLen(uint32_t* v) {
    *v = 0;
    for (int i = 0; i < 4; ++i) {
      uint8_t c;
      if (!Byte(&c)) return false;
      *v = (*v << 7) | (c & 0x7f);
      if ((c & 0x80) == 0) return true;
    }
    return false;
  }
  bool Skip(uint32_t n) {
    if (n > end_ - pos_) return false;
    pos_ += n;
    return true;
  }

 private:
  const std::string& b_;
  size_t pos_, end_;
};

struct TickNote {
  int64_t start, end;
  int midi;
  bool operator<(const TickNote& o) const { return std::tie(start, end, midi) < std::tie(o.start, o.end, o.midi); }
};

// One track's notes by channel.
absl::StatusOr<std::map<int, std::vector<TickNote>>> TrackNotes(Reader r, int track) {
  std::map<int, std::vector<TickNote>> notes;
  std::map<std::pair<int, int>, int64_t> sounding;  // (channel, note) -> start tick
  int64_t now = 0;
  uint8_t running = 0;
  auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("MIDI track ", track, " at byte ", r.pos(), ": ", what));
  };
  while (!r.done()) {
    uint32_t delta;
    if (!r.VarLen(&delta)) return bad("a truncated delta time");
    now += delta;
    uint8_t status;
    if (!r.Peek(&status)) return bad("an event missing after its delta time");
    if (status & 0x80) {
      r.Byte(&status);
    } else if (running != 0) {
      status = running;  // running status: the data bytes follow at once
    } else {
      return bad("a data byte with no status before it");
    }
    if (status == 0xff) {
      uint8_t type;
      uint32_t len;
      if (!r.Byte(&type) || !r.VarLen(&len) || !r.Skip(len)) return bad("a truncated meta event");
      if (type == 0x2f) break;  // end of track
      continue;
    }
    if (status == 0xf0 || status == 0xf7) {
      uint32_t len;
      if (!r.VarLen(&len) || !r.Skip(len)) return bad("a truncated system exclusive event");
      continue;
    }
    if (status >= 0xf0) return bad(absl::StrCat("an unexpected system event 0x", absl::Hex(status)));
    running = status;
    const int kind = status >> 4, channel = status & 0x0f;
    uint8_t d1 = 0, d2 = 0;
    if (!r.Byte(&d1)) return bad("a truncated channel event");
    if (kind != 0xc && kind != 0xd && !r.Byte(&d2)) return bad("a truncated channel event");
    if ((d1 | d2) & 0x80) return bad("a data byte above 127");
    if (kind == 0x9 && d2 > 0) {
      sounding[{channel, d1}] = now;  // a repeated note-on restarts the note, as tools/chorales.py
    } else if (kind == 0x8 || kind == 0x9) {
      auto it = sounding.find({channel, d1});
      if (it != sounding.end()) {
        notes[channel].push_back({it->second, now, d1});
        sounding.erase(it);
      }
    }
  }
  return notes;
}

}  // namespace

absl::StatusOr<std::vector<Voice>> ReadMidiVoices(const std::string& bytes) {
  Reader head(bytes, 0, bytes.size());
  uint32_t magic, len, format, ntracks, division;
  if (!head.BigEndian(4, &magic) || magic != 0x4d546864 || !head.BigEndian(4, &len) || len < 6 ||
      !head.BigEndian(2, &format) || !head.BigEndian(2, &ntracks) || !head.BigEndian(2, &division) ||
      !head.Skip(len - 6)) {
    return absl::InvalidArgumentError("not a Standard MIDI File (no MThd header of 6 or more bytes)");
  }
  if (format > 1) return absl::InvalidArgumentError(absl::StrCat("MIDI format ", format, "; formats 0 and 1 are read"));
  if (division & 0x8000) {
    return absl::InvalidArgumentError("MIDI time in SMPTE frames; ticks per quarter note are read");
  }
  if (division == 0) return absl::InvalidArgumentError("MIDI division of 0 ticks per quarter note");
  std::vector<std::map<int, std::vector<TickNote>>> tracks;
  size_t pos = head.pos();
  for (uint32_t t = 0; t < ntracks && pos < bytes.size(); ++t) {
    Reader chunk(bytes, pos, bytes.size());
    uint32_t id, size;
    if (!chunk.BigEndian(4, &id) || !chunk.BigEndian(4, &size) || size > bytes.size() - chunk.pos()) {
      return absl::InvalidArgumentError(absl::StrCat("MIDI track ", t, ": a truncated chunk header or length"));
    }
    const size_t body = chunk.pos();
    pos = body + size;
    if (id != 0x4d54726b) continue;  // not MTrk: chunks of unknown type are skipped, as the format says
    absl::StatusOr<std::map<int, std::vector<TickNote>>> notes = TrackNotes(Reader(bytes, body, body + size), t);
    if (!notes.ok()) return notes.status();
    if (!notes->empty()) tracks.push_back(*std::move(notes));
  }
  std::vector<std::vector<TickNote>> voices;
  if (tracks.size() == 1) {
    for (auto& [channel, notes] : tracks[0]) voices.push_back(std::move(notes));
  } else {
    for (auto& track : tracks) {
      std::vector<TickNote> all;
      for (auto& [channel, notes] : track) all.insert(all.end(), notes.begin(), notes.end());
      voices.push_back(std::move(all));
    }
  }
  if (voices.empty()) return absl::InvalidArgumentError("the MIDI file has no notes");
  // Python's round(): to the nearest step, ties to even (the default rounding mode's nearbyint).
  const double step_ticks = division / 4.0;
  auto q = [&](int64_t tick) { return static_cast<int>(std::nearbyint(tick / step_ticks)); };
  std::vector<Voice> out;
  for (std::vector<TickNote>& v : voices) {
    std::sort(v.begin(), v.end());
    Voice notes;
    for (const TickNote& n : v) {
      const int on = q(n.start), off = std::max(q(n.end), on + 1);
      if (!notes.empty() && notes.back().onset + notes.back().length > on) {
        notes.back().length = on - notes.back().onset;
        if (notes.back().length <= 0) notes.pop_back();
      }
      notes.push_back({on, off - on, n.midi});
    }
    out.push_back(std::move(notes));
  }
  return out;
}

absl::StatusOr<Grid> GridOfVoices(const std::vector<Voice>& voices) {
  if (voices.size() != kVoices) {
    return absl::InvalidArgumentError(absl::StrCat(voices.size(), " voices; a chorale has ", kVoices,
                                                   " (soprano, alto, tenor, bass)"));
  }
  int steps = 0;
  for (const Voice& v : voices) {
    for (const Note& n : v) steps = std::max(steps, n.onset + n.length);
  }
  Grid grid(steps, Step{"R", "R", "R", "R"});
  for (int i = 0; i < kVoices; ++i) {
    int end = 0;
    for (const Note& n : voices[i]) {
      if (n.midi < kLowPitch || n.midi > kHighPitch) {
        return absl::InvalidArgumentError(absl::StrCat(kVoiceNames[i], ": pitch ", n.midi, " at step ", n.onset,
                                                       "; the model's pitches are ", kLowPitch, "..", kHighPitch));
      }
      if (n.onset < end || n.length < 1) {
        return absl::InvalidArgumentError(
            absl::StrCat(kVoiceNames[i], ": notes overlap at step ", n.onset, "; one note at a time per voice"));
      }
      grid[n.onset][i] = absl::StrCat("P", n.midi);
      for (int s = n.onset + 1; s < n.onset + n.length; ++s) grid[s][i] = "H";
      end = n.onset + n.length;
    }
  }
  return grid;
}

std::vector<Voice> VoicesOfGrid(const Grid& grid) {
  std::vector<Voice> voices(kVoices);
  for (int s = 0; s < static_cast<int>(grid.size()); ++s) {
    for (int i = 0; i < kVoices; ++i) {
      const std::string& w = grid[s][i];
      int midi;
      if (w.size() > 1 && w[0] == 'P' && absl::SimpleAtoi(absl::string_view(w).substr(1), &midi)) {
        voices[i].push_back({s, 1, midi});
      } else if (w == "H" && !voices[i].empty() && voices[i].back().onset + voices[i].back().length == s) {
        ++voices[i].back().length;
      }
    }
  }
  return voices;
}

namespace {

void BigEndianTo(std::string* out, uint32_t v, int n) {
  for (int i = n - 1; i >= 0; --i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void VarLenTo(std::string* out, uint32_t v) {
  char buf[5];
  int n = 0;
  buf[n++] = static_cast<char>(v & 0x7f);
  while ((v >>= 7) != 0) buf[n++] = static_cast<char>(0x80 | (v & 0x7f));
  while (n > 0) out->push_back(buf[--n]);
}

}  // namespace

std::string WriteMidi(const Grid& grid, int tempo_bpm) {
  constexpr int kStepTicks = kTicksPerQuarter / 4;
  std::string out = "MThd";
  BigEndianTo(&out, 6, 4);
  BigEndianTo(&out, 1, 2);
  BigEndianTo(&out, kVoices, 2);
  BigEndianTo(&out, kTicksPerQuarter, 2);
  const std::vector<Voice> voices = VoicesOfGrid(grid);
  for (int i = 0; i < kVoices; ++i) {
    std::string t;
    const std::string name = kVoiceNames[i];
    t += std::string("\x00\xff\x03", 3);
    VarLenTo(&t, name.size());
    t += name;
    if (i == 0) {
      const uint32_t us_per_quarter = 60000000u / static_cast<uint32_t>(std::max(tempo_bpm, 1));
      t += std::string("\x00\xff\x51\x03", 4);
      BigEndianTo(&t, us_per_quarter, 3);
    }
    t.push_back('\x00');
    t.push_back(static_cast<char>(0xc0 | i));
    t.push_back(52);  // General MIDI "Choir Aahs"
    // (tick, 0 = off before 1 = on at the same tick, pitch)
    std::vector<std::tuple<int64_t, int, int>> events;
    for (const Note& n : voices[i]) {
      events.emplace_back(int64_t{n.onset} * kStepTicks, 1, n.midi);
      events.emplace_back(int64_t{n.onset + n.length} * kStepTicks, 0, n.midi);
    }
    std::sort(events.begin(), events.end());
    int64_t now = 0;
    for (const auto& [tick, on, midi] : events) {
      VarLenTo(&t, static_cast<uint32_t>(tick - now));
      t.push_back(static_cast<char>((on ? 0x90 : 0x80) | i));
      t.push_back(static_cast<char>(midi));
      t.push_back(static_cast<char>(on ? 80 : 0));
      now = tick;
    }
    t += std::string("\x00\xff\x2f\x00", 4);
    out += "MTrk";
    BigEndianTo(&out, t.size(), 4);
    out += t;
  }
  return out;
}

std::string Word(int voice, const std::string& cell) {
  return absl::StrCat(std::string(1, kVoiceLetters[voice]), ":", cell);
}

std::string PromptWords(const Grid& grid) {
  std::string out;
  for (const Step& s : grid) {
    for (int v = 0; v < kVoices; ++v) absl::StrAppend(&out, out.empty() ? "" : " ", Word(v, s[v]));
  }
  return out;
}

absl::StatusOr<Grid> GridOfWords(const std::string& text, int* filled) {
  if (filled != nullptr) *filled = 0;
  Grid grid;
  std::array<std::string, kVoices> step;  // "" where the step has no word for that voice yet
  int last = -1;                          // the voice of the step's latest word
  // A step the model left without some voice's word: that voice goes on as it was (held, or silent).
  auto close = [&]() {
    for (int v = 0; v < kVoices; ++v) {
      if (!step[v].empty()) continue;
      step[v] = grid.empty() || grid.back()[v] == "R" ? "R" : "H";
      if (filled != nullptr) ++*filled;
    }
    grid.push_back(Step{step[0], step[1], step[2], step[3]});
    step = {};
  };
  for (absl::string_view w : absl::StrSplit(text, absl::ByAnyChar(" \t\r\n"), absl::SkipEmpty())) {
    if (w == "EOS") break;
    if (w == "PAD" || w == "BOS") continue;
    const char* letter = w.size() > 2 && w[1] == ':' ? std::find(kVoiceLetters, kVoiceLetters + kVoices, w[0])
                                                     : kVoiceLetters + kVoices;
    const absl::string_view cell = w.substr(std::min<size_t>(2, w.size()));
    int midi;
    const bool pitch = cell.size() > 1 && cell[0] == 'P' && absl::SimpleAtoi(cell.substr(1), &midi) &&
                       midi >= kLowPitch && midi <= kHighPitch;
    if (letter == kVoiceLetters + kVoices || (!pitch && cell != "H" && cell != "R")) {
      return absl::InvalidArgumentError(absl::StrCat("'", w, "' is not a grid word (a voice S, A, T or B, ':', then R, H or P",
                                                     kLowPitch, "..P", kHighPitch, "; or PAD, BOS, EOS)"));
    }
    const int voice = static_cast<int>(letter - kVoiceLetters);
    if (voice <= last) close();  // voices come S A T B within a step: this word begins the next one
    step[voice] = std::string(cell);
    last = voice;
    if (voice == kVoices - 1) {
      close();
      last = -1;
    }
  }
  return grid;  // a trailing step without its bass word is dropped: the text stopped inside it
}

std::vector<std::string> VoiceWords(int voice) {
  std::vector<std::string> words = {Word(voice, "R"), Word(voice, "H")};
  for (int m = kLowPitch; m <= kHighPitch; ++m) words.push_back(Word(voice, absl::StrCat("P", m)));
  return words;
}

std::vector<std::string> StepWords() {
  std::vector<std::string> words;
  for (int v = 0; v < kVoices; ++v) {
    for (std::string& w : VoiceWords(v)) words.push_back(std::move(w));
  }
  return words;
}

}  // namespace relgen::client::grid
