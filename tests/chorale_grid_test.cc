// client/chorale_grid: MIDI files in and out against hand-derived bytes and notes, and the grid words.
// (tests/chorale_test.py checks the same code against tools/chorales.py and mido on every chorale.)
#include "client/chorale_grid.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace relgen::client::grid {
namespace {

std::string Bytes(std::initializer_list<int> v) {
  std::string s;
  for (int c : v) s.push_back(static_cast<char>(c));
  return s;
}

std::string Chunk(const char* id, const std::string& body) {
  const uint32_t n = body.size();
  return std::string(id, 4) + Bytes({int(n >> 24), int((n >> 16) & 255), int((n >> 8) & 255), int(n & 255)}) + body;
}

// A format 0 file, 96 ticks a quarter (24 a sixteenth), one track, the voices on channels 0..3,
// written by hand: running status, note-on with velocity 0 as the note's end, a meta event and a
// sysex between notes, ends a few ticks off the grid.
TEST(ChoraleGridTest, ReadsAHandWrittenFormat0File) {
  std::string track = Bytes({
      0x00, 0xff, 0x51, 0x03, 0x07, 0xa1, 0x20,  // tempo
      0x00, 0x90, 60, 80,                        // soprano C4 at tick 0
      0x00, 0x91, 55, 80,                        // alto G3 at 0
      0x00, 0x92, 52, 80,                        // tenor E3 at 0
      0x00, 0x93, 36, 80,                        // bass C2 at 0
      0x30, 0x90, 60, 0,                         // tick 48: soprano off (2 steps)
      0x00, 62, 80,                              // running status: soprano D4 on at 48
      0x00, 0xf0, 0x02, 0x01, 0xf7,              // sysex, skipped
      0x2e, 0x81, 55, 64,                        // tick 94 (~4 steps): alto off
      0x01, 0x80, 62, 0,                         // tick 95: soprano off (D4 from step 2 to 4)
      0x00, 0x92, 52, 0,                         // tenor off at 95
      0x01, 0x83, 36, 0,                         // tick 96: bass off
      0x00, 0xff, 0x2f, 0x00,
  });
  const std::string file = Chunk("MThd", Bytes({0, 0, 0, 1, 0, 96})) + Chunk("MTrk", track);
  absl::StatusOr<std::vector<Voice>> v = ReadMidiVoices(file);
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_EQ(v->size(), 4u);
  EXPECT_EQ((*v)[0], (Voice{{0, 2, 60}, {2, 2, 62}}));
  EXPECT_EQ((*v)[1], (Voice{{0, 4, 55}}));
  EXPECT_EQ((*v)[2], (Voice{{0, 4, 52}}));
  EXPECT_EQ((*v)[3], (Voice{{0, 4, 36}}));
  absl::StatusOr<Grid> g = GridOfVoices(*v);
  ASSERT_TRUE(g.ok()) << g.status();
  const Grid want = {{"P60", "P55", "P52", "P36"}, {"H", "H", "H", "H"}, {"P62", "H", "H", "H"}, {"H", "H", "H", "H"}};
  EXPECT_EQ(*g, want);
  EXPECT_EQ(PromptWords(*g), "S:P60 A:P55 T:P52 B:P36 S:H A:H T:H B:H S:P62 A:H T:H B:H S:H A:H T:H B:H");
}

// The writer's bytes, derived by hand for a two-step grid.
TEST(ChoraleGridTest, WritesTheExpectedBytes) {
  const Grid g = {{"P60", "R", "R", "R"}, {"H", "P67", "R", "R"}};
  const std::string got = WriteMidi(g, 120);
  std::string want = Chunk("MThd", Bytes({0, 1, 0, 4, 0x01, 0xe0}));
  want += Chunk("MTrk", Bytes({0, 0xff, 3, 7}) + "soprano" + Bytes({0, 0xff, 0x51, 3, 0x07, 0xa1, 0x20}) +
                            Bytes({0, 0xc0, 52, 0, 0x90, 60, 80, 0x81, 0x70, 0x80, 60, 0, 0, 0xff, 0x2f, 0}));
  want += Chunk("MTrk", Bytes({0, 0xff, 3, 4}) + "alto" +
                            Bytes({0, 0xc1, 52, 0x78, 0x91, 67, 80, 0x78, 0x81, 67, 0, 0, 0xff, 0x2f, 0}));
  want += Chunk("MTrk", Bytes({0, 0xff, 3, 5}) + "tenor" + Bytes({0, 0xc2, 52, 0, 0xff, 0x2f, 0}));
  want += Chunk("MTrk", Bytes({0, 0xff, 3, 4}) + "bass" + Bytes({0, 0xc3, 52, 0, 0xff, 0x2f, 0}));
  EXPECT_EQ(got, want);
}

// Random four-voice grids (notes, holds, rests; a note may follow another at once) survive
// grid -> MIDI -> grid and grid -> words -> grid exactly.
TEST(ChoraleGridTest, RandomGridsRoundTrip) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int steps = 1 + rng() % 64;
    Grid g(steps, Step{"R", "R", "R", "R"});
    for (int v = 0; v < kVoices; ++v) {
      bool sounding = false;
      for (int s = 0; s < steps; ++s) {
        const int r = rng() % 4;
        if (r == 0) {
          g[s][v] = "R";
          sounding = false;
        } else if (r == 1 || !sounding) {
          g[s][v] = "P" + std::to_string(kLowPitch + rng() % (kHighPitch - kLowPitch + 1));
          sounding = true;
        } else {
          g[s][v] = "H";
        }
      }
    }
    // A grid that ends in rests in every voice is one MIDI cannot tell from a shorter one, and a voice
    // without notes is a track a reader cannot tell from a track that is not a voice.
    g.back()[0] = "P72";
    for (int v = 1; v < kVoices; ++v) {
      bool has_note = false;
      for (const Step& s : g) has_note |= s[v][0] == 'P';
      if (!has_note) g.back()[v] = "P" + std::to_string(kLowPitch + rng() % (kHighPitch - kLowPitch + 1));
    }
    absl::StatusOr<std::vector<Voice>> v = ReadMidiVoices(WriteMidi(g));
    ASSERT_TRUE(v.ok()) << v.status();
    absl::StatusOr<Grid> back = GridOfVoices(*v);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, g) << "trial " << trial;
    int filled = -1;
    absl::StatusOr<Grid> words = GridOfWords(PromptWords(g) + " EOS S:P60 A:P60 T:P60 B:P60", &filled);
    ASSERT_TRUE(words.ok()) << words.status();
    EXPECT_EQ(*words, g);
    EXPECT_EQ(filled, 0);
  }
}

TEST(ChoraleGridTest, WordsReadByTheVoiceTheyNameSkippedVoicesGoOn) {
  absl::StatusOr<Grid> g = GridOfWords("PAD BOS S:P60 A:R T:R B:R S:H A:P61");
  ASSERT_TRUE(g.ok());
  EXPECT_EQ(*g, (Grid{{"P60", "R", "R", "R"}}));  // the text stopped inside the second step
  // A step without the bass's word (the model went on with the next soprano), one without the
  // soprano's, one of the bass alone, one of the alto alone: each missing voice goes on as it was,
  // held after a note or a hold, silent after a rest; words in any other order begin new steps.
  int filled = -1;
  g = GridOfWords("S:P60 A:P55 T:R B:P36 S:H A:H T:P52 S:P62 A:P57 T:H B:H B:P38 A:R A:H S:R T:R B:R", &filled);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(*g, (Grid{{"P60", "P55", "R", "P36"},
                      {"H", "H", "P52", "H"},     // B filled: held
                      {"P62", "P57", "H", "H"},
                      {"H", "H", "H", "P38"},     // S, A, T filled
                      {"H", "R", "H", "H"},       // S, T, B filled
                      {"H", "H", "H", "H"},       // S, T, B filled; A:H after A:R is the model's word
                      {"R", "H", "R", "R"}}));    // A filled
  EXPECT_EQ(filled, 1 + 3 + 3 + 3 + 1);
  // A word naming a voice already given in the step begins the next step, even the same voice twice.
  g = GridOfWords("S:P60 A:P55 A:P57 T:R B:R", &filled);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(*g, (Grid{{"P60", "P55", "R", "R"}, {"H", "P57", "R", "R"}}));
  EXPECT_EQ(filled, 3);
  for (const char* bad : {"S:P60 hello T:R B:R", "S:P97 A:R T:R B:R", "S:P23 A:R T:R B:R", "S:Px A:R T:R B:R",
                          "P60 A:R T:R B:R", "X:P60 A:R T:R B:R", "S: A:R T:R B:R", "S:P60 A:R T:R B:RR"}) {
    absl::StatusOr<Grid> b = GridOfWords(bad);
    ASSERT_FALSE(b.ok()) << bad;
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(b.status().message().find("not a grid word"), std::string::npos) << b.status();
  }
  EXPECT_EQ(VoiceWords(3).size(), 2u + kHighPitch - kLowPitch + 1);
  EXPECT_EQ(VoiceWords(3)[0], "B:R");
  EXPECT_EQ(VoiceWords(3).back(), "B:P96");
  EXPECT_EQ(StepWords().size(), 4 * VoiceWords(0).size());
  EXPECT_EQ(Word(1, "P64"), "A:P64");
}

TEST(ChoraleGridTest, RefusesWhatItCannotRead) {
  const std::string head = Chunk("MThd", Bytes({0, 1, 0, 1, 0, 96}));
  struct Case {
    std::string file, message;
  };
  const std::vector<Case> cases = {
      {"", "not a Standard MIDI File"},
      {"RIFF....", "not a Standard MIDI File"},
      {Chunk("MThd", Bytes({0, 2, 0, 1, 0, 96})), "format 2"},
      {Chunk("MThd", Bytes({0, 0, 0, 1, 0xe7, 0x28})), "SMPTE"},
      {head + Chunk("MTrk", Bytes({0x00, 0x90, 60})), "truncated channel event"},
      {head + Chunk("MTrk", Bytes({0x00, 60, 80})), "no status"},
      {head + Chunk("MTrk", Bytes({0x00, 0xff, 0x51, 0x09, 1})), "truncated meta"},
      {head + Chunk("MTrk", Bytes({0x80, 0x80, 0x80, 0x80, 0x00})), "truncated delta"},
      {head + std::string("MTrk\x00\x00\x10\x00", 8), "truncated chunk"},
      {head + Chunk("MTrk", Bytes({0x00, 0xff, 0x2f, 0x00})), "no notes"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::vector<Voice>> v = ReadMidiVoices(c.file);
    ASSERT_FALSE(v.ok()) << c.message;
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(v.status().message().find(c.message), std::string::npos) << v.status() << " wanted " << c.message;
  }
  // Pitches outside the model's range, and notes on top of each other in one voice.
  std::vector<Voice> voices(4);
  voices[2] = {{0, 2, 100}};
  absl::StatusOr<Grid> g = GridOfVoices(voices);
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("tenor: pitch 100 at step 0"), std::string::npos) << g.status();
  voices[2] = {{0, 2, 60}, {1, 1, 62}};
  g = GridOfVoices(voices);
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("tenor: notes overlap at step 1"), std::string::npos) << g.status();
  voices.resize(3);
  EXPECT_FALSE(GridOfVoices(voices).ok());
}

}  // namespace
}  // namespace relgen::client::grid
