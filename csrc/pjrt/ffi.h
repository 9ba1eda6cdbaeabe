// Registering XLA FFI custom-call handlers with a PJRT plugin (its FFI extension). Knows nothing
// about the handlers themselves: they are XLA_FFI_Handler* function pointers (typed FFI).
#pragma once
#include <string>

#include "pjrt.h"

namespace tpu::pjrt {

// Registers `handler` as the typed (api_version 4) custom-call target `target` on `platform`
// ("Host" for XLA:CPU). Throws Error when the plugin has no FFI extension, its extension is not
// the layout we know, or it refuses the handler.
void register_ffi_handler(const Api& api, const std::string& target, const std::string& platform,
                          void* handler);

}  // namespace tpu::pjrt
