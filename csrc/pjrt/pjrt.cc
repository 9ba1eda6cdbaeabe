#include "pjrt.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>

#include <dlfcn.h>
#include <malloc.h>

#include <mutex>
#include <unordered_map>

namespace tpu::pjrt {

namespace {
// XLA:CPU's device buffers and program temporaries are malloc'd host memory. glibc gives freed
// memory at the heap top back to the OS beyond its trim threshold, which it sets to twice the
// largest freed mmap'd chunk (a few MB here), so every launch page-faults its large buffers in
// again: a GPT-2 forward (bench_models_hf) took 6,000-9,000 page faults and 10-15 ms of kernel
// time, against ~1,000 and 0.7 ms for PyTorch CPU. Like a device's caching allocator, keep freed
// memory for reuse instead: blocks below 32 MB (glibc's own dynamic maximum) come from the heap
// and up to 512 MB of free heap top is kept (torch.accelerator.empty_cache() returns it, see
// aten/allocator.cc). Setting either option turns glibc's dynamic thresholds off, so both are
// set, and neither when the user tuned malloc through the environment.
void keep_freed_host_memory() {
  for (const char* env : {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"})
    if (std::getenv(env)) return;
  if (const char* t = std::getenv("GLIBC_TUNABLES"); t && std::strstr(t, "malloc")) return;
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 512 << 20);
}

template <typename T>
T make_args(size_t size) {
  T a{};
  a.struct_size = size;
  return a;
}
#define PJRT_ARGS(T) make_args<T>(T##_STRUCT_SIZE)
}  // namespace

std::shared_ptr<Api> Api::load(const std::string& path) {
  // Plugins are process-global; load each path once.
  static std::mutex mu;
  static std::unordered_map<std::string, std::shared_ptr<Api>> loaded;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = loaded.find(path); it != loaded.end()) return it->second;

  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    throw Error("torch_tpu: cannot load the PJRT plugin '" + path + "': " + dlerror() +
                    ". Set TORCH_TPU_PJRT_PLUGIN to a valid plugin .so, or `pip install "
                    "xla-cpu-pjrt==0.0.1`.",
                PJRT_Error_Code_NOT_FOUND);
  }
  using GetApiFn = const PJRT_Api* (*)();
  auto get_api = reinterpret_cast<GetApiFn>(dlsym(handle, "GetPjrtApi"));
  if (!get_api) {
    throw Error("torch_tpu: '" + path + "' is not a PJRT plugin (it exports no GetPjrtApi)",
                PJRT_Error_Code_INVALID_ARGUMENT);
  }
  auto api = std::make_shared<Api>();
  api->api_ = get_api();
  api->handle_ = handle;
  api->path_ = path;
  const auto& v = api->api_->pjrt_api_version;
  // A different major version is a different ABI. Within a major version, a plugin newer than
  // our header is fine (structs only grow); an older plugin may lack entries we call, so refuse.
  if (v.major_version != PJRT_API_MAJOR || v.minor_version < PJRT_API_MINOR) {
    throw Error("torch_tpu: PJRT plugin '" + path + "' implements PJRT C API " +
                    std::to_string(v.major_version) + "." + std::to_string(v.minor_version) +
                    " but torch_tpu was built against " + std::to_string(PJRT_API_MAJOR) + "." +
                    std::to_string(PJRT_API_MINOR) +
                    "; install a matching plugin (xla-cpu-pjrt==0.0.1) or rebuild torch_tpu "
                    "against the plugin's pjrt_c_api.h",
                PJRT_Error_Code_FAILED_PRECONDITION);
  }
  auto init = PJRT_ARGS(PJRT_Plugin_Initialize_Args);
  api->check(api->api_->PJRT_Plugin_Initialize(&init), "PJRT_Plugin_Initialize");
  loaded[path] = api;
  return api;
}

void Api::check(PJRT_Error* err, std::string_view what) const {
  if (!err) return;
  auto m = PJRT_ARGS(PJRT_Error_Message_Args);
  m.error = err;
  api_->PJRT_Error_Message(&m);
  std::string msg(m.message, m.message_size);
  auto c = PJRT_ARGS(PJRT_Error_GetCode_Args);
  c.error = err;
  int code = api_->PJRT_Error_GetCode(&c) ? PJRT_Error_Code_UNKNOWN : c.code;
  auto d = PJRT_ARGS(PJRT_Error_Destroy_Args);
  d.error = err;
  api_->PJRT_Error_Destroy(&d);
  throw Error(std::string(what) + ": " + msg, code);
}

std::string Api::version_string() const {
  return std::to_string(api_->pjrt_api_version.major_version) + "." +
         std::to_string(api_->pjrt_api_version.minor_version);
}

const PJRT_Extension_Base* Api::extension(PJRT_Extension_Type type) const {
  for (const PJRT_Extension_Base* e = api_->extension_start; e; e = e->next)
    if (e->type == type) return e;
  return nullptr;
}

// ---------------------------------------------------------------- Event
Event::~Event() {
  auto a = PJRT_ARGS(PJRT_Event_Destroy_Args);
  a.event = ev_;
  api_->raw()->PJRT_Event_Destroy(&a);
}

void Event::wait() {
  auto a = PJRT_ARGS(PJRT_Event_Await_Args);
  a.event = ev_;
  api_->check(api_->raw()->PJRT_Event_Await(&a), "PJRT_Event_Await");
  auto e = PJRT_ARGS(PJRT_Event_Error_Args);
  e.event = ev_;
  api_->check(api_->raw()->PJRT_Event_Error(&e), "execution failed");
}

bool Event::ready() const {
  auto a = PJRT_ARGS(PJRT_Event_IsReady_Args);
  a.event = ev_;
  api_->check(api_->raw()->PJRT_Event_IsReady(&a), "PJRT_Event_IsReady");
  return a.is_ready;
}

// ---------------------------------------------------------------- Buffer
Buffer::~Buffer() {
  auto a = PJRT_ARGS(PJRT_Buffer_Destroy_Args);
  a.buffer = buf_;
  // Destroy defers freeing until in-flight executions that use the buffer complete.
  if (PJRT_Error* e = api_->raw()->PJRT_Buffer_Destroy(&a)) {
    auto d = PJRT_ARGS(PJRT_Error_Destroy_Args);
    d.error = e;
    api_->raw()->PJRT_Error_Destroy(&d);
  }
}

void Buffer::to_host(void* dst, size_t nbytes) const {
  if (api_->host_memory_buffers() && read_host_memory(dst, nbytes)) return;
  auto a = PJRT_ARGS(PJRT_Buffer_ToHostBuffer_Args);
  a.src = buf_;
  a.dst = dst;
  a.dst_size = nbytes;
  api_->check(api_->raw()->PJRT_Buffer_ToHostBuffer(&a), "PJRT_Buffer_ToHostBuffer");
  Event ev(api_, a.event);
  ev.wait();
}

// XLA:CPU's ToHostBuffer runs the copy on its thread pool even when the buffer is ready: a thread
// hop per host read (tens of microseconds on a busy machine, most of a small .item()). Its device
// memory is host memory, so a dense buffer (rank <= 1, the runtime's flat storages) of exactly
// `nbytes` is copied directly once its producer finished, under an external reference (the
// plugin neither frees nor donates it meanwhile). False: take the plugin's path.
bool Buffer::read_host_memory(void* dst, size_t nbytes) const {
  const PJRT_Api* raw = api_->raw();
  auto size = PJRT_ARGS(PJRT_Buffer_OnDeviceSizeInBytes_Args);
  size.buffer = buf_;
  if (raw->PJRT_Buffer_OnDeviceSizeInBytes == nullptr || raw->PJRT_Buffer_OpaqueDeviceMemoryDataPointer == nullptr ||
      raw->PJRT_Buffer_IncreaseExternalReferenceCount == nullptr)
    return false;
  api_->check(raw->PJRT_Buffer_OnDeviceSizeInBytes(&size), "PJRT_Buffer_OnDeviceSizeInBytes");
  if (size.on_device_size_in_bytes != nbytes || dims().size() > 1) return false;
  auto inc = PJRT_ARGS(PJRT_Buffer_IncreaseExternalReferenceCount_Args);
  inc.buffer = buf_;
  try {
    api_->check(raw->PJRT_Buffer_IncreaseExternalReferenceCount(&inc), "PJRT_Buffer_IncreaseExternalReferenceCount");
  } catch (const Error&) {  // e.g. a deleted buffer: the plugin's path reports it
    return false;
  }
  struct Release {
    const Api& api;
    PJRT_Buffer* buf;
    ~Release() {
      auto dec = PJRT_ARGS(PJRT_Buffer_DecreaseExternalReferenceCount_Args);
      dec.buffer = buf;
      if (PJRT_Error* err = api.raw()->PJRT_Buffer_DecreaseExternalReferenceCount(&dec)) {
        try {
          api.check(err, "PJRT_Buffer_DecreaseExternalReferenceCount");
        } catch (const Error&) {  // nothing to recover in a destructor; the count stays raised
        }
      }
    }
  } release{*api_, buf_};
  wait_ready();  // the producer's errors surface here, as from the plugin's copy
  auto ptr = PJRT_ARGS(PJRT_Buffer_OpaqueDeviceMemoryDataPointer_Args);
  ptr.buffer = buf_;
  api_->check(raw->PJRT_Buffer_OpaqueDeviceMemoryDataPointer(&ptr), "PJRT_Buffer_OpaqueDeviceMemoryDataPointer");
  if (nbytes) std::memcpy(dst, ptr.device_memory_ptr, nbytes);
  return true;
}

std::vector<int64_t> Buffer::dims() const {
  auto a = PJRT_ARGS(PJRT_Buffer_Dimensions_Args);
  a.buffer = buf_;
  api_->check(api_->raw()->PJRT_Buffer_Dimensions(&a), "PJRT_Buffer_Dimensions");
  return {a.dims, a.dims + a.num_dims};
}

ElementType Buffer::element_type() const {
  auto a = PJRT_ARGS(PJRT_Buffer_ElementType_Args);
  a.buffer = buf_;
  api_->check(api_->raw()->PJRT_Buffer_ElementType(&a), "PJRT_Buffer_ElementType");
  return static_cast<ElementType>(a.type);
}

void Buffer::wait_ready() const {
  auto a = PJRT_ARGS(PJRT_Buffer_ReadyEvent_Args);
  a.buffer = buf_;
  api_->check(api_->raw()->PJRT_Buffer_ReadyEvent(&a), "PJRT_Buffer_ReadyEvent");
  Event ev(api_, a.event);
  ev.wait();
}

bool Buffer::ready() const {
  auto a = PJRT_ARGS(PJRT_Buffer_ReadyEvent_Args);
  a.buffer = buf_;
  api_->check(api_->raw()->PJRT_Buffer_ReadyEvent(&a), "PJRT_Buffer_ReadyEvent");
  return Event(api_, a.event).ready();
}

bool Buffer::is_deleted() const {
  auto a = PJRT_ARGS(PJRT_Buffer_IsDeleted_Args);
  a.buffer = buf_;
  api_->check(api_->raw()->PJRT_Buffer_IsDeleted(&a), "PJRT_Buffer_IsDeleted");
  return a.is_deleted;
}

BufferPtr Buffer::copy_to_device(PJRT_Device* dev) const {
  auto a = PJRT_ARGS(PJRT_Buffer_CopyToDevice_Args);
  a.buffer = buf_;
  a.dst_device = dev;
  api_->check(api_->raw()->PJRT_Buffer_CopyToDevice(&a), "PJRT_Buffer_CopyToDevice");
  return std::make_shared<Buffer>(api_, a.dst_buffer);
}

// ---------------------------------------------------------------- Executable
Executable::Executable(std::shared_ptr<const Api> api, PJRT_LoadedExecutable* exe)
    : api_(std::move(api)), exe_(exe) {
  auto g = PJRT_ARGS(PJRT_LoadedExecutable_GetExecutable_Args);
  g.loaded_executable = exe_;
  api_->check(api_->raw()->PJRT_LoadedExecutable_GetExecutable(&g), "GetExecutable");
  auto n = PJRT_ARGS(PJRT_Executable_NumOutputs_Args);
  n.executable = g.executable;
  PJRT_Error* err = api_->raw()->PJRT_Executable_NumOutputs(&n);
  if (!err && api_->raw()->PJRT_Executable_SizeOfGeneratedCodeInBytes) {
    auto sz = PJRT_ARGS(PJRT_Executable_SizeOfGeneratedCodeInBytes_Args);
    sz.executable = g.executable;
    if (PJRT_Error* e = api_->raw()->PJRT_Executable_SizeOfGeneratedCodeInBytes(&sz)) {
      auto ed = PJRT_ARGS(PJRT_Error_Destroy_Args);  // optional query: unknown size is 0
      ed.error = e;
      api_->raw()->PJRT_Error_Destroy(&ed);
    } else {
      code_bytes_ = sz.size_in_bytes;
    }
  }
  if (!err && code_bytes_ <= 0 && api_->raw()->PJRT_Executable_GetCompiledMemoryStats) {
    auto ms = PJRT_ARGS(PJRT_Executable_GetCompiledMemoryStats_Args);
    ms.executable = g.executable;
    if (PJRT_Error* e = api_->raw()->PJRT_Executable_GetCompiledMemoryStats(&ms)) {
      auto ed = PJRT_ARGS(PJRT_Error_Destroy_Args);
      ed.error = e;
      api_->raw()->PJRT_Error_Destroy(&ed);
    } else {
      code_bytes_ = std::max<int64_t>(ms.generated_code_size_in_bytes, 0) +
                    std::max<int64_t>(ms.host_generated_code_size_in_bytes, 0);
    }
  }
  auto d = PJRT_ARGS(PJRT_Executable_Destroy_Args);
  d.executable = g.executable;
  api_->raw()->PJRT_Executable_Destroy(&d);
  api_->check(err, "PJRT_Executable_NumOutputs");
  num_outputs_ = n.num_outputs;
}

Executable::~Executable() {
  auto a = PJRT_ARGS(PJRT_LoadedExecutable_Destroy_Args);
  a.executable = exe_;
  if (PJRT_Error* e = api_->raw()->PJRT_LoadedExecutable_Destroy(&a)) {
    auto d = PJRT_ARGS(PJRT_Error_Destroy_Args);
    d.error = e;
    api_->raw()->PJRT_Error_Destroy(&d);
  }
}

std::vector<BufferPtr> Executable::execute(PJRT_Device* device,
                                           const std::vector<PJRT_Buffer*>& args,
                                           const std::vector<int64_t>& non_donatable,
                                           std::unique_ptr<Event>* done) const {
  auto opts = PJRT_ARGS(PJRT_ExecuteOptions);
  opts.non_donatable_input_indices = non_donatable.data();
  opts.num_non_donatable_input_indices = non_donatable.size();
  // Small programs dominate eager: their output list lives on the stack.
  PJRT_Buffer* small[8] = {};
  std::vector<PJRT_Buffer*> big;
  if (num_outputs_ > std::size(small)) big.resize(num_outputs_, nullptr);
  PJRT_Buffer** out_list = big.empty() ? small : big.data();
  PJRT_Buffer* const* arg_list = args.data();
  PJRT_Event* ev = nullptr;
  auto a = PJRT_ARGS(PJRT_LoadedExecutable_Execute_Args);
  a.executable = exe_;
  a.options = &opts;
  a.argument_lists = &arg_list;
  a.num_devices = 1;
  a.num_args = args.size();
  a.output_lists = &out_list;
  a.device_complete_events = done ? &ev : nullptr;
  a.execute_device = device;
  api_->check(api_->raw()->PJRT_LoadedExecutable_Execute(&a), "PJRT_LoadedExecutable_Execute");
  if (done) *done = std::make_unique<Event>(api_, ev);
  std::vector<BufferPtr> result;
  result.reserve(num_outputs_);
  for (size_t i = 0; i < num_outputs_; ++i) result.push_back(std::make_shared<Buffer>(api_, out_list[i]));
  return result;
}

std::string Executable::serialize() const {
  auto g = PJRT_ARGS(PJRT_LoadedExecutable_GetExecutable_Args);
  g.loaded_executable = exe_;
  api_->check(api_->raw()->PJRT_LoadedExecutable_GetExecutable(&g), "GetExecutable");
  auto s = PJRT_ARGS(PJRT_Executable_Serialize_Args);
  s.executable = g.executable;
  PJRT_Error* err = api_->raw()->PJRT_Executable_Serialize(&s);
  std::string out;
  if (!err) {
    out.assign(s.serialized_bytes, s.serialized_bytes_size);
    s.serialized_executable_deleter(s.serialized_executable);
  }
  auto d = PJRT_ARGS(PJRT_Executable_Destroy_Args);
  d.executable = g.executable;
  api_->raw()->PJRT_Executable_Destroy(&d);
  api_->check(err, "PJRT_Executable_Serialize");
  return out;
}

// ---------------------------------------------------------------- Client
Client::Client(std::shared_ptr<const Api> api, int64_t cpu_device_count) : api_(std::move(api)) {
  const PJRT_Api* raw = api_->raw();
  auto opt = PJRT_ARGS(PJRT_NamedValue);
  static const char kName[] = "cpu_device_count";
  opt.name = kName;
  opt.name_size = sizeof(kName) - 1;
  opt.type = PJRT_NamedValue_kInt64;
  opt.int64_value = cpu_device_count;
  opt.value_size = 1;
  auto a = PJRT_ARGS(PJRT_Client_Create_Args);
  a.create_options = &opt;
  a.num_options = cpu_device_count > 0 ? 1 : 0;
  api_->check(raw->PJRT_Client_Create(&a), "PJRT_Client_Create");
  client_ = a.client;

  auto pn = PJRT_ARGS(PJRT_Client_PlatformName_Args);
  pn.client = client_;
  api_->check(raw->PJRT_Client_PlatformName(&pn), "PJRT_Client_PlatformName");
  platform_name_.assign(pn.platform_name, pn.platform_name_size);
  if (platform_name_ == "cpu") {  // XLA:CPU: device memory is host memory
    api_->set_host_memory_buffers(true);
    keep_freed_host_memory();
  }
  auto pv = PJRT_ARGS(PJRT_Client_PlatformVersion_Args);
  pv.client = client_;
  api_->check(raw->PJRT_Client_PlatformVersion(&pv), "PJRT_Client_PlatformVersion");
  platform_version_.assign(pv.platform_version, pv.platform_version_size);

  auto ad = PJRT_ARGS(PJRT_Client_AddressableDevices_Args);
  ad.client = client_;
  api_->check(raw->PJRT_Client_AddressableDevices(&ad), "PJRT_Client_AddressableDevices");
  for (size_t i = 0; i < ad.num_addressable_devices; ++i) {
    PJRT_Device* dev = ad.addressable_devices[i];
    auto gd = PJRT_ARGS(PJRT_Device_GetDescription_Args);
    gd.device = dev;
    api_->check(raw->PJRT_Device_GetDescription(&gd), "PJRT_Device_GetDescription");
    auto id = PJRT_ARGS(PJRT_DeviceDescription_Id_Args);
    id.device_description = gd.device_description;
    api_->check(raw->PJRT_DeviceDescription_Id(&id), "PJRT_DeviceDescription_Id");
    auto k = PJRT_ARGS(PJRT_DeviceDescription_Kind_Args);
    k.device_description = gd.device_description;
    api_->check(raw->PJRT_DeviceDescription_Kind(&k), "PJRT_DeviceDescription_Kind");
    auto ds = PJRT_ARGS(PJRT_DeviceDescription_DebugString_Args);
    ds.device_description = gd.device_description;
    api_->check(raw->PJRT_DeviceDescription_DebugString(&ds), "DebugString");
    devices_.push_back({dev, id.id, std::string(k.device_kind, k.device_kind_size),
                        std::string(ds.debug_string, ds.debug_string_size)});
  }
}

Client::~Client() {
  auto a = PJRT_ARGS(PJRT_Client_Destroy_Args);
  a.client = client_;
  if (PJRT_Error* e = api_->raw()->PJRT_Client_Destroy(&a)) {
    auto d = PJRT_ARGS(PJRT_Error_Destroy_Args);
    d.error = e;
    api_->raw()->PJRT_Error_Destroy(&d);
  }
}

ExecutablePtr Client::compile(const std::string& mlir, const std::string& compile_options) const {
  auto prog = PJRT_ARGS(PJRT_Program);
  std::string code = mlir;  // PJRT_Program.code is non-const
  prog.code = code.data();
  prog.code_size = code.size();
  static const char kFormat[] = "mlir";
  prog.format = kFormat;
  prog.format_size = sizeof(kFormat) - 1;
  auto a = PJRT_ARGS(PJRT_Client_Compile_Args);
  a.client = client_;
  a.program = &prog;
  a.compile_options = compile_options.data();
  a.compile_options_size = compile_options.size();
  api_->check(api_->raw()->PJRT_Client_Compile(&a), "PJRT_Client_Compile");
  return std::make_shared<Executable>(api_, a.executable);
}

ExecutablePtr Client::deserialize(const std::string& bytes) const {
  auto a = PJRT_ARGS(PJRT_Executable_DeserializeAndLoad_Args);
  a.client = client_;
  a.serialized_executable = bytes.data();
  a.serialized_executable_size = bytes.size();
  api_->check(api_->raw()->PJRT_Executable_DeserializeAndLoad(&a),
              "PJRT_Executable_DeserializeAndLoad");
  return std::make_shared<Executable>(api_, a.loaded_executable);
}

BufferPtr Client::from_host(const void* data, ElementType type, const std::vector<int64_t>& dims,
                            PJRT_Device* device) const {
  auto a = PJRT_ARGS(PJRT_Client_BufferFromHostBuffer_Args);
  a.client = client_;
  a.data = data;
  a.type = static_cast<PJRT_Buffer_Type>(type);
  a.dims = dims.data();
  a.num_dims = dims.size();
  a.host_buffer_semantics = PJRT_HostBufferSemantics_kImmutableOnlyDuringCall;
  a.device = device;
  api_->check(api_->raw()->PJRT_Client_BufferFromHostBuffer(&a), "BufferFromHostBuffer");
  if (a.done_with_host_buffer) Event(api_, a.done_with_host_buffer).wait();
  return std::make_shared<Buffer>(api_, a.buffer);
}

bool Client::memory_stats(PJRT_Device* device, int64_t* in_use, int64_t* limit) const {
  auto a = PJRT_ARGS(PJRT_Device_MemoryStats_Args);
  a.device = device;
  PJRT_Error* e = api_->raw()->PJRT_Device_MemoryStats(&a);
  if (e) {
    auto d = PJRT_ARGS(PJRT_Error_Destroy_Args);
    d.error = e;
    api_->raw()->PJRT_Error_Destroy(&d);
    return false;
  }
  *in_use = a.bytes_in_use;
  *limit = a.bytes_limit_is_set ? a.bytes_limit : -1;
  return true;
}

const std::string& portable_compile_options() {
  // xla.CompileOptionsProto, hand-encoded (no protobuf dependency):
  //   0x20 0x01 : field 4 (compile_portable_executable), varint, true
  //   0x1a 0x04 : field 3 (executable_build_options), length-delimited, 4 bytes follow:
  //     0x20 0x01 : ExecutableBuildOptionsProto field 4 (num_replicas) = 1
  //     0x28 0x01 : ExecutableBuildOptionsProto field 5 (num_partitions) = 1
  static const std::string opts("\x20\x01\x1a\x04\x20\x01\x28\x01", 8);
  return opts;
}

const std::string& no_fma_compile_options() {
  // CompileOptionsProto field 7 (env_option_overrides, map<string, OptionOverrideProto>): one
  // entry {1: key, 2: OptionOverrideProto{1 (string_field): value}}.
  static const std::string opts = [] {
    auto field = [](char tag, const std::string& bytes) { return std::string(1, tag) + char(bytes.size()) + bytes; };
    return field('\x3a', field('\x0a', "xla_cpu_max_isa") + field('\x12', field('\x0a', "AVX")));
  }();
  return opts;
}

}  // namespace tpu::pjrt
