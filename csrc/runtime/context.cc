#include "context.h"
#include "ffi_kernels.h"

#include <pthread.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>

namespace tpu::runtime {

namespace {

// TORCH_TPU_LOG_LEVEL=info (or debug / 0) shows the plugin's own start-up log lines; by default
// they are dropped: absl's "WARNING: All log messages before absl::InitializeLog() ..." banner and
// INFO/WARNING lines such as "cpu_device_count set via create_options".
bool show_plugin_logs() {
  const char* v = std::getenv("TORCH_TPU_LOG_LEVEL");
  if (!v) return false;
  std::string s(v);
  return s == "info" || s == "INFO" || s == "debug" || s == "DEBUG" || s == "0";
}

bool is_chatter(const std::string& line) {
  if (line.rfind("WARNING: All log messages before absl::InitializeLog()", 0) == 0) return true;
  // absl's prefix: severity letter, MMDD, space (I1201 / W1201 / I0000 ...).
  return line.size() > 5 && (line[0] == 'I' || line[0] == 'W') && std::isdigit(static_cast<unsigned char>(line[1])) &&
         std::isdigit(static_cast<unsigned char>(line[4])) && line[5] == ' ';
}

// Captures fd 2 while the plugin loads and creates its client (where it logs), then writes back
// every captured line that is not start-up chatter, so real errors and other threads' output stay.
class StderrFilter {
 public:
  StderrFilter() {
    if (show_plugin_logs()) return;
    std::fflush(stderr);
    tmp_ = std::tmpfile();
    if (!tmp_) return;
    saved_ = dup(2);
    if (saved_ < 0 || dup2(fileno(tmp_), 2) < 0) {
      if (saved_ >= 0) close(saved_);
      saved_ = -1;
      std::fclose(tmp_);
      tmp_ = nullptr;
    }
  }
  ~StderrFilter() {
    if (saved_ < 0) return;
    std::fflush(stderr);
    dup2(saved_, 2);
    close(saved_);
    std::rewind(tmp_);
    std::string all;
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, tmp_)) > 0;) all.append(buf, n);
    std::fclose(tmp_);
    std::istringstream in(all);
    for (std::string line; std::getline(in, line);)
      if (!is_chatter(line)) std::fprintf(stderr, "%s\n", line.c_str());
  }
  StderrFilter(const StderrFilter&) = delete;
  StderrFilter& operator=(const StderrFilter&) = delete;

 private:
  std::FILE* tmp_ = nullptr;
  int saved_ = -1;
};

std::atomic<bool> forked_child{false};

void mark_forked_child() {
  if (Context::get().initialized()) forked_child.store(true);
}

}  // namespace

void Context::check_not_forked() {
  if (forked_child.load(std::memory_order_relaxed))
    throw std::runtime_error(
        "torch_tpu: cannot use the tpu device in a forked subprocess (the parent's PJRT client does not "
        "survive fork). Use the 'spawn' start method (torch.multiprocessing.set_start_method('spawn')), or "
        "keep DataLoader workers on CPU tensors and move each batch to tpu in the main process");
}

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
  check_not_forked();
  if (client_) return *client_;
  std::lock_guard<std::mutex> lock(mu_);
  if (!client_) {
    static std::once_flag at_fork;
    std::call_once(at_fork, [] { pthread_atfork(nullptr, nullptr, &mark_forked_child); });
    if (plugin_path_.empty())
      throw std::runtime_error(
          "torch_tpu: no PJRT plugin found. Install one (`pip install xla-cpu-pjrt==0.0.1`, or "
          "`pip install libtpu` on a TPU VM) or set TORCH_TPU_PJRT_PLUGIN=/path/to/plugin.so");
    StderrFilter quiet;
    auto api = pjrt::Api::load(plugin_path_);
    try {
      client_ = std::make_unique<pjrt::Client>(api, num_devices_);
      register_host_kernels(*client_);  // FFI custom calls on the CPU plugin; never throws
    } catch (const pjrt::Error& e) {
      throw pjrt::Error("torch_tpu: the PJRT plugin '" + plugin_path_ + "' could not create a client: " +
                            e.what(), e.code());
    }
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
