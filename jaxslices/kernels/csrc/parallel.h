// Work sharing on XLA's intra-op thread pool (the FFI's ThreadPool).
//
// A kernel splits its work into `parts` units that depend only on its
// inputs (never on the number of threads), so that its results are the same
// bit for bit whatever the thread count: each unit writes its own rows, and
// any sum over units is made afterwards in unit order. The calling thread
// and up to threads - 1 pool tasks *claim* units one at a time from a shared
// counter, so a busy core never holds the others back (no fixed split), and
// the caller waits only for units already claimed: a task that starts late
// finds nothing left and never touches the kernel's buffers. Waiting for
// unclaimed work would deadlock when the handler itself runs on a pool
// worker: XLA's thunk executor does that for a program of many independent
// branches, and after a handler that returned a pending future; with a
// one-thread pool, a handler waiting for its own tasks then never returns
// (tests/lib/test_kernels_threads.py runs that case).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#ifdef __linux__
#include <sched.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace jaxslices {

namespace ffi = xla::ffi;

// The CPUs this process may run on (its affinity mask; at least 1).
inline int64_t AllowedCpus() {
#ifdef __linux__
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    return std::max(1, CPU_COUNT(&set));
  }
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

// How many threads a kernel call may use: the `threads` attribute (> 0:
// forced; 0: the pool's size, at most the CPUs the process may use: XLA
// makes a pool of at least as many threads as it has CPU devices, 8 with
// --xla_force_host_platform_device_count=8 on any machine) and, below
// `min_slots` slots, one (waking a parked pool thread costs tens of
// microseconds, more than a small batch's work).
struct Threads {
  ffi::ThreadPool* pool;
  int64_t threads;    // > 0: forced; 0: the pool's size
  int64_t min_slots;  // fewer slots: one thread

  int64_t For(int64_t slots) const {
    if (slots < min_slots || slots < 2) return 1;
    if (threads > 0) return threads;
    static const int64_t cpus = AllowedCpus();
    return std::max<int64_t>(1, std::min(pool->num_threads(), cpus));
  }
};

// The units of work of a call given T threads: a few per thread, so that a
// thread that runs faster takes more of them; one without threads.
inline int64_t UnitsFor(int64_t threads, int64_t slots) {
  if (threads <= 1) return 1;
  return std::max<int64_t>(1, std::min<int64_t>(4 * threads, slots));
}

namespace detail {

struct Claims {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t parts = 0;
  std::function<void(int64_t)> body;  // refers to the caller's frame
  std::mutex mu;
  std::condition_variable cv;

  // Claim and run units until none is left. `body` is only called for a
  // claimed unit, which the caller waits for: a late task touches only this.
  void Work() {
    while (true) {
      int64_t p = next.fetch_add(1, std::memory_order_relaxed);
      if (p >= parts) return;
      body(p);
      if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == parts) {
        std::lock_guard<std::mutex> lock(mu);
        cv.notify_all();
      }
    }
  }

  // After the caller's own Work(): every unit is claimed; wait for them.
  void WaitAllDone() {
    for (int spin = 0; spin < 2000; ++spin) {  // a unit about to finish
      if (done.load(std::memory_order_acquire) == parts) return;
      std::this_thread::yield();
    }
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done.load(std::memory_order_acquire) == parts; });
  }
};

}  // namespace detail

// Run body(0), ..., body(parts - 1), on up to `threads` threads (the caller
// one of them). Units must not wait for each other.
template <typename Body>
void ParallelFor(const Threads& t, int64_t threads, int64_t parts, Body&& body) {
  if (threads <= 1 || parts <= 1) {
    for (int64_t p = 0; p < parts; ++p) body(p);
    return;
  }
  auto claims = std::make_shared<detail::Claims>();
  claims->parts = parts;
  claims->body = [&body](int64_t p) { body(p); };
  const int64_t helpers = std::min(threads, parts) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    t.pool->Schedule([claims] { claims->Work(); });
  }
  claims->Work();
  claims->WaitAllDone();
}

// The partition (of `parts`) that owns table row `id`: a multiplicative
// hash's top bits (another constant than IdMap's, whose bits pick a slot
// within a partition).
inline int32_t PartOf(int64_t id, int64_t parts) {
  uint64_t h = static_cast<uint64_t>(id) * 0xD6E8FEB86659FD93ull;
  return static_cast<int32_t>(((h >> 32) * static_cast<uint64_t>(parts)) >> 32);
}

}  // namespace jaxslices
