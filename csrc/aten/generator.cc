#include "generator.h"

#include <ATen/core/Tensor.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <deque>
#include <memory>

#include <ATen/ops/empty.h>

#include "runtime/context.h"

namespace tpu::aten {

TpuGenerator::TpuGenerator(c10::DeviceIndex index)
    : c10::GeneratorImpl(c10::Device(c10::DeviceType::PrivateUse1, index),
                         c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)) {}

void TpuGenerator::set_current_seed(uint64_t seed) {
  seed_ = seed;
  offset_ = 0;
}
void TpuGenerator::set_offset(uint64_t offset) { offset_ = offset; }
uint64_t TpuGenerator::get_offset() const { return offset_; }
uint64_t TpuGenerator::current_seed() const { return seed_; }
uint64_t TpuGenerator::seed() {
  uint64_t s = c10::detail::getNonDeterministicRandom();
  set_current_seed(s);
  return s;
}

void TpuGenerator::set_state(const c10::TensorImpl& new_state) {
  TORCH_CHECK(new_state.numel() == 16 && new_state.dtype() == caffe2::TypeMeta::Make<uint8_t>(),
              "torch_tpu: RNG state must be a uint8 tensor of 16 bytes (seed, offset), got ",
              new_state.numel(), " elements");
  const auto* p = static_cast<const uint8_t*>(new_state.data());
  std::memcpy(&seed_, p, 8);
  std::memcpy(&offset_, p + 8, 8);
}

c10::intrusive_ptr<c10::TensorImpl> TpuGenerator::get_state() const {
  at::Tensor t = at::empty({16}, at::TensorOptions().dtype(at::kByte));
  auto* p = t.data_ptr<uint8_t>();
  std::memcpy(p, &seed_, 8);
  std::memcpy(p + 8, &offset_, 8);
  return t.getIntrusivePtr();
}

std::pair<uint64_t, uint64_t> TpuGenerator::next(uint64_t increment) {
  std::pair<uint64_t, uint64_t> r{seed_, offset_};
  offset_ += increment;
  return r;
}

TpuGenerator* TpuGenerator::clone_impl() const {
  auto g = std::make_unique<TpuGenerator>(device().index());
  g->seed_ = seed_;
  g->offset_ = offset_;
  return g.release();  // ownership passes to the intrusive_ptr made by clone()
}

const at::Generator& default_generator(c10::DeviceIndex index) {
  static std::mutex mu;
  static std::deque<at::Generator>* gens = std::make_unique<std::deque<at::Generator>>().release();
  std::lock_guard<std::mutex> lock(mu);
  int n = std::max(1, runtime::Context::get().device_count());
  while (static_cast<int>(gens->size()) < n)
    gens->push_back(at::make_generator<TpuGenerator>(static_cast<c10::DeviceIndex>(gens->size())));
  if (index < 0) index = 0;
  TORCH_CHECK(index < n, "tpu device index ", static_cast<int>(index), " out of range");
  return (*gens)[index];
}

}  // namespace tpu::aten
