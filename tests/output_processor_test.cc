// TextStream against hand-derived cases: a table detokeniser (each id's text fixed, one id whose
// text the detokeniser holds until the next token or the end) so that every expected text, piece
// and finish below follows from the rules by hand.
#include "engine/core/output_processor.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace relgen {
namespace {

constexpr int32_t kEos = 2;
constexpr int32_t kHeld = 9;  // its text "~" comes out with the next token, or at the end

class TableStream final : public StreamDecoder {
 public:
  std::string Push(int32_t id) override {
    static const std::map<int32_t, std::string> table = {
        {kEos, ""}, {3, "ab"}, {4, "c"}, {5, "ST"}, {6, "OP"}, {7, "xS"}, {8, "Tz"}, {10, "S"}, {11, "TO"}};
    std::string out = pending_;
    pending_.clear();
    if (id == kHeld) {
      pending_ = "~";
      return out;
    }
    return out + table.at(id);
  }
  std::string Finish() override {
    std::string out = pending_;
    pending_.clear();
    return out;
  }

 private:
  std::string pending_;
};

TextStream Make(StopCriteria stop, int min_tokens = 0) {
  return TextStream(std::make_unique<TableStream>(), std::move(stop), min_tokens, kEos);
}

StopCriteria Stops(std::vector<std::string> strings, int max_new_tokens = 100) {
  StopCriteria s;
  s.max_new_tokens = max_new_tokens;
  s.stop_strings = std::move(strings);
  return s;
}

void Expect(const TextDelta& d, const std::string& text, const std::string& piece, FinishReason finish) {
  EXPECT_EQ(d.text, text);
  EXPECT_EQ(d.piece, piece);
  EXPECT_EQ(d.finish, finish);
}

TEST(TextStreamTest, StopStringSplitOverTokensIsHeldBackAndCut) {
  TextStream t = Make(Stops({"STOP"}));
  Expect(t.Append(3), "ab", "ab", FinishReason::kNone);
  Expect(t.Append(4), "c", "c", FinishReason::kNone);
  Expect(t.Append(5), "", "ST", FinishReason::kNone);  // "ST" may begin "STOP"
  // "STOP" is complete: the text ends before it; the piece is the token's own text.
  Expect(t.Append(6), "", "OP", FinishReason::kStop);
}

TEST(TextStreamTest, StopStringCutKeepsTheTextBeforeIt) {
  TextStream t = Make(Stops({"bc"}));
  Expect(t.Append(3), "a", "ab", FinishReason::kNone);  // "b" may begin "bc"
  Expect(t.Append(4), "", "c", FinishReason::kStop);
  TextStream u = Make(Stops({"b"}));
  Expect(u.Append(3), "a", "ab", FinishReason::kStop);  // within one token
}

TEST(TextStreamTest, HoldbackIsReleasedWhenItCannotBeAStopString) {
  TextStream t = Make(Stops({"STOP"}));
  Expect(t.Append(7), "x", "xS", FinishReason::kNone);   // "S" may begin "STOP"
  Expect(t.Append(8), "STz", "Tz", FinishReason::kNone);  // "STz" cannot
}

TEST(TextStreamTest, HoldbackIsReleasedAtLength) {
  TextStream t = Make(Stops({"STOP"}, /*max_new_tokens=*/2));
  Expect(t.Append(3), "ab", "ab", FinishReason::kNone);
  Expect(t.Append(5), "ST", "ST", FinishReason::kLength);
  EXPECT_EQ(t.tokens(), 2);
}

TEST(TextStreamTest, TheLongestPossibleStartIsHeldBack) {
  // "xS" ends in "S" (begins "Sx") and is "xS" (begins "xSTOP"): all of it is held back.
  TextStream t = Make(Stops({"Sx", "xSTOP"}));
  Expect(t.Append(7), "", "xS", FinishReason::kNone);
  Expect(t.Append(8), "xSTz", "Tz", FinishReason::kNone);
  TextStream u = Make(Stops({"Sx"}));
  Expect(u.Append(7), "x", "xS", FinishReason::kNone);
}

TEST(TextStreamTest, TheEarliestStopStringWins) {
  TextStream t = Make(Stops({"OP", "TO"}));
  Expect(t.Append(5), "S", "ST", FinishReason::kNone);  // "T" may begin "TO"
  // "TOP" holds "TO" at 0 and "OP" at 1: the text ends before "TO".
  Expect(t.Append(6), "", "OP", FinishReason::kStop);
}

TEST(TextStreamTest, StopStringsCountFromMinTokens) {
  TextStream t = Make(Stops({"ab"}), /*min_tokens=*/2);
  Expect(t.Append(3), "ab", "ab", FinishReason::kNone);  // "ab" before min_tokens: text like any other
  Expect(t.Append(4), "c", "c", FinishReason::kNone);
  TextStream u = Make(Stops({"abc"}), /*min_tokens=*/2);
  Expect(u.Append(3), "", "ab", FinishReason::kNone);  // may begin "abc"
  Expect(u.Append(4), "", "c", FinishReason::kStop);    // complete at the min_tokens-th token: counts
}

TEST(TextStreamTest, Eos) {
  TextStream t = Make(Stops({}));
  Expect(t.Append(3), "ab", "ab", FinishReason::kNone);
  Expect(t.Append(kEos), "", "", FinishReason::kEos);
}

TEST(TextStreamTest, IgnoreEos) {
  StopCriteria s = Stops({}, 2);
  s.ignore_eos = true;
  TextStream t = Make(s);
  Expect(t.Append(kEos), "", "", FinishReason::kNone);
  Expect(t.Append(kEos), "", "", FinishReason::kLength);
}

TEST(TextStreamTest, StopTokenIdFinishesWithItsText) {
  StopCriteria s = Stops({"STOP"});
  s.stop_token_ids = {4, 5};
  TextStream t = Make(s);
  Expect(t.Append(7), "x", "xS", FinishReason::kNone);
  // The stop id's own text is part of the output, with what was held back.
  Expect(t.Append(5), "SST", "ST", FinishReason::kStop);
}

TEST(TextStreamTest, TheDetokenisersHeldTextEndsInTheLastPiece) {
  TextStream t = Make(Stops({}, 2));
  Expect(t.Append(3), "ab", "ab", FinishReason::kNone);
  Expect(t.Append(kHeld), "~", "~", FinishReason::kLength);
}

TEST(TextStreamTest, FlushReleasesEverythingHeld) {
  TextStream t = Make(Stops({"STOP"}));
  Expect(t.Append(5), "", "ST", FinishReason::kNone);
  Expect(t.Append(kHeld), "", "", FinishReason::kNone);
  EXPECT_EQ(t.Flush(), "ST~");
}

}  // namespace
}  // namespace relgen
