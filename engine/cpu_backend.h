// CPU backend: float32 decoder forward with the kernels of kernels/cpu (GEMMs through cblas).
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "engine/backend.h"
#include "engine/model.h"

namespace relgen {

absl::StatusOr<std::unique_ptr<Backend>> NewCpuBackend(std::shared_ptr<const Model> model);

}  // namespace relgen
