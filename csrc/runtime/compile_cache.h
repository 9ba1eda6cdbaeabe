// Program text -> loaded executable, in memory and on disk. The key hashes the program text,
// the plugin identity/version and the compile options, so a foreign or stale entry can never
// be loaded for the wrong compiler. Disk writes are atomic (temp file + rename); an entry that
// fails to load is recompiled and rewritten, never a crash.
#pragma once
#include <cstdint>
#include <list>
#include <mutex>
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
};

struct CompileEvent {
  std::string op;      // what asked for the program (an ATen op, a compiled graph, ...)
  std::string reason;  // why it was not in the dispatch cache
  std::string source;  // "compile" | "disk" | "memory"
  double ms = 0;
};

class CompileCache {
 public:
  static CompileCache& get();
  // `what` names the requester for error messages and the compile log.
  // `extra_options`: serialized xla.CompileOptionsProto fields merged over the defaults (protobuf
  // concatenation = merge), e.g. XLA debug-option overrides from torch.compile(options=...).
  pjrt::ExecutablePtr get_or_compile(const std::string& mlir, const std::string& what,
                                     const std::string& reason, const std::string& extra_options = {});
  CacheStats stats();
  void reset_stats();
  void count_op_hit();
  std::vector<CompileEvent> events();
  void clear_memory();
  std::string cache_dir() const;
  static std::string hash_hex(const std::string& data);

 private:
  std::mutex mu_;
  std::unordered_map<std::string, pjrt::ExecutablePtr> mem_;
  CacheStats stats_;
  std::vector<CompileEvent> events_;
};

}  // namespace tpu::runtime
