#pragma once
#include <ATen/core/Generator.h>
#include <c10/core/GeneratorImpl.h>

#include <mutex>
#include <utility>

namespace tpu::aten {

// Philox state per device: (seed, offset). Random ops pass the pair to their program as a
// runtime operand (so reseeding never recompiles) and advance the offset by what they consume.
class TpuGenerator final : public c10::GeneratorImpl {
 public:
  explicit TpuGenerator(c10::DeviceIndex index);
  void set_current_seed(uint64_t seed) override;
  void set_offset(uint64_t offset) override;
  uint64_t get_offset() const override;
  uint64_t current_seed() const override;
  uint64_t seed() override;
  void set_state(const c10::TensorImpl& new_state) override;
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override;
  // Returns (seed, offset) for one op consuming `increment` counters, and advances.
  std::pair<uint64_t, uint64_t> next(uint64_t increment);
  static c10::DeviceType device_type() { return c10::DeviceType::PrivateUse1; }

 private:
  TpuGenerator* clone_impl() const override;
  uint64_t seed_ = 67280421310721ULL;  // same default as PyTorch's CPU generator
  uint64_t offset_ = 0;
};

const at::Generator& default_generator(c10::DeviceIndex index);

}  // namespace tpu::aten
