#include "ffi.h"

#include <cstddef>
#include <cstdint>

namespace tpu::pjrt {
namespace {

// The plugin wheel ships pjrt_c_api.h only, so this is our own declaration of the two structs we
// use from the PJRT FFI extension. It mirrors xla/pjrt/c/pjrt_c_api_ffi_extension.h as of PJRT C API
// 0.81 (PJRT_API_FFI_EXTENSION_VERSION 2, typed handlers only): xla-cpu-pjrt 0.0.1 checks for a
// 52-byte struct and reads the handler at offset 24. Earlier headers of the same extension version
// had an `int api_version` before `handler`; Api::load refuses plugins older than our 0.81 header,
// and the plugin ignores registration failures, so register_host_kernels (runtime/ffi_kernels.cc)
// also compiles and runs a probe call before any lowering uses a handler.
struct RegisterHandlerArgs {
  size_t struct_size;
  const char* target_name;
  size_t target_name_size;
  void* handler;  // XLA_FFI_Handler*
  const char* platform_name;
  size_t platform_name_size;
  uint32_t traits;  // a C enum upstream (int-sized); 0: no traits
};
constexpr size_t kRegisterHandlerArgsSize = offsetof(RegisterHandlerArgs, traits) + sizeof(uint32_t);
static_assert(kRegisterHandlerArgsSize == 52, "PJRT_FFI_Register_Handler_Args as of PJRT C API 0.81");
using RegisterHandlerFn = PJRT_Error* (*)(RegisterHandlerArgs*);

// The extension: the common header, then three entry points; we call only the third.
struct FfiExtension {
  PJRT_Extension_Base base;
  void* type_id_register;
  void* user_data_add;
  RegisterHandlerFn register_handler;
};
constexpr size_t kFfiExtensionSize = offsetof(FfiExtension, register_handler) + sizeof(RegisterHandlerFn);

}  // namespace

void register_ffi_handler(const Api& api, const std::string& target, const std::string& platform,
                          void* handler) {
  const PJRT_Extension_Base* base = api.extension(PJRT_Extension_Type_FFI);
  if (!base)
    throw Error("the PJRT plugin has no FFI extension", PJRT_Error_Code_UNIMPLEMENTED);
  // struct_size tells which entry points exist; a smaller one is an older layout without
  // register_handler, so we refuse rather than call through a field that is not there.
  if (base->struct_size < kFfiExtensionSize)
    throw Error("the PJRT plugin's FFI extension is " + std::to_string(base->struct_size) +
                    " bytes, expected at least " + std::to_string(kFfiExtensionSize) +
                    " (no register_handler entry)",
                PJRT_Error_Code_UNIMPLEMENTED);
  if (api.raw()->pjrt_api_version.major_version != 0 || api.raw()->pjrt_api_version.minor_version < 81)
    throw Error("the FFI registration layout is known for PJRT C API 0.81 and later only, the plugin implements " +
                    api.version_string(),
                PJRT_Error_Code_UNIMPLEMENTED);
  const auto* ext = reinterpret_cast<const FfiExtension*>(base);
  if (!ext->register_handler)
    throw Error("the PJRT plugin's FFI extension has no register_handler", PJRT_Error_Code_UNIMPLEMENTED);
  RegisterHandlerArgs a{};
  a.struct_size = kRegisterHandlerArgsSize;
  a.target_name = target.data();
  a.target_name_size = target.size();
  a.handler = handler;
  a.platform_name = platform.data();
  a.platform_name_size = platform.size();
  a.traits = 0;
  api.check(ext->register_handler(&a), "PJRT_FFI_Register_Handler(" + target + ")");
}

}  // namespace tpu::pjrt
