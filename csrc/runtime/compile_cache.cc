#include "compile_cache.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "context.h"
#include "profiler.h"

namespace tpu::runtime {

namespace fs = std::filesystem;

namespace {
constexpr char kMagic[] = "TORCH_TPU_EXE_V1\n";
constexpr size_t kMaxEvents = 4096;

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

namespace {
int64_t env_int(const char* name, int64_t dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  long long x = std::strtoll(v, &end, 10);
  return end && *end == '\0' && x > 0 ? x : dflt;
}
}  // namespace

// Defaults: ~1,000 small programs cost XLA:CPU ~35,000 memory maps (vm.max_map_count is 65,530)
// and a few hundred MB; a training step's or a decode step's working set is far smaller.
CompileCache::CompileCache()
    : max_programs_(env_int("TORCH_TPU_CACHE_MAX_PROGRAMS", 1024)),
      max_bytes_(env_int("TORCH_TPU_CACHE_MAX_MB", 1024) << 20) {}

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
  return get_or_compile_program(mlir, what, reason, extra_options)->exe;
}

ProgramPtr CompileCache::get_or_compile_program(const std::string& mlir, const std::string& what,
                                                const std::string& reason, const std::string& extra_options) {
  Context& ctx = Context::get();
  pjrt::Client& client = ctx.client();
  const std::string opts = pjrt::portable_compile_options() + extra_options;
  std::string full_key = ctx.plugin_identity() + "\n" + CompileCache::hash_hex(opts) + "\n" + mlir;
  std::string key = hash_hex(full_key);
  prof::CompileScope prof_scope(what);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = mem_.find(key); it != mem_.end()) {
      stats_.memory_hits++;
      prof_scope.tier("memory");
      if (events_.size() < kMaxEvents) events_.push_back({what, reason, "memory", 0});
      touch(*it->second);
      return it->second;
    }
  }
  bool disk_enabled = std::getenv("TORCH_TPU_DISK_CACHE") == nullptr ||
                      std::string(std::getenv("TORCH_TPU_DISK_CACHE")) != "0";
  fs::path path = fs::path(cache_dir()) / (key + ".xla");
  pjrt::ExecutablePtr exe;
  int64_t serialized_bytes = 0;  // size proxy when the plugin does not report its code size
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
              serialized_bytes = static_cast<int64_t>(data.size() - (nl + 1 + klen));
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
        prof_scope.tier("disk");
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
      prof_scope.tier("xla");
      stats_.compile_ms += ms;
      if (events_.size() < kMaxEvents) events_.push_back({what, reason, "compile", ms});
    }
    if (disk_enabled) {
      // Best effort: a read-only or full disk only costs a recompile next time.
      try {
        std::string payload = exe->serialize();
        serialized_bytes = static_cast<int64_t>(payload.size());
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
  auto program = std::make_shared<Program>();
  program->exe = exe;
  program->bytes = exe->code_bytes();
  if (program->bytes <= 0 && serialized_bytes <= 0) {
    try {
      serialized_bytes = static_cast<int64_t>(exe->serialize().size());
    } catch (const pjrt::Error&) {
    }
  }
  if (program->bytes <= 0) program->bytes = serialized_bytes;
  touch(*program);
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = mem_.find(key); it != mem_.end()) return it->second;  // another thread won
  insert_locked(key, program);
  return program;
}

void CompileCache::insert_locked(const std::string& key, const ProgramPtr& p) {
  mem_.emplace(key, p);
  bytes_ += p->bytes;
  if (static_cast<int64_t>(mem_.size()) > max_programs_ || bytes_ > max_bytes_) evict_locked();
}

// Drops the least recently used programs down to 7/8 of the bounds (one sort per eviction
// batch instead of per program). Signature entries pointing at them expire with them.
void CompileCache::evict_locked() {
  std::vector<std::pair<uint64_t, std::unordered_map<std::string, ProgramPtr>::iterator>> order;
  order.reserve(mem_.size());
  for (auto it = mem_.begin(); it != mem_.end(); ++it)
    order.emplace_back(it->second->last_use.load(std::memory_order_relaxed), it);
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  const int64_t keep_n = max_programs_ - max_programs_ / 8, keep_bytes = max_bytes_ - max_bytes_ / 8;
  for (auto& [tick, it] : order) {
    if (static_cast<int64_t>(mem_.size()) <= keep_n && bytes_ <= keep_bytes) break;
    if (mem_.size() <= 1) break;  // the program just inserted stays
    bytes_ -= it->second->bytes;
    mem_.erase(it);
    stats_.evictions++;
  }
  std::unique_lock<std::shared_mutex> lock(sig_mu_);
  for (auto it = by_signature_.begin(); it != by_signature_.end();)
    it = it->second.expired() ? by_signature_.erase(it) : std::next(it);
}

void CompileCache::set_limits(int64_t max_programs, int64_t max_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  max_programs_ = std::max<int64_t>(max_programs, 1);
  max_bytes_ = std::max<int64_t>(max_bytes, 1);
  if (static_cast<int64_t>(mem_.size()) > max_programs_ || bytes_ > max_bytes_) evict_locked();
}

ProgramPtr CompileCache::find_signature(const std::string& key) {
  ProgramPtr p;
  {
    std::shared_lock<std::shared_mutex> lock(sig_mu_);
    auto it = by_signature_.find(key);
    if (it == by_signature_.end()) return nullptr;
    p = it->second.lock();
  }
  if (p) {
    touch(*p);
    op_hits_.fetch_add(1, std::memory_order_relaxed);
  }
  return p;
}

void CompileCache::remember_signature(const std::string& key, const ProgramPtr& program) {
  std::unique_lock<std::shared_mutex> lock(sig_mu_);
  by_signature_[key] = program;
}

CacheStats CompileCache::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  CacheStats s = stats_;
  s.op_hits = op_hits_.load(std::memory_order_relaxed);
  s.programs = static_cast<int64_t>(mem_.size());
  s.program_bytes = bytes_;
  s.max_programs = max_programs_;
  s.max_bytes = max_bytes_;
  return s;
}

void CompileCache::reset_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_ = CacheStats{};
  op_hits_ = 0;
  events_.clear();
}

std::vector<CompileEvent> CompileCache::events() {
  std::lock_guard<std::mutex> lock(mu_);
  return events_;
}

void CompileCache::clear_memory() {
  std::lock_guard<std::mutex> lock(mu_);
  mem_.clear();
  bytes_ = 0;
  std::unique_lock<std::shared_mutex> sig_lock(sig_mu_);
  by_signature_.clear();
}

}  // namespace tpu::runtime
