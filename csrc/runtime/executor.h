// Launches executables. Strict eager returns once PJRT accepted the launch; debug eager
// (TPU_LAUNCH_BLOCKING / DEFER_NEVER_AND_LAUNCH_BLOCKING) waits for each launch so errors point
// at the op that caused them. Completion events of in-flight launches are kept so synchronize()
// can wait for everything, and so an unbounded queue cannot build up.
#pragma once
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "pjrt/pjrt.h"

namespace tpu::runtime {

class Executor {
 public:
  static Executor& get();
  std::vector<pjrt::BufferPtr> launch(const pjrt::Executable& exe, int device,
                                      const std::vector<PJRT_Buffer*>& args,
                                      const std::vector<int64_t>& non_donatable,
                                      const std::string& what);
  void synchronize();
  bool idle();
  int64_t launches() const { return launches_; }

 private:
  std::mutex mu_;
  std::deque<std::unique_ptr<pjrt::Event>> inflight_;
  int64_t launches_ = 0;
};

}  // namespace tpu::runtime
