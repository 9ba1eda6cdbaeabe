#include "compile_cache.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "context.h"

namespace tpu::runtime {

namespace fs = std::filesystem;

namespace {
constexpr char kMagic[] = "TORCH_TPU_EXE_V1\n";
constexpr size_t kMaxEvents = 4096;

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

CompileCache& CompileCache::get() {
  static CompileCache* c = std::make_unique<CompileCache>().release();  // see Context::get
  return *c;
}

std::string CompileCache::hash_hex(const std::string& data) {
  // Two independent 64-bit FNV-1a variants -> 128 bits; plenty for a content-addressed cache
  // whose entries also store and verify their full key text.
  uint64_t h1 = 0xcbf29ce484222325ULL, h2 = 0x84222325cbf29ce4ULL;
  for (unsigned char ch : data) {
    h1 = (h1 ^ ch) * 0x100000001b3ULL;
    h2 = (h2 ^ (ch + 0x9e)) * 0x100000001b3ULL;
    h2 ^= h2 >> 29;
  }
  char buf[40];
  snprintf(buf, sizeof buf, "%016llx%016llx", static_cast<unsigned long long>(h1),
           static_cast<unsigned long long>(h2));
  return buf;
}

std::string CompileCache::cache_dir() const {
  if (const char* d = std::getenv("TORCH_TPU_CACHE_DIR"); d && *d) return d;
  const char* home = std::getenv("HOME");
  return std::string(home && *home ? home : "/tmp") + "/.cache/torch_tpu";
}

pjrt::ExecutablePtr CompileCache::get_or_compile(const std::string& mlir, const std::string& what,
                                                 const std::string& reason, const std::string& extra_options) {
  Context& ctx = Context::get();
  pjrt::Client& client = ctx.client();
  const std::string opts = pjrt::portable_compile_options() + extra_options;
  std::string full_key = ctx.plugin_identity() + "\n" + CompileCache::hash_hex(opts) + "\n" + mlir;
  std::string key = hash_hex(full_key);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = mem_.find(key); it != mem_.end()) {
      stats_.memory_hits++;
      if (events_.size() < kMaxEvents) events_.push_back({what, reason, "memory", 0});
      return it->second;
    }
  }
  bool disk_enabled = std::getenv("TORCH_TPU_DISK_CACHE") == nullptr ||
                      std::string(std::getenv("TORCH_TPU_DISK_CACHE")) != "0";
  fs::path path = fs::path(cache_dir()) / (key + ".xla");
  pjrt::ExecutablePtr exe;
  auto t0 = std::chrono::steady_clock::now();
  if (disk_enabled) {
    std::ifstream in(path, std::ios::binary);
    if (in) {
      std::stringstream ss;
      ss << in.rdbuf();
      std::string data = ss.str();
      // Layout: magic, key-text length (decimal) + '\n', key text, payload.
      bool ok = false;
      if (data.compare(0, sizeof(kMagic) - 1, kMagic) == 0) {
        size_t p = sizeof(kMagic) - 1;
        size_t nl = data.find('\n', p);
        if (nl != std::string::npos) {
          size_t klen = std::strtoull(data.c_str() + p, nullptr, 10);
          if (nl + 1 + klen <= data.size() && data.compare(nl + 1, klen, full_key) == 0) {
            try {
              exe = client.deserialize(data.substr(nl + 1 + klen));
              ok = true;
            } catch (const pjrt::Error&) {
              ok = false;
            }
          }
        }
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (ok) {
        stats_.disk_hits++;
        double ms = ms_since(t0);
        stats_.disk_load_ms += ms;
        if (events_.size() < kMaxEvents) events_.push_back({what, reason, "disk", ms});
      } else {
        stats_.disk_errors++;
      }
    }
  }
  if (const char* dump = std::getenv("TORCH_TPU_DUMP_DIR"); dump && *dump) {
    // Debugging aid: every program the runtime asks for, as StableHLO text.
    std::error_code ec;
    fs::create_directories(dump, ec);
    std::ofstream(fs::path(dump) / (key + ".mlir")) << "// " << what << "\n" << mlir;
  }
  if (!exe) {
    t0 = std::chrono::steady_clock::now();
    try {
      exe = client.compile(mlir, opts);
    } catch (const pjrt::Error& e) {
      throw pjrt::Error("torch_tpu: XLA failed to compile the program for " + what + ": " +
                            e.what() + "\n---- program ----\n" + mlir,
                        e.code());
    }
    double ms = ms_since(t0);
    {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.misses++;
      stats_.compile_ms += ms;
      if (events_.size() < kMaxEvents) events_.push_back({what, reason, "compile", ms});
    }
    if (disk_enabled) {
      // Best effort: a read-only or full disk only costs a recompile next time.
      try {
        std::string payload = exe->serialize();
        std::error_code ec;
        fs::create_directories(path.parent_path(), ec);
        static std::atomic<uint64_t> counter{0};
        fs::path tmp = path;
        tmp += ".tmp." + std::to_string(getpid()) + "." + std::to_string(counter++);
        {
          std::ofstream out(tmp, std::ios::binary);
          out << kMagic << full_key.size() << "\n" << full_key << payload;
        }
        fs::rename(tmp, path, ec);
        if (ec) fs::remove(tmp, ec);
      } catch (const std::exception&) {
      }
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  mem_.emplace(key, exe);
  return exe;
}

CacheStats CompileCache::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void CompileCache::reset_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_ = CacheStats{};
  events_.clear();
}

void CompileCache::count_op_hit() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.op_hits++;
}

std::vector<CompileEvent> CompileCache::events() {
  std::lock_guard<std::mutex> lock(mu_);
  return events_;
}

void CompileCache::clear_memory() {
  std::lock_guard<std::mutex> lock(mu_);
  mem_.clear();
}

}  // namespace tpu::runtime
