#pragma once
// What core tells the tracer of flame::compile (Note [Tracing] in src/compile/trace.cpp): the
// storages it allocates while a function is traced and the in-place writes a replay cannot
// repeat. Core declares these, src/compile implements them (so that core includes no compile or op
// header); the op layer's hooks (src/ops/trace_hooks.h) build on the same declarations. Each is one
// thread-local pointer test when no function is being traced.
#include <string>

namespace flame::compile_detail {

class Tracer;
extern thread_local Tracer* t_tracer;
inline Tracer* active_tracer() { return t_tracer; }

// Every new storage made while tracing, with the op that asked for it: a tensor on such a
// storage that no hook reported was made by an op the tracer cannot replay.
void trace_new_storage(Tracer& t, const void* storage, const char* op);
// Something the traced function did that a replay cannot repeat (a host read, an in-place write,
// a device transfer): the function runs eagerly and `reason` is reported.
void trace_fail(Tracer& t, const std::string& reason);

}  // namespace flame::compile_detail
