#include "storage.h"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "plan.h"

namespace tpu::runtime {

bool StorageState::check_dims_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("TORCH_TPU_CHECK_STORAGE_DIMS");
    return v && std::string(v) == "1";
  }();
  return on;
}

void StorageState::check_dims() const {
  if (!buffer) return;
  auto str = [](const auto& d) {
    std::string s = "[";
    for (size_t i = 0; i < d.size(); ++i) s += (i ? "," : "") + std::to_string(d[i]);
    return s + "]";
  };
  std::vector<int64_t> actual = buffer->dims();
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  if (!std::equal(actual.begin(), actual.end(), dims.begin(), dims.end()) || static_cast<size_t>(n * elem_bytes(elem)) != nbytes)
    throw std::logic_error("torch_tpu: storage dims " + str(dims) + " (" + std::to_string(nbytes) +
                           " bytes) but its buffer is " + str(actual));
}

}  // namespace tpu::runtime
