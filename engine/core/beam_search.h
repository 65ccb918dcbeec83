// Beam search's bookkeeping for one request, apart from the model: which beams go on, which end as
// hypotheses, when the search is done, and what it returns. The definitions are transformers'
// (BeamSearchScorer with BeamHypotheses, generate(num_beams=k, do_sample=False)):
// - Each step, every live beam offers its candidates (sampler.h, BeamCandidates: log_softmax of its
//   row with the controls applied); a candidate's score is the beam's score plus its log-probability
//   (float). The 2k best of all beams are walked best first (ties: lower beam, then lower token): an
//   end token among the first k ends its beam as a hypothesis (tokens without the end token, score
//   sum / generated^length_penalty, generated counting the end token); an end token after the first
//   k is skipped; any other token continues its beam, until k beams go on.
// - The first step has one beam (the prompt), as transformers' other beams start at -1e9.
// - Hypotheses keep the k best scores; early_stopping true: done once there are k; false: done once
//   the best candidate score / generated^length_penalty cannot beat the worst kept; "never": the
//   same with the generated length at max_new_tokens where length_penalty > 0.
// - At max_new_tokens the running beams join the hypotheses (unless done). The result is the
//   num_return best hypotheses, best first (equal scores: the later added first), each with its end
//   token when it ended by one.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "engine/backends/sampler.h"

namespace relgen {

enum class EarlyStopping { kFalse, kTrue, kNever };

inline constexpr int kMaxBeams = 16;

struct BeamConfig {
  int num_beams = 1;
  float length_penalty = 1.0f;
  EarlyStopping early_stopping = EarlyStopping::kFalse;
  int num_return = 1;        // <= num_beams
  int max_new_tokens = 16;
  int32_t end_token = -1;    // -1: none (ignore_eos)
};

struct BeamHypothesis {
  double score = 0;              // sum / generated^length_penalty
  std::vector<int32_t> tokens;   // generated, with the end token when it ended by one
  bool ended = false;            // by the end token (else at max_new_tokens)
};

class BeamSearch {
 public:
  explicit BeamSearch(const BeamConfig& config) : c_(config) { beams_.resize(1); }

  // Live beams, in the order Step expects their candidates.
  int num_beams() const { return static_cast<int>(beams_.size()); }
  const std::vector<int32_t>& tokens(int beam) const { return beams_[beam].tokens; }
  float score(int beam) const { return beams_[beam].score; }
  int generated() const { return generated_; }
  // Candidates each beam must offer: the 2k best could all be one beam's.
  int candidates_per_beam() const { return 2 * c_.num_beams; }
  // No more steps: done by early stopping, at max_new_tokens, or no beam left.
  bool finished() const { return done_ || generated_ >= c_.max_new_tokens || beams_.empty(); }

  // One step: candidates[b] are live beam b's (best first). Returns, per new beam, the index of the
  // beam it continues; new beam j holds tokens(parent) + its token.
  std::vector<int> Step(absl::Span<const std::vector<TokenLogprob>> candidates);

  // The num_return best hypotheses, best first (after finished()).
  std::vector<BeamHypothesis> Result();

 private:
  struct Beam {
    std::vector<int32_t> tokens;  // generated
    float score = 0;
  };
  struct Kept {
    double score;
    std::vector<int32_t> tokens;
    bool ended;
  };
  void Add(std::vector<int32_t> tokens, float sum, int generated, bool ended);
  bool IsDone(float best_sum, int generated) const;

  BeamConfig c_;
  std::vector<Beam> beams_;
  int generated_ = 0;
  bool done_ = false;
  std::vector<Kept> hyps_;  // in the order added, the worst removed (BeamHypotheses.beams)
  double worst_ = 1e9;
};

}  // namespace relgen
