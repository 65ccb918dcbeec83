#include "engine/core/beam_search.h"

#include <algorithm>
#include <cmath>

namespace relgen {

void BeamSearch::Add(std::vector<int32_t> tokens, float sum, int generated, bool ended) {
  const double score = static_cast<double>(sum) / std::pow(static_cast<double>(generated), c_.length_penalty);
  const int k = c_.num_beams;
  if (static_cast<int>(hyps_.size()) < k || score > worst_) {
    hyps_.push_back({score, std::move(tokens), ended});
    if (static_cast<int>(hyps_.size()) > k) {
      // Python's sorted([(score, index)]): the worst goes, the next worst bounds what may enter.
      std::vector<int> order(hyps_.size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
      std::sort(order.begin(), order.end(), [&](int a, int b) {
        return hyps_[a].score < hyps_[b].score || (hyps_[a].score == hyps_[b].score && a < b);
      });
      worst_ = hyps_[order[1]].score;
      hyps_.erase(hyps_.begin() + order[0]);
    } else {
      worst_ = std::min(score, worst_);
    }
  }
}

bool BeamSearch::IsDone(float best_sum, int generated) const {
  if (static_cast<int>(hyps_.size()) < c_.num_beams) return false;
  if (c_.early_stopping == EarlyStopping::kTrue) return true;
  int len = generated;
  if (c_.early_stopping == EarlyStopping::kNever && c_.length_penalty > 0.0f) len = c_.max_new_tokens;
  const double best = static_cast<double>(best_sum) / std::pow(static_cast<double>(len), c_.length_penalty);
  return worst_ >= best;
}

std::vector<int> BeamSearch::Step(absl::Span<const std::vector<TokenLogprob>> candidates) {
  struct Cand {
    float score;
    int beam;
    int32_t token;
  };
  std::vector<Cand> all;
  for (size_t b = 0; b < candidates.size() && b < beams_.size(); ++b) {
    for (const TokenLogprob& t : candidates[b]) all.push_back({beams_[b].score + t.logprob, static_cast<int>(b), t.token});
  }
  const int k = c_.num_beams;
  const size_t keep = std::min(all.size(), static_cast<size_t>(2 * k));
  std::partial_sort(all.begin(), all.begin() + keep, all.end(), [](const Cand& a, const Cand& b) {
    if (a.score != b.score) return a.score > b.score;
    return a.beam != b.beam ? a.beam < b.beam : a.token < b.token;
  });
  all.resize(keep);
  const int generated = generated_ + 1;  // counting this step's token
  std::vector<Beam> next;
  std::vector<int> parents;
  for (size_t rank = 0; rank < all.size() && static_cast<int>(next.size()) < k; ++rank) {
    const Cand& c = all[rank];
    if (c.token == c_.end_token && c_.end_token >= 0) {
      if (static_cast<int>(rank) >= k) continue;
      Add(beams_[c.beam].tokens, c.score, generated, true);
      continue;
    }
    Beam nb;
    nb.tokens = beams_[c.beam].tokens;
    nb.tokens.push_back(c.token);
    nb.score = c.score;
    next.push_back(std::move(nb));
    parents.push_back(c.beam);
  }
  if (!all.empty()) done_ = done_ || IsDone(all.front().score, generated);
  beams_ = std::move(next);
  generated_ = generated;
  if (!done_ && generated_ >= c_.max_new_tokens) {
    // At the length limit the running beams are hypotheses too.
    for (const Beam& b : beams_) Add(b.tokens, b.score, generated_, false);
  }
  return parents;
}

std::vector<BeamHypothesis> BeamSearch::Result() {
  std::vector<int> order(hyps_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return hyps_[a].score < hyps_[b].score; });
  std::vector<BeamHypothesis> out;
  for (int j = 0; j < c_.num_return && !order.empty(); ++j) {
    const Kept& h = hyps_[order.back()];
    order.pop_back();
    BeamHypothesis r;
    r.score = h.score;
    r.tokens = h.tokens;
    if (h.ended) r.tokens.push_back(c_.end_token);
    r.ended = h.ended;
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace relgen
