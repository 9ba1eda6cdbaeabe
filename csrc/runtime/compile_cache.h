// Program text -> loaded executable, in memory and on disk. The key hashes the program text,
// the plugin identity/version and the compile options, so a foreign or stale entry can never
// be loaded for the wrong compiler. Disk writes are atomic (temp file + rename); an entry that
// fails to load is recompiled and rewritten, never a crash.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "pjrt/pjrt.h"

namespace tpu::runtime {

struct CacheStats {
  int64_t op_hits = 0;       // dispatch-level hits (op signature -> program), no text built
  int64_t memory_hits = 0;   // program text found in memory
  int64_t disk_hits = 0;     // loaded from TORCH_TPU_CACHE_DIR
  int64_t misses = 0;        // compiled by XLA
  double compile_ms = 0;     // time spent in XLA compiles
  double disk_load_ms = 0;   // time spent deserializing disk entries
  int64_t disk_errors = 0;   // corrupt/foreign entries that were recompiled
  int64_t evictions = 0;     // programs dropped from memory (least recently used)
  int64_t programs = 0;      // programs held in memory now
  int64_t program_bytes = 0; // their generated code, as the plugin reports it
  int64_t max_programs = 0;  // bounds (TORCH_TPU_CACHE_MAX_PROGRAMS / TORCH_TPU_CACHE_MAX_MB)
  int64_t max_bytes = 0;
};

struct CompileEvent {
  std::string op;      // what asked for the program (an ATen op, a compiled graph, ...)
  std::string reason;  // why it was not in the dispatch cache
  std::string source;  // "compile" | "disk" | "memory"
  double ms = 0;
};

// One program held in memory. Launches copy the shared_ptr, so evicting a program never frees
// an executable that is still running or about to run.
struct Program {
  pjrt::ExecutablePtr exe;
  int64_t bytes = 0;
  std::atomic<uint64_t> last_use{0};
};
using ProgramPtr = std::shared_ptr<Program>;

// Two indexes over one bounded set of programs: program text (hash) -> program, and a caller's
// signature key (an op call, a fused structure) -> program, so a hit builds no text. Only the
// text index owns programs; beyond the bounds the least recently used are evicted (XLA:CPU keeps
// every loaded executable mapped, so an unbounded cache grows until mmap fails).
class CompileCache {
 public:
  static CompileCache& get();
  // `what` names the requester for error messages and the compile log.
  // `extra_options`: serialized xla.CompileOptionsProto fields merged over the defaults (protobuf
  // concatenation = merge), e.g. XLA debug-option overrides from torch.compile(options=...).
  pjrt::ExecutablePtr get_or_compile(const std::string& mlir, const std::string& what,
                                     const std::string& reason, const std::string& extra_options = {});
  ProgramPtr get_or_compile_program(const std::string& mlir, const std::string& what,
                                    const std::string& reason, const std::string& extra_options = {});
  // Signature-key index: the program remembered for `key`, or null (never built, or evicted).
  ProgramPtr find_signature(const std::string& key);
  void remember_signature(const std::string& key, const ProgramPtr& program);
  // A program a caller remembered itself (the dispatch cache): counted and touched like a
  // signature hit; null once evicted.
  ProgramPtr hit(const std::weak_ptr<Program>& remembered) {
    ProgramPtr p = remembered.lock();
    if (p) {
      touch(*p);
      op_hits_.fetch_add(1, std::memory_order_relaxed);
    }
    return p;
  }

  // Bounds on the programs kept in memory (defaults from the environment); evicts at once.
  void set_limits(int64_t max_programs, int64_t max_bytes);
  CacheStats stats();
  void reset_stats();
  std::vector<CompileEvent> events();
  void clear_memory();
  std::string cache_dir() const;
  static std::string hash_hex(const std::string& data);

 CompileCache();

 private:
  void insert_locked(const std::string& key, const ProgramPtr& p);
  void evict_locked();
  void touch(Program& p) { p.last_use.store(++tick_, std::memory_order_relaxed); }

  std::mutex mu_;
  std::unordered_map<std::string, ProgramPtr> mem_;
  std::shared_mutex sig_mu_;
  std::unordered_map<std::string, std::weak_ptr<Program>> by_signature_;
  std::atomic<uint64_t> tick_{0};
  std::atomic<int64_t> op_hits_{0};
  int64_t bytes_ = 0;
  int64_t max_programs_, max_bytes_;
  CacheStats stats_;
  std::vector<CompileEvent> events_;
};

}  // namespace tpu::runtime
