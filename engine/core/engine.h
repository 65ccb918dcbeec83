// The engine: one thread owns the model, the backend and the KV pool, and runs a continuous-
// batching loop. Callers Submit() requests from any thread and read each request's output from
// its handle. A request gets exactly the tokens it would get alone, whatever else shares the
// batch, because every computation on its rows is batch-invariant and sampling is keyed by
// (seed, token index).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "engine/backends/backend.h"
#include "engine/core/kv_cache.h"
#include "engine/core/request.h"
#include "engine/core/request_checks.h"
#include "engine/model/lora.h"
#include "engine/model/model.h"
#include "engine/backends/sampler.h"
#include "engine/core/beam_search.h"
#include "engine/core/scheduler.h"
#include "engine/tokenizers/tokenizer.h"

namespace relgen {

// What happened to a request, for metrics. Every submitted request finishes exactly once.
struct RequestSummary {
  FinishReason reason = FinishReason::kNone;
  absl::StatusCode code = absl::StatusCode::kOk;  // of the final status (kError, kCancelled)
  int prompt_tokens = 0;
  int generated_tokens = 0;
  absl::Duration queue;  // submit -> first scheduled (submit -> finish if never scheduled)
  absl::Duration time_to_first_token;  // zero when no token was generated
  absl::Duration e2e;
  std::string adapter;  // the LoRA adapter it ran under (EngineConfig::adapters), empty for the base
};

// The engine thread's time in one iteration of its loop that launched a step, landed one, or both
// (with overlapped steps, it launches step N+1 and then lands step N), on a monotonic clock.
// plan + wait + land = step. A synchronous backend (the CPU) computes the whole step in its Launch,
// so there the forward pass counts as plan and wait is about zero.
struct StepHostTimes {
  // Taking submissions, reaping, scheduling, building the step's inputs and the backend's Launch
  // call (on a GPU: uploading the step's metadata and enqueueing its work).
  absl::Duration plan;
  absl::Duration wait;  // blocked in the backend's Collect, waiting for the device's answers
  absl::Duration land;  // the rest: the answers to tokens, stop checks, text, delivery, the books
  absl::Duration step;  // the whole iteration
};

// Called on the engine thread; implementations must be quick and thread-safe.
class EngineObserver {
 public:
  virtual ~EngineObserver() = default;
  virtual void OnStep(int num_seqs, int num_tokens) {}
  virtual void OnPreemptions(int count) {}
  // Input tokens an encoder-decoder model encoded in a step (again after a preemption too).
  virtual void OnEncoded(int tokens) {}
  // A generated token; `since_previous` is the gap to the request's previous token (zero for the
  // first token).
  virtual void OnToken(absl::Duration since_previous) {}
  virtual void OnFinished(const RequestSummary& summary) {}
  // A sequence admitted with prefix caching on: its prompt's tokens (prompt plus output so far after
  // a preemption) and how many of them the cache held.
  virtual void OnPrefixCache(int queried_tokens, int hit_tokens) {}
  // Once per iteration of the engine loop that launched or landed a step.
  virtual void OnStepHostTimes(const StepHostTimes& times) {}
};

struct EngineConfig {
  SchedulerConfig scheduler;
  int max_waiting = 1024;  // Submit fails with RESOURCE_EXHAUSTED beyond this (samples count each)
  RequestLimits limits;    // what SubmitGroup accepts (engine/core/request_checks.h)
  // Reuse the KV blocks of prompt prefixes computed before (bitwise the same outputs either way).
  bool prefix_caching = true;
  // false (tests): a forked beam shares nothing with its parent and recomputes its whole sequence.
  bool share_beam_blocks = true;
  // Tests: audit the KV block books after every step (aborts on a leak or a double reference).
  bool check_invariants = false;
  // false: no engine thread; the owner drives the loop with RunOnce() (deterministic tests, tools).
  bool background_thread = true;
  // With an asynchronous backend (a GPU) and the engine thread: step N+1 is planned, built and
  // launched while step N runs, and step N's tokens are delivered while N+1 runs. Outputs are the
  // same either way.
  bool overlap_steps = true;
  std::shared_ptr<EngineObserver> observer;  // optional
  // LoRA adapters a request may name (Request::adapter), all of the model. With any, the backend
  // must have been configured for them (Backend::ConfigureLora with scheduler.max_loras) and a step
  // runs at most scheduler.max_loras of them.
  std::vector<std::shared_ptr<const LoraAdapter>> adapters;
};

struct EngineStats {
  int num_running = 0;
  int num_waiting = 0;
  int kv_blocks_total = 0;
  int kv_blocks_used = 0;    // referenced by a sequence
  int kv_blocks_cached = 0;  // unreferenced, holding a cached prefix (reclaimed on demand)
  int64_t prefix_cache_queries = 0;  // tokens looked up in the prefix cache
  int64_t prefix_cache_hits = 0;     // of those, tokens found
  int64_t kv_blocks_evicted = 0;     // cached blocks reclaimed for new ones
  int64_t steps = 0;
  int last_step_seqs = 0;
  int last_step_tokens = 0;
  int64_t prompt_tokens = 0;      // prompt tokens computed (recomputation included)
  int64_t encoder_tokens = 0;     // input tokens encoded (encoder-decoder; recomputation included)
  int64_t generation_tokens = 0;  // tokens generated and delivered
  int64_t preemptions = 0;
  int64_t finished = 0;
  // The engine loop's iterations that launched or landed a step, and their StepHostTimes summed
  // (the host's share of the engine's time: (step - wait) / step).
  int64_t host_timed_steps = 0;
  StepHostTimes host_times;
  std::string device;
  std::string weights_dtype, kv_cache_dtype;  // what the backend computes from (BackendInfo)
  std::string projections;                     // BackendInfo::projections
  bool batch_invariant = true;                 // BackendInfo::batch_invariant
  BackendMemory memory;
};

class Engine {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Create(std::shared_ptr<const Model> model,
                                                        std::unique_ptr<Backend> backend,
                                                        std::shared_ptr<const Tokenizer> tokenizer,
                                                        EngineConfig config);
  ~Engine();  // Shutdown()

  // Validates and queues a request. INVALID_ARGUMENT names what is wrong; RESOURCE_EXHAUSTED when
  // the queue is full; UNAVAILABLE after Shutdown.
  absl::StatusOr<std::shared_ptr<RequestHandle>> Submit(Request request);  // one sample, no scoring
  // Any request: one handle per sample, or per continuation when scoring. Each handle is
  // independent (Cancel one, the others go on).
  absl::StatusOr<std::vector<std::shared_ptr<RequestHandle>>> SubmitGroup(Request request);
  // OK when SubmitGroup would take `request` (queue and shutdown aside); else INVALID_ARGUMENT
  // naming the field (engine/core/request_checks.h).
  absl::Status Check(const Request& request) const;
  EngineStats Stats() const;
  // One iteration of the engine loop on the caller's thread: takes submitted requests, reaps
  // cancelled and expired ones, runs one batched step. Only without the background thread.
  void RunOnce();
  // Finishes every outstanding request (kCancelled) and stops the engine thread.
  void Shutdown();
  // Holds the engine thread before its next step until Resume(): once Pause() returns, no step
  // runs, so submitted requests stay waiting. For tests that need load "in flight" without
  // depending on the machine's speed (the server exposes it only with --enable_test_hooks).
  // Shutdown still finishes everything while paused.
  void Pause();
  void Resume();
  // While paused: lets the next `steps` steps run (each once there is work for it), then holds
  // again. Returns at once. A test can so see exactly one step's output, whatever the machine's speed.
  void Advance(int steps);
  // Whether Pause() has been called (and Resume() not since), even while Pause() still waits.
  bool PauseRequested();
  // Non-OK (UNAVAILABLE, naming the fault) once the backend reported itself broken: every request
  // then outstanding has failed with it, and every later Submit does. The engine cannot recover;
  // the process must restart.
  absl::Status Failure() const;

  const Model& model() const { return *model_; }
  // The LoRA adapters requests may name (EngineConfig::adapters).
  const std::vector<std::shared_ptr<const LoraAdapter>>& adapters() const { return config_.adapters; }
  bool HasAdapter(const std::string& name) const { return AdapterId(name) > 0; }
  const Tokenizer& tokenizer() const { return *tokenizer_; }
  const EngineConfig& config() const { return config_; }

 private:
  struct Seq;
  struct BeamGroup;
  Engine(std::shared_ptr<const Model> model, std::unique_ptr<Backend> backend,
         std::shared_ptr<const Tokenizer> tokenizer, EngineConfig config);
  void Loop();
  void TakeInbox();
  // SubmitGroup's parts: a checked request's sequences (the leader holding the rest), and the queue.
  std::unique_ptr<Seq> MakeGroup(Request r, std::vector<std::shared_ptr<RequestHandle>>* handles);
  absl::Status Enqueue(std::unique_ptr<Seq> leader, int members);
  // One iteration: with `plan`, take submissions, reap, schedule, build and launch the next step;
  // land the step in flight, if any (with overlap, the one launched by the previous iteration).
  void Step(bool plan);
  // Ends `s` and delivers its final output; `last`, when given, is the output of its last token
  // (or its flushed text), delivered in the same output, so a reader never sees the end apart from
  // the last token (a stream's last chunk carries both).
  void Finish(Seq& s, FinishReason reason, absl::Status status = absl::OkStatus(), Output* last = nullptr);
  // A drawn token through the sequence's TextStream to its handle; finishes it where the text ends.
  void EmitToken(Seq& s, const SampleResult& r);
  // Moves the prompt's log-probabilities into `o` once (sample 0, before or with its first token).
  void TakePromptLogprobs(Seq& s, Output* o);
  // The controls banned every token: the text held back is delivered and the sequence ends (stop).
  void EndBanned(Seq& s);
  // Beam search: a beam's candidates for the group's step; once every live beam's are in, the
  // search steps (forking, continuing and dropping beams) or ends. EndBeams ends the group:
  // reason kNone delivers the search's result, any other ends every handle with it.
  void AnswerBeam(Seq& s, const SampleResult& candidates);
  void SelectBeams(BeamGroup& g);
  void EndBeams(BeamGroup& g, FinishReason reason, const absl::Status& status);
  void DropBeam(Seq& s);  // a beam the search left: its blocks, silently
  // A request's end in the books, before its final output goes out (nothing a client has received
  // may be missing from them): the finished count, `generated` tokens not booked by the steps, and
  // the block and queue gauges (a client with its final output must not still count as running).
  void BookFinished(int generated);
  // The observer's summary of a finished request.
  void Observe(FinishReason reason, absl::StatusCode code, int prompt_tokens, int generated, const RequestTiming& t,
               int adapter_id);
  // Prefix cache: the hits a waiting sequence would get (s.hits, s.chain), and registering the full
  // blocks a sequence has computed.
  // The index + 1 of the registered adapter `name`, 0 for none or an unknown name.
  int AdapterId(const std::string& name) const;
  // The adapter of id `id` (AdapterId), null for 0.
  const LoraAdapter* Adapter(int id) const { return id > 0 ? config_.adapters[id - 1].get() : nullptr; }
  // The prefix cache's root of a sequence's chain (engine/core/kv_cache.h).
  std::vector<int32_t> PrefixRoot(const Seq& s) const;
  void LookupPrefix(Seq& s);
  void RegisterBlocks(Seq& s, int computed);  // blocks wholly below `computed`
  // Blocks of `s` (decoder and input K/V) that another sequence also references.
  int SharedBlocks(const Seq& s) const;
  // A step's phases, in order: reap cancelled and expired requests; schedule (prefix lookups,
  // preemption, admission, blocks); the backend's input and the rows' queries; forward and
  // sampling on the backend; the answers to tokens and outputs; stats.
  // While a step is in flight, the next is planned as if it had succeeded: a sequence drawing in
  // it holds a placeholder token there (fed to the backend from that step's answer), and its
  // K/V count as computed. Landing the step puts the drawn tokens in place and delivers them.
  struct StepBatch;
  // Reap: cancelled and expired requests leave before the plan, so their blocks are free for it
  // and nothing is computed for a request nobody will read.
  void Reap(absl::Time now);
  // false, with nothing changed, when the plan would preempt while a step is in flight.
  bool Plan(absl::Time now, StepBatch* b);
  // The plan made so: preemptions, admissions, prefix-cache hits taken, blocks allocated.
  void Enact(absl::Time now, StepBatch* b);
  void BuildInputs(StepBatch* b);
  absl::Status Launch(StepBatch* b);  // non-OK: the step failed (failure_ set when the device broke)
  // Land: a launched step's answers come back (Collect), its draws replace their placeholders, then
  // Commit and Account. Apart from Launch so that, overlapped, the next step runs on the device
  // while this one's text is made. Returns the time blocked in Collect.
  absl::Duration Land(StepBatch& b);
  absl::Status Failed(const absl::Status& st);  // a failed launch or collect, to the books
  // Commit: a step's answers become its sequences' state (prompt log-probabilities, scores, tokens
  // delivered, followers started), or its failure ends them. Apart from Land because a step that
  // failed to launch has nothing to collect and must end its sequences the same way.
  void Commit(StepBatch& b, const absl::Status& st);
  void AccountPlan(const StepBatch& planned);  // preemptions, prefix-cache lookups
  void Account(const StepBatch* landed);       // a landed step's counts (if any), the gauges
  // Finishes every sequence the engine holds (shutdown, a broken device).
  void FinishAll(FinishReason reason, const absl::Status& status);

  std::shared_ptr<const Model> model_;
  std::unique_ptr<Backend> backend_;
  std::shared_ptr<const Tokenizer> tokenizer_;
  EngineConfig config_;

  mutable std::mutex mu_;  // guards inbox_, stop_, failure_, queued_, stats_
  // "The books" are queued_ and stats_: what Stats(), admission and the metrics read. They are
  // brought up to date before any output goes out, so a client never sees output its books lack.
  std::condition_variable cv_;
  std::deque<std::unique_ptr<Seq>> inbox_;
  bool stop_ = false;
  bool paused_ = false;
  int advance_ = 0;  // steps Advance() still lets run while paused
  bool in_step_ = false;  // the engine thread is between TakeInbox and the end of Step
  bool has_in_flight_ = false;  // a launched step is not yet landed (in_flight_ set)
  absl::Status failure_;
  int queued_ = 0;  // inbox + waiting
  EngineStats stats_;

  // Engine thread only.
  BlockAllocator allocator_;
  std::deque<std::unique_ptr<Seq>> waiting_;
  std::vector<std::unique_ptr<Seq>> running_;  // admission order
  // Followers whose leader finished before starting them; they join the queue's front next step.
  std::vector<std::unique_ptr<Seq>> orphans_;
  // Beams forked by this step's selections; they join the queue's front when the step is committed.
  std::vector<std::unique_ptr<Seq>> forks_;
  int64_t next_seq_id_ = 0;
  std::unique_ptr<StepBatch> in_flight_;  // launched, not yet landed (overlap_steps)
  std::thread thread_;
};

}  // namespace relgen
