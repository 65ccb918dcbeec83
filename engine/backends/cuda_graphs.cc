// Decode steps as CUDA graphs, one captured per batch size (and per whether a row has a LoRA adapter).
#include "engine/backends/cuda_backend_impl.h"

namespace relgen {
namespace cuda_backend {

absl::Status CudaBackend::DecodeGraph(StepRows s) {
  // With adapters, a graph of its own: the same grids, and the LoRA launches between them.
  const int key = 2 * s.total + (s.lora != nullptr ? 1 : 0);
  auto it = graphs_.find(key);
  if (it == graphs_.end()) {
    // Grids sized for the longest context: a split past a row's keys does nothing, and the
    // splits' boundaries do not depend on their count, so every step of s.total rows replays it.
    s.max_keys = s.max_input = model_->config().max_seq_len;
    RELGEN_CUDA_RETURN(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    const absl::Status captured = Decoder(s);
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(stream_, &graph);
    cudaGraphExec_t exec = nullptr;
    const cudaError_t made = captured.ok() && ended == cudaSuccess ? cudaGraphInstantiate(&exec, graph, 0) : ended;
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (!captured.ok()) return captured;
    RELGEN_CUDA_RETURN(made);
    it = graphs_.emplace(key, exec).first;
  }
  RELGEN_CUDA_RETURN(cudaGraphLaunch(it->second, stream_));
  return absl::OkStatus();
}

void CudaBackend::DropGraphs() {
  for (auto& [n, exec] : graphs_) cudaGraphExecDestroy(exec);
  graphs_.clear();
}

}  // namespace cuda_backend
}  // namespace relgen
