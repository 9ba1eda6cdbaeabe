#include "context.h"

#include <cstdlib>
#include <stdexcept>

namespace tpu::runtime {

Context& Context::get() {
  // Leaked on purpose: PJRT objects must not be torn down during static destruction, when the
  // plugin's own globals may already be gone.
  static Context* ctx = [] {
    auto holder = std::make_unique<Context>();
    return holder.release();
  }();
  return *ctx;
}

void Context::configure(const std::string& plugin_path, int64_t num_devices) {
  std::lock_guard<std::mutex> lock(mu_);
  if (client_) {
    if (plugin_path != plugin_path_ || num_devices != num_devices_)
      throw std::runtime_error("torch_tpu: the PJRT client is already running; configure the plugin "
                               "(TORCH_TPU_PJRT_PLUGIN, TORCH_TPU_NUM_DEVICES) before the first tpu op");
    return;
  }
  plugin_path_ = plugin_path;
  num_devices_ = num_devices;
}

bool Context::configured() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !plugin_path_.empty();
}

pjrt::Client& Context::client() {
  if (client_) return *client_;
  std::lock_guard<std::mutex> lock(mu_);
  if (!client_) {
    if (plugin_path_.empty())
      throw std::runtime_error(
          "torch_tpu: no PJRT plugin found. Install one (`pip install xla-cpu-pjrt==0.0.1`, or "
          "`pip install libtpu` on a TPU VM) or set TORCH_TPU_PJRT_PLUGIN=/path/to/plugin.so");
    auto api = pjrt::Api::load(plugin_path_);
    client_ = std::make_unique<pjrt::Client>(api, num_devices_);
  }
  return *client_;
}

int Context::device_count() { return static_cast<int>(client().devices().size()); }

PJRT_Device* Context::device(int index) {
  const auto& devs = client().devices();
  if (index < 0 || index >= static_cast<int>(devs.size()))
    throw std::out_of_range("torch_tpu: device index " + std::to_string(index) +
                            " is out of range (there are " + std::to_string(devs.size()) +
                            " tpu devices)");
  return devs[index].device;
}

std::string Context::plugin_path() const {
  std::lock_guard<std::mutex> lock(mu_);
  return plugin_path_;
}

std::string Context::plugin_identity() {
  pjrt::Client& c = client();
  return plugin_path() + "|" + c.api().version_string() + "|" + c.platform_name() + "|" +
         c.platform_version();
}

}  // namespace tpu::runtime
