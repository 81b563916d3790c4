#include "models/key_plan.h"

namespace flame_diffusion::models {

const char* to_string(KeyPlanEntry::Op op) {
  switch (op) {
    case KeyPlanEntry::Op::kCopy: return "copy";
    case KeyPlanEntry::Op::kReshape: return "reshape";
    case KeyPlanEntry::Op::kConcat: return "concat";
    case KeyPlanEntry::Op::kChunk: return "chunk";
    case KeyPlanEntry::Op::kTranspose: return "transpose";
    case KeyPlanEntry::Op::kScale: return "scale";
    case KeyPlanEntry::Op::kSwapHalves: return "swap halves";
  }
  return "?";
}

}  // namespace flame_diffusion::models
