#include "executor.h"

#include <algorithm>
#include <unordered_map>

#include "compile_cache.h"
#include "context.h"
#include "profiler.h"

namespace tpu::runtime {

using shlo::Type;
using shlo::Value;

DispatchStats& dispatch_stats() {
  static DispatchStats s;
  return s;
}

namespace {
constexpr size_t kMaxInflight = 512;
}

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
  std::unique_ptr<pjrt::Event> done;
  auto outs = exe.execute(ctx.device(device), args, non_donatable, &done);
  prof::track_launch(prof_range, outs, device, what);
  if (ctx.mode() == EagerMode::DeferNeverLaunchBlocking) {
    try {
      done->wait();
    } catch (const pjrt::Error& e) {
      throw pjrt::Error("torch_tpu: " + what + " failed on the device: " + e.what(), e.code());
    }
    return outs;
  }
  std::unique_ptr<pjrt::Event> oldest;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++launches_;
    inflight_.push_back(std::move(done));
    while (!inflight_.empty() && inflight_.front()->ready()) inflight_.pop_front();
    if (inflight_.size() > kMaxInflight) {
      oldest = std::move(inflight_.front());
      inflight_.pop_front();
    }
  }
  if (oldest) oldest->wait();  // back-pressure: never more than kMaxInflight launches queued
  return outs;
}

void Executor::synchronize() {
  prof::Range prof_range("synchronize");
  std::deque<std::unique_ptr<pjrt::Event>> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending.swap(inflight_);
  }
  for (auto& e : pending) e->wait();
}

bool Executor::idle() {
  std::lock_guard<std::mutex> lock(mu_);
  while (!inflight_.empty() && inflight_.front()->ready()) inflight_.pop_front();
  return inflight_.empty();
}

}  // namespace tpu::runtime

namespace tpu::runtime {

void ensure_buffer(StorageState& st, shlo::ElemType elem, int64_t numel) {
  std::lock_guard<std::mutex> lock(st.mu);
  if (st.buffer) return;
  std::vector<unsigned char> zeros(static_cast<size_t>(numel * elem_bytes(elem)), 0);
  auto& ctx = Context::get();
  st.buffer = ctx.client().from_host(zeros.data(), pjrt_of(elem), {numel}, ctx.device(st.device));
  st.elem = elem;
}

namespace {

// Host operands repeat (the same learning rate, the same `+ 1`): keep their device copies.
// They are never donated, so sharing one buffer between launches is safe.
pjrt::BufferPtr upload_host(const HostOperand& h, int device) {
  static std::mutex mu;
  static auto* cache = std::make_unique<std::unordered_map<std::string, pjrt::BufferPtr>>().release();
  std::string key(reinterpret_cast<const char*>(h.bytes), sizeof h.bytes);
  key += static_cast<char>(h.elem);
  key += static_cast<char>(device);
  key += static_cast<char>(h.dims.size());
  {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = cache->find(key); it != cache->end()) return it->second;
  }
  auto& ctx = Context::get();
  auto buf = ctx.client().from_host(h.bytes, pjrt_of(h.elem), h.dims, ctx.device(device));
  std::lock_guard<std::mutex> lock(mu);
  if (cache->size() > 4096) cache->clear();
  cache->emplace(key, buf);
  return buf;
}

// ---------------------------------------------------------------- strict / debug
// Key hit: the remembered program, no text built. Miss: build, compile (or find the text in the
// memory/disk cache), remember. Then launch with the read storages + host operands; the written
// storages now hold the results (donated in place when they were read too).
void run_strict(const Plan& plan) {
  for (const Slot& s : plan.slots)
    if (s.read && !s.st->buffer) ensure_buffer(*s.st, s.elem, s.numel);
  auto& cache = CompileCache::get();
  ProgramPtr program = cache.find_signature(plan.key);
  if (!program) {
    program = cache.get_or_compile_program(build_program(plan), plan.what(),
                                           plan.miss_reason ? plan.miss_reason() : "new signature");
    cache.remember_signature(plan.key, program);
  }
  std::vector<pjrt::BufferPtr> keep;  // host operand buffers live until the launch is queued
  std::vector<PJRT_Buffer*> args;
  keep.reserve(plan.host.size());
  args.reserve(plan.slots.size() + plan.host.size());
  for (const Slot& s : plan.slots)
    if (s.read) args.push_back(s.st->buffer->raw());
  for (const HostOperand& h : plan.host) {
    keep.push_back(upload_host(h, plan.device));
    args.push_back(keep.back()->raw());
  }
  auto results = Executor::get().launch(*program->exe, plan.device, args, {}, plan.what());
  size_t ri = 0;
  for (const Slot& s : plan.slots) {
    if (!s.written) continue;
    std::lock_guard<std::mutex> lock(s.st->mu);
    s.st->buffer = results[ri++];
    s.st->elem = s.elem;
  }
  dispatch_stats().ops++;
}

// ---------------------------------------------------------------- fused
// DEFER_AND_FUSE: ops are emitted into one pending program instead of launching. Each storage
// touched holds its *pending value*; the program is launched at sync points (host reads,
// synchronize, data-dependent ops, direct buffer access, size limit) and its text - which
// depends only on the recorded structure, never on scalar values - is the compile-cache key,
// so a repeated loop body compiles once.
struct Pending {
  std::recursive_mutex mu;
  std::unique_ptr<shlo::Builder> b;
  int device = -1;
  int ops = 0;
  std::unordered_map<StorageState*, Value> cur;
  std::unordered_map<StorageState*, int> arg_of;
  std::vector<pjrt::BufferPtr> arg_bufs;  // in program-argument order
  std::vector<StorageState*> written;     // first-write order (deterministic program text)
};
constexpr int kMaxFusedOps = 512;

Pending& pending() {
  static auto* p = std::make_unique<Pending>().release();
  return *p;
}

void flush_locked(Pending& p) {
  if (p.ops == 0) return;
  std::vector<Value> results;
  std::vector<StorageState*> targets;
  for (StorageState* st : p.written) {
    auto it = p.cur.find(st);
    if (it == p.cur.end()) continue;  // storage died before the flush
    if (auto a = p.arg_of.find(st); a != p.arg_of.end()) p.b->alias(a->second, static_cast<int>(results.size()));
    results.push_back(it->second);
    targets.push_back(st);
  }
  int ops = p.ops;
  int device = p.device;
  std::vector<pjrt::BufferPtr> bufs = std::move(p.arg_bufs);
  std::string mlir = results.empty() ? std::string() : p.b->module(results);
  p.b.reset();
  p.cur.clear();
  p.arg_of.clear();
  p.arg_bufs.clear();
  p.written.clear();
  p.ops = 0;
  p.device = -1;
  if (results.empty()) return;
  auto exe = CompileCache::get().get_or_compile(mlir, "fused graph (" + std::to_string(ops) + " ops)",
                                                "new fused graph structure");
  std::vector<PJRT_Buffer*> raw;
  for (const auto& bptr : bufs) raw.push_back(bptr->raw());
  auto outs = Executor::get().launch(*exe, device, raw, {}, "fused graph");
  for (size_t i = 0; i < targets.size(); ++i) {
    std::lock_guard<std::mutex> lock(targets[i]->mu);
    targets[i]->buffer = outs[i];
    targets[i]->elem = results[i].elem();
  }
}

void fused_record(const Plan& plan) {
  Pending& p = pending();
  std::lock_guard<std::recursive_mutex> lock(p.mu);
  if (p.ops > 0 && p.device != plan.device) flush_locked(p);
  if (!p.b) {
    p.b = std::make_unique<shlo::Builder>();
    p.device = plan.device;
  }
  shlo::Builder& b = *p.b;
  std::vector<Value> cur(plan.slots.size());
  for (size_t i = 0; i < plan.slots.size(); ++i) {
    const Slot& s = plan.slots[i];
    if (!s.read) continue;
    if (auto it = p.cur.find(s.st); it != p.cur.end()) {
      cur[i] = it->second;
      continue;
    }
    ensure_buffer(*s.st, s.elem, s.numel);
    int64_t n = static_cast<int64_t>(s.st->nbytes) / elem_bytes(s.st->elem);
    Value v = b.arg(Type{s.st->elem, {n}});
    p.arg_of[s.st] = b.num_args() - 1;
    p.arg_bufs.push_back(s.st->buffer);
    p.cur[s.st] = v;
    cur[i] = v;
  }
  std::vector<Value> host_vals;
  for (const HostOperand& h : plan.host) {
    p.arg_bufs.push_back(upload_host(h, plan.device));
    host_vals.push_back(b.arg(Type{h.elem, h.dims}));
  }
  emit_op(b, cur, host_vals, plan);
  for (size_t i = 0; i < plan.slots.size(); ++i) {
    const Slot& s = plan.slots[i];
    if (!s.written) continue;
    // A storage address can come back (freed, then reallocated): list each address once.
    if (std::find(p.written.begin(), p.written.end(), s.st) == p.written.end()) p.written.push_back(s.st);
    p.cur[s.st] = cur[i];
  }
  dispatch_stats().ops++;
  if (++p.ops >= kMaxFusedOps) flush_locked(p);
}

}  // namespace

void execute(const Plan& plan) {
  if (Context::get().mode() == EagerMode::DeferAndFuse) fused_record(plan);
  else run_strict(plan);  // debug mode waits inside Executor::launch
}

void fused_flush() {
  Pending& p = pending();
  std::lock_guard<std::recursive_mutex> lock(p.mu);
  flush_locked(p);
}

void fused_forget(StorageState* st) {
  Pending& p = pending();
  std::lock_guard<std::recursive_mutex> lock(p.mu);
  if (p.ops == 0) return;
  p.cur.erase(st);
  p.arg_of.erase(st);
}

}  // namespace tpu::runtime
