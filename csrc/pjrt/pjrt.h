// RAII C++ over the PJRT C API. Knows nothing about ATen: buffers are typed byte arrays on a device.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "pjrt_c_api.h"

namespace tpu::pjrt {

// Every PJRT failure becomes this exception carrying the plugin's own message.
class Error : public std::runtime_error {
 public:
  Error(const std::string& msg, int code) : std::runtime_error(msg), code_(code) {}
  int code() const { return code_; }
  bool is_resource_exhausted() const { return code_ == PJRT_Error_Code_RESOURCE_EXHAUSTED; }

 private:
  int code_;
};

// The loaded plugin: dlopen handle + the PJRT_Api table. Kept alive for the process lifetime
// because plugins generally do not support unloading.
class Api {
 public:
  static std::shared_ptr<Api> load(const std::string& path);
  const PJRT_Api* raw() const { return api_; }
  // Throws Error (with `what` as context) when `err` is non-null; destroys the error either way.
  void check(PJRT_Error* err, std::string_view what) const;
  std::string version_string() const;
  const std::string& path() const { return path_; }
  // The plugin's extension of `type` (walking extension_start), or null when it offers none.
  const PJRT_Extension_Base* extension(PJRT_Extension_Type type) const;
  // Whether device buffers are host memory (XLA:CPU; set by the Client): host reads copy them
  // directly (Buffer::to_host).
  bool host_memory_buffers() const { return host_memory_buffers_.load(std::memory_order_relaxed); }
  void set_host_memory_buffers(bool on) const { host_memory_buffers_.store(on, std::memory_order_relaxed); }

 private:
  mutable std::atomic<bool> host_memory_buffers_{false};
  const PJRT_Api* api_ = nullptr;
  void* handle_ = nullptr;
  std::string path_;
};

class Event {
 public:
  Event(std::shared_ptr<const Api> api, PJRT_Event* ev) : api_(std::move(api)), ev_(ev) {}
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  ~Event();
  void wait();  // throws the execution's error, if any
  bool ready() const;

 private:
  std::shared_ptr<const Api> api_;
  PJRT_Event* ev_;
};

enum class ElementType : int {
  Pred = PJRT_Buffer_Type_PRED, S8 = PJRT_Buffer_Type_S8, S16 = PJRT_Buffer_Type_S16,
  S32 = PJRT_Buffer_Type_S32, S64 = PJRT_Buffer_Type_S64, U8 = PJRT_Buffer_Type_U8,
  U16 = PJRT_Buffer_Type_U16, U32 = PJRT_Buffer_Type_U32, U64 = PJRT_Buffer_Type_U64,
  F16 = PJRT_Buffer_Type_F16, BF16 = PJRT_Buffer_Type_BF16, F32 = PJRT_Buffer_Type_F32,
  F64 = PJRT_Buffer_Type_F64, F8E4M3FN = PJRT_Buffer_Type_F8E4M3FN, F8E5M2 = PJRT_Buffer_Type_F8E5M2,
  C64 = PJRT_Buffer_Type_C64, C128 = PJRT_Buffer_Type_C128,
};

class Client;

// One device buffer. Shared ownership: a storage and an in-flight host read may both hold it.
class Buffer {
 public:
  Buffer(std::shared_ptr<const Api> api, PJRT_Buffer* buf) : api_(std::move(api)), buf_(buf) {}
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();
  PJRT_Buffer* raw() const { return buf_; }
  // Copies the whole buffer into `dst` (row-major), waiting for completion.
  void to_host(void* dst, size_t nbytes) const;
  std::vector<int64_t> dims() const;
  ElementType element_type() const;
  // Waits until the buffer's producer finished (errors surface here).
  void wait_ready() const;
  // Whether the producer finished (an error counts as finished: wait_ready raises it).
  bool ready() const;
  // Donated to a later launch (or deleted): its contents and ready event are gone.
  bool is_deleted() const;
  std::shared_ptr<Buffer> copy_to_device(PJRT_Device* dev) const;

 private:
  bool read_host_memory(void* dst, size_t nbytes) const;
  std::shared_ptr<const Api> api_;
  PJRT_Buffer* buf_;
};
using BufferPtr = std::shared_ptr<Buffer>;

class Executable {
 public:
  Executable(std::shared_ptr<const Api> api, PJRT_LoadedExecutable* exe);
  Executable(const Executable&) = delete;
  Executable& operator=(const Executable&) = delete;
  ~Executable();
  size_t num_outputs() const { return num_outputs_; }
  // Size of the generated code as the plugin reports it (0 when it does not say).
  int64_t code_bytes() const { return code_bytes_; }
  // Launches on `device`; returns as soon as PJRT accepted the launch. `done`, when given,
  // receives the completion event.
  std::vector<BufferPtr> execute(PJRT_Device* device, const std::vector<PJRT_Buffer*>& args,
                                 const std::vector<int64_t>& non_donatable,
                                 std::unique_ptr<Event>* done) const;
  std::string serialize() const;

 private:
  std::shared_ptr<const Api> api_;
  PJRT_LoadedExecutable* exe_;
  size_t num_outputs_ = 0;
  int64_t code_bytes_ = 0;
};
using ExecutablePtr = std::shared_ptr<Executable>;

struct DeviceInfo {
  PJRT_Device* device;
  int id;
  std::string kind;
  std::string debug_string;
};

class Client {
 public:
  Client(std::shared_ptr<const Api> api, int64_t cpu_device_count);
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;
  ~Client();
  const std::vector<DeviceInfo>& devices() const { return devices_; }
  const std::string& platform_name() const { return platform_name_; }
  const std::string& platform_version() const { return platform_version_; }
  const Api& api() const { return *api_; }
  ExecutablePtr compile(const std::string& mlir, const std::string& compile_options) const;
  ExecutablePtr deserialize(const std::string& bytes) const;
  // Host data is copied before return (kImmutableOnlyDuringCall).
  BufferPtr from_host(const void* data, ElementType type, const std::vector<int64_t>& dims,
                      PJRT_Device* device) const;
  // Device memory statistics when the plugin offers them; false otherwise.
  bool memory_stats(PJRT_Device* device, int64_t* in_use, int64_t* limit) const;

 private:
  std::shared_ptr<const Api> api_;
  PJRT_Client* client_ = nullptr;
  std::vector<DeviceInfo> devices_;
  std::string platform_name_, platform_version_;
};

// Serialized xla.CompileOptionsProto asking for a portable executable (runs on any device of the
// client given execute_device), one replica, one partition. See compile_options() for the bytes.
const std::string& portable_compile_options();

// Serialized xla.CompileOptionsProto fields (CompileCache's `extra_options`) that keep XLA:CPU
// from contracting a * b + c into one fused multiply-add across ops. Its LLVM target options
// always allow FMA fusion (xla/service/cpu CompilerTargetOptions: AllowFPOpFusion = Fast; fast-math
// flags do not change it), so the only switch is the instruction set: env_option_overrides
// {xla_cpu_max_isa: "AVX"} (AVX has no FMA). Fused eager programs use it (runtime/executor.cc).
const std::string& no_fma_compile_options();

}  // namespace tpu::pjrt
