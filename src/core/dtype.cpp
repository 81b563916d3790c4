#include "flame/dtype.h"

#include "flame/error.h"

namespace flame {

std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u8: return 1;
    case DType::boolean: return 1;
    case DType::f8_e4m3fn: return 1;
    case DType::f8_e5m2: return 1;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
    case DType::boolean: return "bool";
    case DType::f8_e4m3fn: return "f8_e4m3fn";
    case DType::f8_e5m2: return "f8_e5m2";
  }
  return "?";
}

std::string to_string(DType t) { return dtype_name(t); }

bool is_floating(DType t) {
  return t == DType::f32 || t == DType::f64 || t == DType::bf16 || t == DType::f16;
}
bool is_integral(DType t) { return t == DType::i32 || t == DType::i64 || t == DType::u8; }

namespace {
int category(DType t) { return is_bool(t) ? 0 : (is_integral(t) ? 1 : 2); }
int rank_within(DType t) {
  switch (t) {
    case DType::u8: return 0;
    case DType::i32: return 1;
    case DType::i64: return 2;
    case DType::f16: return 0;
    case DType::bf16: return 0;
    case DType::f32: return 1;
    case DType::f64: return 2;
    default: return 0;
  }
}
}  // namespace

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  FLAME_CHECK(!is_float8(a) && !is_float8(b), "promote_types", "no promotion between ", dtype_name(a), " and ",
              dtype_name(b), ": 8-bit float tensors are storage; cast them first (to(DType::f32) or to(DType::bf16))");
  const int ca = category(a), cb = category(b);
  if (ca != cb) return ca > cb ? a : b;
  // Same category, different types.
  if ((a == DType::bf16 && b == DType::f16) || (a == DType::f16 && b == DType::bf16)) return DType::f32;
  return rank_within(a) >= rank_within(b) ? a : b;
}

}  // namespace flame
