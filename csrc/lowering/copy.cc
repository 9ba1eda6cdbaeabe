// copy_ / to(dtype): PyTorch cast semantics (bool targets are x != 0), broadcasting src.
#include "lowering.h"

namespace tpu::lowering {

TPU_LOWER_WITH(copy, .elementwise = true, .writes_may_overlap = true, .complex = true) {  // copy_ checks overlap itself
  const Type& o = out_type(c);
  return {cast_to(b, c.tensor("src"), o.elem, o.shape)};
}

}  // namespace tpu::lowering
