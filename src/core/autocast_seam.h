#pragma once
// What core tells autocast (src/amp): Tensor::set_data drops the tensor's kept low-precision copy
// (Note [Kept low-precision copies] in src/amp/autocast.cpp). Core declares it, src/amp defines it,
// so that core includes no amp header (Note [Layers] in docs/design.md).
namespace flame {
class Tensor;
}

namespace flame::amp::detail {

// Forgets w's kept copy (Tensor::set_data: the data behind the handle changed).
void drop_low_copy(const Tensor& w);

}  // namespace flame::amp::detail
