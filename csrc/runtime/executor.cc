#include "executor.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <iterator>
#include <unordered_map>
#include <utility>

#include "compile_cache.h"
#include "context.h"
#include "device_checks.h"
#include "profiler.h"

namespace tpu::runtime {

using shlo::Type;
using shlo::Value;

DispatchStats& dispatch_stats() {
  static DispatchStats s;
  return s;
}

namespace {
// Launches without outputs keep completion events: never more than kMaxInflight queued (PJRT
// bounds its own queue of outputs-producing launches), completed ones dropped every kPollEvery.
constexpr size_t kMaxInflight = 512;
constexpr size_t kPollEvery = 16;
// Threads that stopped launching leave their last launch behind: past this many entries, the
// completed ones are dropped.
constexpr size_t kMaxLastLaunches = 64;

// Whether a tracked output's producer finished. A donated output (an in-place op consumed it) is
// done for this purpose: the consuming launch waited for it and is tracked itself.
bool finished(const pjrt::Buffer& out) {
  try {
    return out.ready();
  } catch (const pjrt::Error&) {
    if (out.is_deleted()) return true;
    throw;
  }
}
}  // namespace

Executor& Executor::get() {
  static Executor* e = std::make_unique<Executor>().release();  // see Context::get
  return *e;
}

std::vector<pjrt::BufferPtr> Executor::launch(const pjrt::Executable& exe, int device,
                                              const std::vector<PJRT_Buffer*>& args,
                                              const std::vector<int64_t>& non_donatable,
                                              const std::string& what) {
  Context& ctx = Context::get();
  prof::Range prof_range("launch", what);
  const bool blocking = ctx.mode() == EagerMode::DeferNeverLaunchBlocking;
  launches_.fetch_add(1, std::memory_order_relaxed);
  const bool tracked_by_output = !blocking && exe.num_outputs() > 0;
  std::unique_ptr<pjrt::Event> done;
  auto outs = exe.execute(ctx.device(device), args, non_donatable, tracked_by_output ? nullptr : &done);
  prof::track_launch(prof_range, outs, device, what);
  if (blocking) {
    try {
      done->wait();
    } catch (const pjrt::Error& e) {
      throw pjrt::Error("torch_tpu: " + what + " failed on the device: " + e.what(), e.code());
    }
    return outs;
  }
  if (tracked_by_output) {
    pjrt::BufferPtr replaced;  // dropped outside the lock (it may be the buffer's last owner)
    const std::thread::id self = std::this_thread::get_id();
    std::lock_guard<std::mutex> lock(mu_);
    for (LastLaunch& l : last_) {
      if (l.thread == self && l.device == device) {
        replaced = std::exchange(l.out, outs.front());
        return outs;
      }
    }
    if (last_.size() >= kMaxLastLaunches)
      std::erase_if(last_, [](const LastLaunch& l) { return finished(*l.out); });
    last_.push_back({self, device, outs.front()});
    return outs;
  }
  std::unique_ptr<pjrt::Event> oldest;
  {
    std::lock_guard<std::mutex> lock(mu_);
    inflight_.push_back(std::move(done));
    if (inflight_.size() % kPollEvery == 0)
      while (!inflight_.empty() && inflight_.front()->ready()) inflight_.pop_front();
    if (inflight_.size() > kMaxInflight) {
      oldest = std::move(inflight_.front());
      inflight_.pop_front();
    }
  }
  if (oldest) oldest->wait();
  return outs;
}

void Executor::synchronize() {
  prof::Range prof_range("synchronize");
  std::deque<std::unique_ptr<pjrt::Event>> pending;
  std::vector<LastLaunch> last;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending.swap(inflight_);
    last.swap(last_);
  }
  for (auto& e : pending) e->wait();
  for (const LastLaunch& l : last) {
    try {
      l.out->wait_ready();  // raises the launch's error, as its completion event did
    } catch (const pjrt::Error&) {
      if (!l.out->is_deleted()) throw;  // donated: its consumer waited for it and is tracked
    }
  }
}

bool Executor::idle() {
  std::lock_guard<std::mutex> lock(mu_);
  while (!inflight_.empty() && inflight_.front()->ready()) inflight_.pop_front();
  std::erase_if(last_, [](const LastLaunch& l) { return finished(*l.out); });
  return inflight_.empty() && last_.empty();
}

}  // namespace tpu::runtime

namespace tpu::runtime {

void ensure_buffer(StorageState& st, shlo::ElemType elem, const shlo::Shape& dims) {
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.buffer) return;
  int64_t numel = 1;
  for (int64_t d : dims) numel *= d;
  std::vector<unsigned char> zeros(static_cast<size_t>(numel * elem_bytes(elem)), 0);
  auto& ctx = Context::get();
  st.hold(ctx.client().from_host(zeros.data(), pjrt_of(elem), dims, ctx.device(st.device)), elem, dims);
}

namespace {

// Host operands repeat (the same learning rate, the same `+ 1`): keep their device copies.
// They are never donated, so sharing one buffer between launches is safe.
struct HostKey {
  unsigned char bytes[16];
  shlo::ElemType elem;
  int device;
  int64_t dim0;
  bool operator==(const HostKey& o) const {
    return std::memcmp(bytes, o.bytes, sizeof bytes) == 0 && elem == o.elem && device == o.device && dim0 == o.dim0;
  }
};
struct HostKeyHash {
  size_t operator()(const HostKey& k) const {
    uint64_t a, b;
    std::memcpy(&a, k.bytes, 8);
    std::memcpy(&b, k.bytes + 8, 8);
    return std::hash<uint64_t>()(a * 0x9E3779B97F4A7C15ull ^ b ^ (static_cast<uint64_t>(k.elem) << 56) ^
                                 (static_cast<uint64_t>(k.device) << 48) ^ static_cast<uint64_t>(k.dim0 + 1));
  }
};

pjrt::BufferPtr upload_host(const HostOperand& h, int device) {
  static std::mutex mu;
  static auto* cache = std::make_unique<std::unordered_map<HostKey, pjrt::BufferPtr, HostKeyHash>>().release();
  HostKey key{{}, h.elem, device, h.dim0};
  std::memcpy(key.bytes, h.bytes, sizeof key.bytes);
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = cache->find(key); it != cache->end()) return it->second;
  }
  auto& ctx = Context::get();
  auto buf = ctx.client().from_host(h.bytes, pjrt_of(h.elem), h.dims(), ctx.device(device));
  std::lock_guard<std::mutex> lock(mu);
  if (cache->size() > 4096) cache->clear();
  cache->emplace(key, buf);
  return buf;
}

// ---------------------------------------------------------------- strict / debug
// `*program` set (the dispatch cache's): no lookup. Key hit: the remembered program, no text
// built. Miss: build, compile (or find the text in the memory/disk cache), remember. Then launch
// with the read storages + host operands; the written storages now hold the results (donated in
// place when they were read too).
void run_strict(const Call& call, ProgramPtr* program, const MissReason& miss_reason) {
  const Plan& plan = *call.plan;
  for (size_t i = 0; i < plan.slots.size(); ++i)
    if (plan.slots[i].read && !call.st[i]->buffer) ensure_buffer(*call.st[i], plan.slots[i].elem, plan.slots[i].dims);
  bool checked = plan.checked && device_checks();  // one more result: the error status
  if (!*program) {
    auto& cache = CompileCache::get();
    const std::string checked_key = checked ? plan.key + "#checked" : std::string();
    const std::string& key = checked ? checked_key : plan.key;
    *program = cache.find_signature(key);
    if (!*program) {
      *program = cache.get_or_compile_program(build_program(plan), plan.what,
                                              miss_reason ? miss_reason() : "new signature");
      cache.remember_signature(key, *program);
    }
  }
  c10::SmallVector<pjrt::BufferPtr, 3> keep;  // host operand buffers live until the launch is queued
  std::vector<PJRT_Buffer*> args;
  args.reserve(plan.slots.size() + call.host.size());
  for (size_t i = 0; i < plan.slots.size(); ++i) {
    if (!plan.slots[i].read) continue;
    if (StorageState::check_dims_enabled() && !std::equal(call.st[i]->dims.begin(), call.st[i]->dims.end(),
                                                          plan.slots[i].dims.begin(), plan.slots[i].dims.end()))
      throw std::logic_error("torch_tpu: " + plan.what + " planned a parameter of other dims than its storage's");
    args.push_back(call.st[i]->buffer->raw());
  }
  for (const HostOperand& h : call.host) {
    keep.push_back(upload_host(h, call.device));
    args.push_back(keep.back()->raw());
  }
  std::vector<CheckSource> sources;  // captured before the status lock (the capture takes the GIL)
  std::optional<CheckedLaunch> check;
  if (checked) {
    sources = check_sources(plan.what);
    check.emplace(call.device);
    args.push_back(check->status_arg());
  }
  auto results = Executor::get().launch(*(*program)->exe, call.device, args, {}, plan.what);
  if (check) check->done(results.back(), std::move(sources));
  size_t ri = 0;
  for (size_t i = 0; i < plan.slots.size(); ++i) {
    const Slot& s = plan.slots[i];
    if (!s.written) continue;
    StorageState* st = call.st[i];
    std::lock_guard<std::mutex> lock(st->mu);
    st->hold(std::move(results[ri++]), s.elem, s.out_dims);
  }
  dispatch_stats().ops++;
  if (check) check->raise_if_due();  // debug eager: the op itself raises
}

// ---------------------------------------------------------------- fused
// DEFER_AND_FUSE: ops are recorded (their plans, plain values) instead of launched; the pending
// program launches at sync points (host reads, synchronize, data-dependent ops, direct buffer
// access, size limit). Recording builds no program text: every touched storage gets a pending
// id (kept in the storage itself), and the *trace key* (each op's interned key id + which pending
// storages its slots are + the arguments the trace reads) identifies the program. A repeated loop body hits the signature index and
// launches at once; only a new structure replays the plans through emit_op to build the text.
struct TraceArg {  // a pending storage the trace reads before writing it: a program argument
  int id;
  shlo::ElemType elem;
  Dims dims;  // its buffer's
};

struct RecordedOp {
  std::shared_ptr<const Plan> plan;  // kept alive until the flush (build_trace replays it on a miss)
  size_t first_id;                   // its slots' pending ids: Pending::slot_ids[first_id, + slots)
};

struct PendingStorage {  // one storage the pending program touches, by pending id
  StorageState* st;      // null once it died: its pending value is no longer a result
  shlo::ElemType elem;   // element type of its pending value
  bool written;
  Dims dims;             // shape of its pending value (runtime/storage.h)
  // Read before any write while it had no buffer (never written: reads as zeros). The program
  // makes the zeros itself, elements of `elem` (then the read type): no host upload, no argument.
  int64_t zeros = -1;
};

// Every container is cleared, not dropped, by a flush: a repeated loop body records into the
// same memory, so recording allocates nothing once warm.
struct Pending {
  std::mutex mu;  // never re-entered: nothing under it frees a storage (fused_forget) or records
  int device = -1;
  // Bumped by every flush once its results are stored: a storage's fused_id is valid while its
  // fused_epoch equals it. Atomic: fused_forget reads it without the lock.
  std::atomic<uint64_t> epoch{1};
  std::vector<RecordedOp> ops;
  std::vector<int> slot_ids;                      // pending id of each recorded slot
  std::vector<uint64_t> key;                      // trace key so far (words, see fused_record)
  std::vector<PendingStorage> storages;           // by pending id
  std::vector<int> written;                       // ids in first-write order
  std::vector<TraceArg> args;                     // storage arguments, in first-read order
  std::vector<pjrt::BufferPtr> arg_bufs;          // program arguments (storages and host operands)
  std::vector<CheckSource> checks;                // checked ops: the program's last result is a status
  int64_t flops = 0;                              // estimate: sum over ops of their largest slot
  // Scratch of flush_locked, kept for its capacity.
  std::string key_text;
  std::vector<int> targets;
  std::vector<PJRT_Buffer*> raw_args;
};
constexpr size_t kMaxFusedOps = 512;

// XLA:CPU runs a program on the caller's thread only when its HLO cost analysis counts fewer than
// 1,000 flops (PjRtCpuExecutable::cheap_computation_, not settable through the C API); anything
// larger is handed to its thread pool, a hop of 10-80 us (the caller then waits for that thread),
// far more than a second launch (~2 us). So a pending program of small ops is launched early,
// before the op that would take it over the limit: each piece then runs inline. Only when the
// piece has at least kMinPieceOps ops (a launch per few ops would be strict eager again), only
// while the pending program is still below the limit, and only before a small op (a program with
// one op over the limit runs on the pool anyway, so splitting before it would only add a launch).
// The estimate (an op's largest slot, 1 flop per element, as XLA counts elementwise ops and
// reductions) keeps a margin under 1,000; a piece it underestimates just runs on the pool.
constexpr int64_t kInlineFlopBudget = 900;
constexpr size_t kMinPieceOps = 8;

// TORCH_TPU_FUSED_SPLIT=0 turns the early launch off (an A/B switch for benchmarks).
bool split_small_programs() {
  static const bool on = [] {
    const char* v = std::getenv("TORCH_TPU_FUSED_SPLIT");
    return !(v && std::string(v) == "0");
  }();
  return on;
}

// PyTorch rounds every op's result; XLA:CPU contracts one op's multiply into the next op's add
// (FMA). TORCH_TPU_FUSED_FMA=0 compiles fused programs without FMA (pjrt::no_fma_compile_options)
// for CPU-exact rounding; not the default: the 64x4096 GELU block runs ~1.5x slower without it.
// Then the options set by set_fused_program_options (compiled graphs' defaults).
std::string& fused_options_storage() {
  static std::string opts = [] {
    const char* v = std::getenv("TORCH_TPU_FUSED_FMA");
    return v && std::string(v) == "0" ? pjrt::no_fma_compile_options() : std::string();
  }();
  return opts;
}
std::mutex& fused_options_mu() {
  static std::mutex mu;
  return mu;
}
std::string fused_compile_options() {
  std::lock_guard<std::mutex> lock(fused_options_mu());
  return fused_options_storage();
}

int64_t op_flops(const Plan& plan) {
  int64_t n = 0;
  for (const Slot& s : plan.slots) n = std::max(n, s.numel);
  return n;
}

Pending& pending() {
  static auto* p = std::make_unique<Pending>().release();
  return *p;
}

// A plan key's short name in trace keys: one word instead of its ~100 characters, remembered in
// the plan. Ids are never reused (the table is dropped when large, a key seen again gets a new
// id), so equal ids always mean equal keys. Called under Pending::mu.
uint64_t plan_key_id(const Plan& plan) {
  if (plan.trace_key_id) return plan.trace_key_id;
  static auto* ids = std::make_unique<std::unordered_map<std::string, uint64_t>>().release();
  static uint64_t next = 1;
  if (ids->size() >= (size_t{1} << 16)) ids->clear();
  auto [it, fresh] = ids->try_emplace(plan.key, next);
  if (fresh) ++next;
  plan.trace_key_id = it->second;
  return it->second;
}

// Replays the recorded plans into one program: arguments in recording order, results = the
// live written storages in first-write order (donating the ones that were arguments).
std::string build_trace(const Pending& p, const std::vector<int>& targets) {
  shlo::Builder b;
  std::vector<Value> value_of(p.storages.size());
  std::vector<int> arg_index(p.storages.size(), -1);
  std::vector<Type> arg_type(p.storages.size());
  size_t next_storage_arg = 0;
  for (const RecordedOp& op : p.ops) {
    const Plan& plan = *op.plan;
    const int* ids = p.slot_ids.data() + op.first_id;
    std::vector<Value> cur(plan.slots.size());
    for (size_t i = 0; i < plan.slots.size(); ++i) {
      if (!plan.slots[i].read) continue;
      int id = ids[i];
      if (value_of[id].id < 0 && p.storages[id].zeros >= 0) {
        value_of[id] = b.zeros(Type{plan.slots[i].elem, {p.storages[id].zeros}});
      } else if (value_of[id].id < 0) {
        const TraceArg& a = p.args[next_storage_arg++];
        value_of[id] = b.arg(Type{a.elem, shlo::Shape(a.dims.begin(), a.dims.end())});
        arg_index[id] = b.num_args() - 1;
        arg_type[id] = value_of[id].type;
      }
      cur[i] = value_of[id];
    }
    std::vector<Value> host_vals;
    for (const HostOperand& h : plan.host) host_vals.push_back(b.arg(Type{h.elem, h.dims()}));
    emit_op(b, cur, host_vals, plan);
    for (size_t i = 0; i < plan.slots.size(); ++i)
      if (plan.slots[i].written) value_of[ids[i]] = cur[i];
  }
  std::vector<Value> results;
  for (int id : targets) {
    const Dims& d = p.storages[id].dims;  // what fused_record says the storage will hold
    const shlo::Shape dims(d.begin(), d.end());
    // Donated only into a result of the same type (a storage read as complex pairs may change).
    if (arg_index[id] >= 0 && arg_type[id].str() == Type{p.storages[id].elem, dims}.str())
      b.alias(arg_index[id], static_cast<int>(results.size()));
    results.push_back(value_of[id].shape() == dims ? value_of[id] : b.reshape(value_of[id], dims));
  }
  if (!p.checks.empty()) {  // the device's status: last argument, donated to the last result
    Value status = b.arg(Type{shlo::ElemType::S32, {2}});
    b.alias(b.num_args() - 1, static_cast<int>(results.size()));
    results.push_back(b.fold_status(status));
  }
  return b.module(results);
}

// Empties the pending program on every way out of flush_locked (a failed compile or launch
// included), then bumps the epoch: every recorded storage's pending id is forgotten at once.
struct PendingReset {
  Pending& p;
  ~PendingReset() {
    p.ops.clear();
    p.slot_ids.clear();
    p.key.clear();
    p.storages.clear();
    p.written.clear();
    p.args.clear();
    p.arg_bufs.clear();
    p.checks.clear();
    p.flops = 0;
    p.device = -1;
    p.epoch.fetch_add(1, std::memory_order_release);
  }
};

std::atomic<int64_t> flush_counts[static_cast<int>(FlushReason::kCount)];

void flush_locked(Pending& p, FlushReason why) {
  if (p.ops.empty()) return;
  flush_counts[static_cast<int>(why)].fetch_add(1, std::memory_order_relaxed);
  PendingReset reset{p};
  // The signature key: the trace key's words, then the results (live written storages).
  p.targets.clear();
  for (int id : p.written)
    if (p.storages[id].st) p.targets.push_back(id);  // a storage that died is not a result
  if (p.targets.empty()) return;  // nothing observable was computed
  std::string& key = p.key_text;
  key.assign("fused trace\n");  // never equal to an op's signature key
  key.append(reinterpret_cast<const char*>(p.key.data()), p.key.size() * sizeof(uint64_t));
  key += '>';
  key.append(reinterpret_cast<const char*>(p.targets.data()), p.targets.size() * sizeof(int));
  auto& cache = CompileCache::get();
  ProgramPtr program = cache.find_signature(key);
  if (!program) {
    program = cache.get_or_compile_program(build_trace(p, p.targets),
                                           "fused graph (" + std::to_string(p.ops.size()) + " ops)",
                                           "new fused graph structure", fused_compile_options());
    cache.remember_signature(key, program);
  }
  p.raw_args.clear();
  for (const auto& bptr : p.arg_bufs) p.raw_args.push_back(bptr->raw());
  std::optional<CheckedLaunch> check;
  if (!p.checks.empty()) {
    check.emplace(p.device);
    p.raw_args.push_back(check->status_arg());
  }
  auto outs = Executor::get().launch(*program->exe, p.device, p.raw_args, {}, "fused graph");
  if (check) check->done(outs.back(), std::move(p.checks));
  for (size_t i = 0; i < p.targets.size(); ++i) {
    const PendingStorage& ps = p.storages[p.targets[i]];
    std::lock_guard<std::mutex> lock(ps.st->mu);
    ps.st->hold(std::move(outs[i]), ps.elem, ps.dims);
  }
  if (check) check->raise_if_due();
}

// The trace key, appended per op as words (exact: a plan id fixes the op's slot count, and a
// slot's tag says which words follow): plan id * 2 + checked; per slot its pending id, a tag 'A'
// (read before any pending write: a program argument; then the element type, and its buffer's
// rank and dims as more words), 'Z' (a storage never written: zeros made in the program; the
// element type, then the element count as one more word), 'W' (first touched by a write) or '-'
// (seen before).
uint64_t slot_word(int id, char tag, shlo::ElemType elem = shlo::ElemType::U8) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(id)) << 16) | (static_cast<uint64_t>(tag) << 8) |
         static_cast<uint64_t>(elem);
}

void fused_record(const Call& call) {
  const Plan& plan = *call.plan;
  const bool checked = plan.checked && device_checks();
  LaunchSite site;
  if (checked) site = capture_site();  // before the lock: it may wait for the GIL
  const int64_t flops = op_flops(plan);
  Pending& p = pending();
  std::lock_guard<std::mutex> lock(p.mu);
  if (!p.ops.empty() && p.device != call.device) flush_locked(p, FlushReason::DeviceChange);
  if (p.ops.size() >= kMinPieceOps && split_small_programs() && flops < kInlineFlopBudget &&
      p.flops < kInlineFlopBudget && p.flops + flops >= kInlineFlopBudget)
    flush_locked(p, FlushReason::InlineSplit);  // the pending piece runs inline; this op starts the next
  p.flops += flops;
  p.device = call.device;
  const uint64_t epoch = p.epoch.load(std::memory_order_relaxed);  // only flushes change it
  const size_t first_id = p.slot_ids.size();
  p.key.push_back(plan_key_id(plan) * 2 + (checked ? 1 : 0));
  for (size_t i = 0; i < plan.slots.size(); ++i) {
    const Slot& s = plan.slots[i];
    StorageState* st = call.st[i];
    const bool fresh = st->fused_epoch != epoch;
    if (fresh) {
      st->fused_epoch = epoch;
      st->fused_id = static_cast<int>(p.storages.size());
      p.storages.push_back({st, s.elem, false, {}});
    }
    const int id = st->fused_id;
    p.slot_ids.push_back(id);
    if (fresh && s.read && !st->buffer) {  // never written: zeros made by the program
      const int64_t n = static_cast<int64_t>(st->nbytes) / elem_bytes(s.elem);
      p.storages[id].zeros = n;
      p.storages[id].dims.assign(1, n);
      p.key.push_back(slot_word(id, 'Z', s.elem));
      p.key.push_back(static_cast<uint64_t>(n));
    } else if (fresh && s.read) {  // read before any pending value: its current buffer is an argument
      p.args.push_back({id, st->elem, st->dims});
      p.storages[id].dims = st->dims;
      p.arg_bufs.push_back(st->buffer);
      p.key.push_back(slot_word(id, 'A', st->elem));
      p.key.push_back(st->dims.size());
      for (int64_t d : st->dims) p.key.push_back(static_cast<uint64_t>(d));
    } else {
      p.key.push_back(slot_word(id, fresh ? 'W' : '-'));
    }
  }
  for (const HostOperand& h : call.host) p.arg_bufs.push_back(upload_host(h, call.device));
  for (size_t i = 0; i < plan.slots.size(); ++i) {
    if (!plan.slots[i].written) continue;
    PendingStorage& ps = p.storages[p.slot_ids[first_id + i]];
    // A partial write as the other element width (through view_as_real / view_as_complex) makes
    // the value flat (runtime/view_io as_elem).
    const bool rewidth = elem_bytes(ps.elem) != elem_bytes(plan.slots[i].elem);
    ps.elem = plan.slots[i].elem;
    // A whole write gives the view's shape; a partial one (always after a read) keeps the dims.
    if (plan.slots[i].whole_write) ps.dims.assign(plan.slots[i].out_dims.begin(), plan.slots[i].out_dims.end());
    else if (rewidth) ps.dims.assign(1, static_cast<int64_t>(call.st[i]->nbytes) / elem_bytes(ps.elem));
    if (!ps.written) {
      ps.written = true;
      p.written.push_back(p.slot_ids[first_id + i]);
    }
  }
  if (checked) p.checks.push_back({0, plan.what, site});  // part of the trace key: one more result
  p.ops.push_back({call.plan, first_id});
  dispatch_stats().ops++;
  if (p.ops.size() >= kMaxFusedOps) flush_locked(p, FlushReason::SizeLimit);
}

}  // namespace

void execute(const Call& call, ProgramPtr* program, const MissReason& miss_reason) {
  if (Context::get().mode() == EagerMode::DeferAndFuse) fused_record(call);
  else run_strict(call, program, miss_reason);  // debug mode waits inside Executor::launch
}

void fused_flush(FlushReason why) {
  Pending& p = pending();
  std::lock_guard<std::mutex> lock(p.mu);
  flush_locked(p, why);
}

void set_fused_program_options(const std::string& options) {
  static const std::string base = fused_compile_options();  // TORCH_TPU_FUSED_FMA's part
  std::lock_guard<std::mutex> lock(fused_options_mu());
  fused_options_storage() = base + options;
}

const char* flush_reason_name(FlushReason r) {
  static const char* names[] = {"other", "host_transfer", "compiled_graph", "synchronize",
                                "inline_split", "size_limit", "device_change"};
  static_assert(std::size(names) == static_cast<size_t>(FlushReason::kCount));
  return names[static_cast<int>(r)];
}

std::vector<int64_t> fused_flush_counts() {
  std::vector<int64_t> out;
  for (const auto& c : flush_counts) out.push_back(c.load(std::memory_order_relaxed));
  return out;
}

void fused_forget(StorageState* st) {
  // A dying storage is recorded by nobody else: its fused_epoch can be read without the lock.
  // An older epoch needs no lock either: a flush bumps the epoch only after it stored its results,
  // so a storage a running flush still writes to compares equal and waits for the lock below.
  if (st->fused_epoch == 0) return;  // never part of a fused program
  Pending& p = pending();
  if (st->fused_epoch != p.epoch.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(p.mu);
  if (st->fused_epoch != p.epoch.load(std::memory_order_relaxed)) return;  // flushed meanwhile
  p.storages[st->fused_id].st = nullptr;  // its pending value is no longer a result
  st->fused_epoch = 0;
}

double raw_launch_floor_us(int iters) {
  shlo::Builder b;
  Type t{shlo::ElemType::F32, {4}};
  Value x = b.arg(t), y = b.arg(t);
  auto program = CompileCache::get().get_or_compile_program(b.module({b.add(x, y)}), "raw launch floor", "benchmark");
  auto& ctx = Context::get();
  PJRT_Device* dev = ctx.device(0);
  const float host[4] = {1, 2, 3, 4};
  auto a = ctx.client().from_host(host, pjrt::ElementType::F32, {4}, dev);
  auto c = ctx.client().from_host(host, pjrt::ElementType::F32, {4}, dev);
  const std::vector<PJRT_Buffer*> args{a->raw(), c->raw()};
  auto run = [&] {
    std::unique_ptr<pjrt::Event> done;
    auto outs = program->exe->execute(dev, args, {}, &done);
    done->wait();
  };
  for (int i = 0; i < 100; ++i) run();  // warm-up
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) run();
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / iters;
}

}  // namespace tpu::runtime
