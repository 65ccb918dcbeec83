// The feed-forward activations a model may name (config.json's ffn_activation). Device-neutral: the
// model's config holds one, and each backend's kernels (kernels/cpu/ops.h, kernels/cuda) apply it.
#pragma once

#include <cstdint>

namespace relgen {

enum class Activation : int32_t { kRelu, kGelu, kGeluTanh, kSilu };

// The backends and the CPU kernels spell it cpu::Activation: the same enum under that name.
namespace cpu {
using ::relgen::Activation;
}  // namespace cpu

}  // namespace relgen
