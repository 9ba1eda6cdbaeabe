#include "executor.h"

#include "context.h"

namespace tpu::runtime {

namespace {
constexpr size_t kMaxInflight = 512;
}

Executor& Executor::get() {
  static Executor* e = std::make_unique<Executor>().release();  // see Context::get
  return *e;
}

std::vector<pjrt::BufferPtr> Executor::launch(const pjrt::Executable& exe, int device,
                                              const std::vector<PJRT_Buffer*>& args,
                                              const std::vector<int64_t>& non_donatable,
                                              const std::string& what) {
  Context& ctx = Context::get();
  std::unique_ptr<pjrt::Event> done;
  auto outs = exe.execute(ctx.device(device), args, non_donatable, &done);
  if (ctx.mode() == EagerMode::DeferNeverLaunchBlocking) {
    try {
      done->wait();
    } catch (const pjrt::Error& e) {
      throw pjrt::Error("torch_tpu: " + what + " failed on the device: " + e.what(), e.code());
    }
    return outs;
  }
  std::unique_ptr<pjrt::Event> oldest;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++launches_;
    inflight_.push_back(std::move(done));
    while (!inflight_.empty() && inflight_.front()->ready()) inflight_.pop_front();
    if (inflight_.size() > kMaxInflight) {
      oldest = std::move(inflight_.front());
      inflight_.pop_front();
    }
  }
  if (oldest) oldest->wait();  // back-pressure: never more than kMaxInflight launches queued
  return outs;
}

void Executor::synchronize() {
  std::deque<std::unique_ptr<pjrt::Event>> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending.swap(inflight_);
  }
  for (auto& e : pending) e->wait();
}

bool Executor::idle() {
  std::lock_guard<std::mutex> lock(mu_);
  while (!inflight_.empty() && inflight_.front()->ready()) inflight_.pop_front();
  return inflight_.empty();
}

}  // namespace tpu::runtime
