// Process-wide runtime state: the PJRT plugin, client and devices, created lazily on first use
// so `import torch` stays cheap and a broken plugin surfaces as an error at the first tpu op.
#pragma once
#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "pjrt/pjrt.h"

namespace tpu::runtime {

enum class EagerMode : int { DeferNever = 0, DeferNeverLaunchBlocking = 1, DeferAndFuse = 2 };

class Context {
 public:
  static Context& get();
  // Throws once this process is a fork() child of a process whose client existed: the plugin's
  // threads and device state do not survive fork, so any use would hang or crash.
  static void check_not_forked();
  // Plugin choice made by the Python layer (discovery needs importlib); cheap, loads nothing.
  void configure(const std::string& plugin_path, int64_t num_devices);
  bool configured() const;
  // Loads the plugin and creates the client on first call; throws with an actionable message.
  pjrt::Client& client();
  bool initialized() const { return client_ != nullptr; }
  int device_count();
  PJRT_Device* device(int index);
  std::string plugin_path() const;
  // Identity of the compiler for cache keys: plugin path, API version, platform name+version.
  std::string plugin_identity();

  EagerMode mode() const { return mode_.load(); }
  void set_mode(EagerMode m) { mode_.store(m); }

 private:
  mutable std::mutex mu_;
  std::string plugin_path_;
  int64_t num_devices_ = 1;
  std::unique_ptr<pjrt::Client> client_;
  std::atomic<EagerMode> mode_{EagerMode::DeferNever};
};

}  // namespace tpu::runtime
