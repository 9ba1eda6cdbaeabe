// copy_ / to(dtype): PyTorch cast semantics (bool targets are x != 0), broadcasting src.
#include "lowering.h"

namespace tpu::lowering {

TPU_LOWER_ELEMENTWISE(copy) {
  const Type& o = out_type(c);
  return {cast_to(b, c.tensor("src"), o.elem, o.shape)};
}

}  // namespace tpu::lowering
