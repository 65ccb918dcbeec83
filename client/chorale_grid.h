// The chorale grid of models/chorales (tools/chorales.py is the reference): time in sixteenth notes,
// four voices per step (soprano, alto, tenor, bass), one cell per voice and step:
//   P<midi>  a note of that pitch starts here     H  the voice's note still sounds     R  silence
// The model's word for a cell names its voice: S:P67 A:H T:P59 B:R. (With one word set shared by the
// voices a small model loses track of which voice a word is for, and its voices wander into each
// other's ranges.) A piece is BOS, 4 words per step, EOS. This is the client's side of it: Standard
// MIDI Files in and out, and the grid as the model's words. Thread-safety: pure functions.
#pragma once

#include <array>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace relgen::client::grid {

inline constexpr int kVoices = 4;
inline constexpr int kLowPitch = 24;   // P24..P96: the model's vocabulary
inline constexpr int kHighPitch = 96;
inline constexpr int kTicksPerQuarter = 480;  // in the files written here

using Step = std::array<std::string, kVoices>;
using Grid = std::vector<Step>;

struct Note {
  int onset = 0;   // in steps
  int length = 0;  // in steps, >= 1
  int midi = 0;
  bool operator==(const Note& o) const { return onset == o.onset && length == o.length && midi == o.midi; }
};
using Voice = std::vector<Note>;

// The notes of each voice in a Standard MIDI File (format 0 or 1), onsets and ends quantised to the
// nearest sixteenth (ties to even, as tools/chorales.py), a note that overlaps the next in its voice
// cut where the next starts. Voices: each track with notes is one (soprano first); a file whose only
// track with notes uses several channels has one voice per channel, lowest channel first.
absl::StatusOr<std::vector<Voice>> ReadMidiVoices(const std::string& bytes);

// Four voices -> the grid (the longest voice's end is its length). INVALID_ARGUMENT for a pitch outside
// P24..P96 or notes that overlap within a voice.
absl::StatusOr<Grid> GridOfVoices(const std::vector<Voice>& voices);

// The grid -> four voices; an H with no note sounding is a rest.
std::vector<Voice> VoicesOfGrid(const Grid& grid);

// A format 1 file: one track per voice (its name, channel = voice index, choir program 52), the
// tempo in the first.
std::string WriteMidi(const Grid& grid, int tempo_bpm = 80);

// Voice `voice`'s word for a cell: "S:P67", "B:H".
std::string Word(int voice, const std::string& cell);

// "S:w A:w T:w B:w S:w ...": the words of a prompt, 4 per step, neither BOS (the server puts the
// model's BOS before every text prompt) nor EOS (so the model continues it).
std::string PromptWords(const Grid& grid);

// The model's words -> the grid: PAD and BOS dropped, everything from EOS on dropped. Each word is
// the cell of the voice it names; voices come S A T B within a step, so a word whose voice is not
// after the previous word's begins the next step. A voice a step has no word for (the model skipped
// it) goes on as it was: H after a note or H, R after R; `filled`, when given, counts those. A
// trailing step without its bass word is dropped. INVALID_ARGUMENT naming a word that is not a grid
// word.
absl::StatusOr<Grid> GridOfWords(const std::string& text, int* filled = nullptr);

// One voice's words (R, H, P24..P96), e.g. the allowed set of a harmonization step's lower voices.
std::vector<std::string> VoiceWords(int voice);
// Every voice's words.
std::vector<std::string> StepWords();

}  // namespace relgen::client::grid
