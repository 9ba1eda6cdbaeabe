// The tpu's Kineto activity profiler (PyTorch's PrivateUse1 profiler hook): with
// torch.profiler.profile(activities=[..., ProfilerActivity.PrivateUse1]) each launch's device
// time becomes a device activity linked to the torch op that launched it, so key_averages() has
// device-time columns ("Self TPU") and the chrome trace a device row. No torch headers here.
#pragma once
#include <cstdint>
#include <vector>

#include "runtime/profiler.h"

namespace tpu::aten::kineto {

bool session_active();              // a Kineto session with tpu activities is recording
uint64_t current_correlation();     // innermost torch op on this thread (0 without a session)
void add(const std::vector<runtime::prof::DeviceEvent>& events);  // no session: dropped

}  // namespace tpu::aten::kineto
