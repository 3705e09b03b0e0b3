// The threads a kernel call uses by default (the `threads` attribute 0):
// XLA's CPU pool, at most one per CPU the process may use (Threads::For).
// jaxslices.kernels.default_threads().
#include "parallel.h"

namespace jaxslices {

static ffi::Error PoolThreadsImpl(ffi::ThreadPool pool,
                                  ffi::ResultBufferR0<ffi::S32> out) {
  Threads t{&pool, 0, 0};
  *out->typed_data() = static_cast<int32_t>(t.For(1 << 30));
  return ffi::Error::Success();
}

}  // namespace jaxslices

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxslicesPoolThreads, jaxslices::PoolThreadsImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Ret<xla::ffi::BufferR0<xla::ffi::S32>>());
