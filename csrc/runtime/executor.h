// The executors of the eager pipeline (see plan.h), and PJRT launches.
//   strict  (DEFER_NEVER, the default): one program per op; returns once PJRT accepted the launch.
//   debug   (DEFER_NEVER_AND_LAUNCH_BLOCKING / TPU_LAUNCH_BLOCKING): strict, but waits for each
//           launch so a device error names the op that caused it.
//   fused   (DEFER_AND_FUSE): records ops into one pending program, launched at sync points.
// Compiled graphs (aten/graph.cc) launch through Executor::launch as well.
// synchronize() waits for all launched work (as torch.cuda.synchronize does). A launch takes no
// PJRT completion event (creating, polling and destroying one per op cost 3-5 % of a small op):
// PJRT runs a device's launches in order (XLA:CPU makes each launch wait for the one enqueued
// before it), so the last launch of each thread on each device stands for all earlier ones, and
// its first output's ready event is asked for only by synchronize() / idle(). Launches without
// outputs keep their completion event.
#pragma once
#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "pjrt/pjrt.h"
#include "runtime/compile_cache.h"
#include "runtime/plan.h"

namespace tpu::runtime {

class Executor {
 public:
  static Executor& get();
  std::vector<pjrt::BufferPtr> launch(const pjrt::Executable& exe, int device,
                                      const std::vector<PJRT_Buffer*>& args,
                                      const std::vector<int64_t>& non_donatable,
                                      const std::string& what);
  // Waits for every launch so far, including those whose outputs were already dropped.
  void synchronize();
  bool idle();
  int64_t launches() const { return launches_.load(std::memory_order_relaxed); }

 private:
  // The last launch of one thread on one device, by its first output (shared with the storage
  // that holds it; kept alive until the next such launch or synchronize()).
  struct LastLaunch {
    std::thread::id thread;
    int device;
    pjrt::BufferPtr out;
  };
  std::mutex mu_;
  std::vector<LastLaunch> last_;
  std::deque<std::unique_ptr<pjrt::Event>> inflight_;  // launches without outputs, oldest first
  std::atomic<int64_t> launches_{0};
};

// Runs a planned call with the executor of the current eager mode (fused eager keeps the plan).
// Strict: `*program` is the program to launch when set (the dispatch cache's), else it is looked
// up by the plan's key (built and compiled on a miss, `miss_reason` says why) and set.
void execute(const Call& call, ProgramPtr* program, const MissReason& miss_reason);

// Fused eager: launches the pending program (a sync point); forgets a dying storage.
// Why a pending program was launched, counted per reason (fused_flush_counts) when it had ops.
enum class FlushReason : int {
  Other = 0,      // a sync point that names none (storage resize, dtype change, jax_call, ...)
  HostTransfer,   // a host read or upload, .item(), a cross-chip copy
  CompiledGraph,  // a compiled graph reads or writes the storages
  Synchronize,    // synchronize(), stream/event queries, leaving or entering fused mode
  InlineSplit,    // launched early so each piece runs inline on XLA:CPU (< 1,000 flops)
  SizeLimit,      // 512 recorded ops
  DeviceChange,   // an op on another device
  kCount
};
const char* flush_reason_name(FlushReason r);
// Serialized xla.CompileOptionsProto fields every fused program is compiled with from now on
// (after TORCH_TPU_FUSED_FMA's); Python sets compiled graphs' defaults (compile.graph_defaults).
void set_fused_program_options(const std::string& options);
std::vector<int64_t> fused_flush_counts();  // indexed by FlushReason
void fused_flush(FlushReason why = FlushReason::Other);
void fused_forget(StorageState* st);

// Gives a storage that was never written a zero buffer of `dims` x `elem` (PyTorch's fresh
// memory is uninitialized; zeros make reads deterministic). No-op when it has a buffer.
void ensure_buffer(StorageState& st, shlo::ElemType elem, const shlo::Shape& dims);

// The floor under strict eager: microseconds per PJRT_LoadedExecutable_Execute + await of a
// cached 4-element f32 add, measured by a C++ loop over csrc/pjrt (no Python, no dispatch).
double raw_launch_floor_us(int iters);

// Host-side counters.
struct DispatchStats {
  int64_t ops = 0;         // lowered op launches (or fused records)
  int64_t host_syncs = 0;  // device -> host reads
};
DispatchStats& dispatch_stats();

}  // namespace tpu::runtime
