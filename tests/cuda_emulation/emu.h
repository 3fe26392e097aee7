// Host emulation of the CUDA features the attention kernels use, so that the real device code
// (csrc/attention/attention_kernel.cuh) compiles with g++ and runs on the CPU.
//
// Emulated:
// - Threads: every CUDA thread of a block is a fiber (ucontext) on the calling OS thread; blocks
//   run one after another. A fiber runs until it waits at a barrier; the scheduler then resumes the
//   lowest-numbered runnable thread, or the highest-numbered one in every other phase between two
//   __syncthreads. One warp, and within a warp one lane, thus runs ahead of the others as far as the
//   barriers allow and reads what the others have not written yet, or overwrites what they have not
//   read yet, in both orders: a missing __syncthreads or __syncwarp shows as wrong values (shared
//   memory starts filled with 0xFF bytes: NaN in fp32, fp16 and bf16). The schedule is
//   deterministic.
// - __syncthreads / __syncwarp (full mask only) as barriers; a barrier that some thread of the block
//   never reaches is reported as a deadlock instead of hanging.
// - __shfl_xor_sync (float, full mask) and WMMA 16x16x16 (fp16 / bf16 inputs, fp32 accumulators)
//   as warp-collective exchanges. Each fragment kind maps (lane, element) to a (row, column) by its
//   own scrambled bijection, so code that assumes a particular register layout gets wrong results;
//   load/store_matrix_sync assert the hardware's pointer (32-byte) and leading-dimension (16-byte)
//   alignment rules. Every fragment holds 8 elements per lane (the hardware's fp16 operand
//   fragments hold 16, with duplicates; the kernels only index accumulator elements).
// - cp.async: both addresses must be 16-byte aligned; each copy is deferred to the issuing thread's
//   cp.async.wait_all (a thread that ends with copies pending is an error).
// - Dynamic shared memory: the opt-in maximum of sm_90 (227 KB); a launch asking for more, or a
//   block that writes past the bytes it asked for, is an error. atomicAdd on fp32.
//
// Not emulated: tensor-core arithmetic (mma_sync accumulates the products in fp32 in a fixed order
// with round-to-nearest, unlike the hardware's internal precision and order); cp.async and memory
// latency and ordering between blocks (blocks run one at a time, so inter-block races on global
// memory and atomics are invisible); real warp scheduling, divergence and independent thread
// scheduling beyond the two barrier-bounded orders above; registers, occupancy, bank conflicts and
// timing; out-of-bounds global accesses (the test pads every tensor with NaN guards instead) and
// misaligned vector accesses other than cp.async (the test builds with UBSan's alignment check);
// partial warp masks and every intrinsic the kernels do not use.
//
// Errors inside a kernel (failed checks, deadlocks) abandon the launch: emu::launch returns false
// and emu::last_error() says why.
#pragma once

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#define __launch_bounds__(...)

inline uint3 threadIdx;
inline uint3 blockIdx;
inline dim3 gridDim;
inline dim3 blockDim;

namespace emu {

constexpr int kWarpSize = 32;
constexpr int kMaxThreads = 1024;
constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kSmemCapacity = 227 * 1024;  // cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90

struct Barrier {
  unsigned expected = 0, arrived = 0, generation = 0;
};

struct Fiber {
  ucontext_t context;
  char* stack = nullptr;
  bool done = false;
  const Barrier* waiting_on = nullptr;
  unsigned waiting_generation = 0;
  std::vector<std::pair<void*, const void*>> pending_copies;
};

struct WarpScratch {
  float shuffle[kWarpSize];
  float a[256], b[256], c[256];
};

struct State {
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  int current = -1;
  Barrier block_barrier;
  std::vector<Barrier> warp_barriers;
  std::vector<WarpScratch> warp_scratch;
  void (*body)(const void*) = nullptr;
  const void* body_context = nullptr;
  std::string error;
};

inline State& state() {
  static State s;
  return s;
}

inline const char* last_error() { return state().error.c_str(); }

// Records the first error and leaves the kernel: control goes back to the scheduler, which
// abandons the launch.
[[noreturn]] inline void fail(const std::string& what) {
  State& s = state();
  if (s.error.empty()) s.error = what;
  swapcontext(&s.fibers[s.current].context, &s.scheduler);
  __builtin_unreachable();
}

inline void check(bool ok, const char* what) {
  if (!ok) fail(what);
}

inline int lane_id() { return static_cast<int>(threadIdx.x) % kWarpSize; }
inline int warp_id() { return static_cast<int>(threadIdx.x) / kWarpSize; }

inline void arrive_and_wait(Barrier& barrier) {
  State& s = state();
  Fiber& self = s.fibers[s.current];
  self.waiting_on = &barrier;
  self.waiting_generation = barrier.generation;
  if (++barrier.arrived == barrier.expected) {
    barrier.arrived = 0;
    ++barrier.generation;
  }
  swapcontext(&self.context, &s.scheduler);
}

inline void warp_sync() { arrive_and_wait(state().warp_barriers[warp_id()]); }

inline void cp_async_16(void* dst, const void* src) {
  check(reinterpret_cast<uintptr_t>(dst) % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0,
        "cp.async of 16 bytes from or to an address that is not 16-byte aligned");
  state().fibers[state().current].pending_copies.emplace_back(dst, src);
}

inline void cp_async_wait_all() {
  auto& copies = state().fibers[state().current].pending_copies;
  for (const auto& [dst, src] : copies) std::memcpy(dst, src, 16);
  copies.clear();
}

// Scrambled fragment layouts: element e of lane l holds the entry perm(l * 8 + e) (row-major
// index into the 16x16 matrix) of its fragment kind (0: matrix_a, 1: matrix_b, 2: accumulator).
inline int scramble(int kind, int slot) {
  static const int mult[3] = {37, 101, 173};  // odd: bijections mod 256
  static const int add[3] = {11, 5, 200};
  return (slot * mult[kind] + add[kind]) % 256;
}

}  // namespace emu

#define REMAT_HOST_CP_ASYNC_16(dst, src) ::emu::cp_async_16(dst, src)
#define REMAT_HOST_CP_ASYNC_WAIT_ALL() ::emu::cp_async_wait_all()

inline void __syncthreads() { emu::arrive_and_wait(emu::state().block_barrier); }

inline void __syncwarp(unsigned mask = 0xffffffffu) {
  emu::check(mask == 0xffffffffu, "partial __syncwarp mask");
  emu::warp_sync();
}

inline float __shfl_xor_sync(unsigned mask, float value, int lane_mask) {
  emu::check(mask == 0xffffffffu, "partial shuffle mask");
  auto& scratch = emu::state().warp_scratch[emu::warp_id()];
  scratch.shuffle[emu::lane_id()] = value;
  emu::warp_sync();
  const float result = scratch.shuffle[emu::lane_id() ^ lane_mask];
  emu::warp_sync();
  return result;
}

inline float atomicAdd(float* address, float value) {
  const float old = *address;
  *address = old + value;
  return old;
}

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use>
constexpr int kind_of() {
  return std::is_same_v<Use, matrix_a> ? 0 : std::is_same_v<Use, matrix_b> ? 1 : 2;
}

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "only 16x16x16 fragments are emulated");
  enum { num_elements = 8 };
  T x[8];
};

inline void fill_fragment(fragment<accumulator, 16, 16, 16, float>& f, float value) {
  for (float& e : f.x) e = value;
}

inline void check_pointer(const void* ptr, unsigned ldm, int element_bytes) {
  emu::check(reinterpret_cast<uintptr_t>(ptr) % 32 == 0, "wmma pointer not 256-bit aligned");
  emu::check(ldm * element_bytes % 16 == 0, "wmma leading dimension not a multiple of 16 bytes");
}

template <typename Use, typename T, typename Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout>& f, const T* ptr, unsigned ldm) {
  static_assert(sizeof(T) == 2, "16-bit operands");
  check_pointer(ptr, ldm, 2);
  const int lane = emu::lane_id();
  for (int e = 0; e < 8; ++e) {
    const int idx = emu::scramble(kind_of<Use>(), lane * 8 + e), r = idx / 16, c = idx % 16;
    f.x[e] = std::is_same_v<Layout, row_major> ? ptr[r * ldm + c] : ptr[r + c * ldm];
  }
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* ptr, unsigned ldm,
                             layout_t layout) {
  check_pointer(ptr, ldm, 4);
  const int lane = emu::lane_id();
  for (int e = 0; e < 8; ++e) {
    const int idx = emu::scramble(2, lane * 8 + e), r = idx / 16, c = idx % 16;
    f.x[e] = layout == mem_row_major ? ptr[r * ldm + c] : ptr[r + c * ldm];
  }
}

inline void store_matrix_sync(float* ptr, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm,
                              layout_t layout) {
  check_pointer(ptr, ldm, 4);
  const int lane = emu::lane_id();
  for (int e = 0; e < 8; ++e) {
    const int idx = emu::scramble(2, lane * 8 + e), r = idx / 16, c = idx % 16;
    (layout == mem_row_major ? ptr[r * ldm + c] : ptr[r + c * ldm]) = f.x[e];
  }
}

template <typename T, typename LayoutA, typename LayoutB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, T, LayoutA>& a,
                     const fragment<matrix_b, 16, 16, 16, T, LayoutB>& b,
                     const fragment<accumulator, 16, 16, 16, float>& c) {
  auto& scratch = emu::state().warp_scratch[emu::warp_id()];
  const int lane = emu::lane_id();
  for (int e = 0; e < 8; ++e) {
    scratch.a[emu::scramble(0, lane * 8 + e)] = static_cast<float>(a.x[e]);
    scratch.b[emu::scramble(1, lane * 8 + e)] = static_cast<float>(b.x[e]);
    scratch.c[emu::scramble(2, lane * 8 + e)] = c.x[e];
  }
  emu::warp_sync();
  float out[8];
  for (int e = 0; e < 8; ++e) {
    const int idx = emu::scramble(2, lane * 8 + e), r = idx / 16, col = idx % 16;
    float acc = scratch.c[idx];
    for (int k = 0; k < 16; ++k) acc += scratch.a[r * 16 + k] * scratch.b[k * 16 + col];
    out[e] = acc;
  }
  emu::warp_sync();
  for (int e = 0; e < 8; ++e) d.x[e] = out[e];
}

}  // namespace wmma
}  // namespace nvcuda

namespace emu {

inline void fiber_entry() {
  State& s = state();
  s.body(s.body_context);
  Fiber& self = s.fibers[s.current];
  if (!self.pending_copies.empty()) fail("cp.async copies never waited for");
  self.done = true;
  swapcontext(&self.context, &s.scheduler);
}

inline bool runnable(const Fiber& f) {
  return !f.done && (f.waiting_on == nullptr || f.waiting_on->generation != f.waiting_generation);
}

// Runs one block to completion; false on an error (state().error says which).
inline bool run_block(unsigned threads, unsigned char* smem, size_t smem_bytes) {
  State& s = state();
  std::memset(smem, 0xFF, kSmemCapacity);
  s.block_barrier = Barrier{threads};
  s.warp_barriers.assign((threads + kWarpSize - 1) / kWarpSize, Barrier{kWarpSize});
  s.warp_scratch.assign(s.warp_barriers.size(), WarpScratch{});
  for (unsigned t = 0; t < threads; ++t) {
    Fiber& f = s.fibers[t];
    f.done = false;
    f.waiting_on = nullptr;
    f.pending_copies.clear();
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = nullptr;
    makecontext(&f.context, fiber_entry, 0);
  }
  unsigned finished = 0;
  while (finished < threads) {
    const bool lowest_first = s.block_barrier.generation % 2 == 0;
    int next = -1;
    for (unsigned i = 0; i < threads; ++i) {
      const unsigned t = lowest_first ? i : threads - 1 - i;
      if (runnable(s.fibers[t])) {
        next = static_cast<int>(t);
        break;
      }
    }
    if (next < 0) {
      s.error = "deadlock: a barrier that not every thread of the block reaches";
      return false;
    }
    Fiber& f = s.fibers[next];
    f.waiting_on = nullptr;
    s.current = next;
    threadIdx = uint3{static_cast<unsigned>(next), 0, 0};
    swapcontext(&s.scheduler, &f.context);
    if (!s.error.empty()) return false;
    if (f.done) ++finished;
  }
  for (size_t i = smem_bytes; i < kSmemCapacity; ++i) {
    if (smem[i] != 0xFF) {
      s.error = "write past the dynamic shared memory of the launch";
      return false;
    }
  }
  return true;
}

inline void ensure_fibers(unsigned threads) {
  State& s = state();
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  while (s.fibers.size() < threads) {
    void* mem = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) {
      std::perror("emu: mmap of a fiber stack");
      std::abort();
    }
    mprotect(mem, page, PROT_NONE);  // guard page below the stack
    s.fibers.emplace_back();
    s.fibers.back().stack = static_cast<char*>(mem) + page;
  }
}

// Runs kernel() in every thread of every block of the grid. False on an error.
template <typename Kernel>
bool launch(dim3 grid, unsigned threads, unsigned char* smem, size_t smem_bytes, const Kernel& kernel) {
  State& s = state();
  s.error.clear();
  if (smem_bytes > kSmemCapacity) {
    s.error = "dynamic shared memory above the sm_90 opt-in maximum";
    return false;
  }
  if (threads == 0 || threads > kMaxThreads || threads % kWarpSize != 0) {
    s.error = "block size";
    return false;
  }
  ensure_fibers(threads);
  s.body = [](const void* context) { (*static_cast<const Kernel*>(context))(); };
  s.body_context = &kernel;
  gridDim = grid;
  blockDim = dim3(threads);
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = uint3{x, y, z};
        if (!run_block(threads, smem, smem_bytes)) return false;
      }
    }
  }
  return true;
}

}  // namespace emu
