#pragma once
// Op definition of conv1d/2d/3d and conv_transpose1d/2d/3d (Note [Invoke] in src/ops/invoke.h;
// Note [Conv layouts] and Note [Transposed conv] in src/ops/conv.cpp). prepare / run / finish are
// in src/ops/conv.cpp; record, the gradient rule, in src/autograd/rules/conv.cpp.
#include <cstdint>

#include "flame/nn/conv.h"
#include "flame/tensor.h"
#include "src/backend/backend.h"
#include "src/ops/invoke.h"

namespace flame::op_detail {

struct ConvArgs {
  const char* op = nullptr;
  int64_t nsp = 2;  // spatial dims
  bool transposed = false;
  Tensor input, weight, bias;  // bias may be undefined
  // The per-dim arguments, each already expanded to nsp values.
  int64_t stride[3] = {1, 1, 1}, dilation[3] = {1, 1, 1}, out_pad[3] = {0, 0, 0}, pad[3] = {0, 0, 0};
  nn::functional::Padding::Mode pad_mode = nn::functional::Padding::Mode::explicit_sizes;
  int64_t groups = 1;
};
struct ConvDef : OpDefaults<ConvArgs> {
  struct Prep {
    backend::Backend::ConvParams p;
    Shape ys;                // the output's (batched) shape
    Tensor x;                // the batched input as the kernel reads it (after "same"'s extra pad)
    bool cl = false;         // channels-last (Note [Conv layouts])
    bool unbatched = false;  // the input had no batch dim
    int64_t c_out = 0;
  };
  struct Result {
    Tensor y;
  };
  using Out = Tensor;
  static constexpr Autocast autocast = Autocast::low;
  static const char* name(const Args& a) { return a.op; }
  static TensorList inputs(const Args& a) { return {a.input, a.weight, a.bias}; }
  static const Tensor& lead(const Args& a) { return a.input; }
  static Args with_inputs(Args a, const TensorList& in) {
    a.input = in[0];
    a.weight = in[1];
    a.bias = in[2];
    return a;
  }
  static Prep prepare(const Args& a);
  static Result run(const Args& a, Prep& p);
  static void record(Result& r, const Args& a, const Prep& p);
  static Out finish(Result&& r, const Args&, const Prep& p) { return p.unbatched ? r.y.squeeze(0) : std::move(r.y); }
};

}  // namespace flame::op_detail
