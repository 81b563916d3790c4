#pragma once
// Note [Op list]
// The elementwise ops' enums, from the one table of them (flame/op_table.h, Note [Op table]): each
// row also generates the dispatch switch of every backend, the op layer's dtype rule, autocast
// policy and public entry points, and flame::compile's functor names.
#include "flame/op_table.h"
#include "src/opdef/scalar_math.h"

namespace flame::backend {
#define FLAME_ENUM_ENTRY(name, ...) name,
enum class UnaryOp { FLAME_UNARY_OPS(FLAME_ENUM_ENTRY) };
enum class BinaryOp { FLAME_BINARY_OPS(FLAME_ENUM_ENTRY) };
#undef FLAME_ENUM_ENTRY
enum class OpKind { same, floating, predicate };
}  // namespace flame::backend
