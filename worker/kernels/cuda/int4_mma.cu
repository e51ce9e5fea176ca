// W4A16 decode GEMV on mma.sync tensor cores, and the dequantization that feeds prefill.
//
// The weight layout ("int4-mma", docs/worker-contract.md): W [N, K] int4 codes q (w = (q - 8) * s,
// symmetric groups of 64 * gc k) cut into 16-row tiles and 64-k chunks. For tile rt and chunk c,
// lane L = 4 g + t of a warp owns one 16-byte word quad qw[rt][c][L] = 4 words, word i feeding
// the i-th m16n8k16 product of the chunk. The product's k order is permuted so that lane t's
// operands are contiguous in memory: mma k positions (2t, 2t+1, 2t+8, 2t+9) of product i are
// real k = 64 c + 8 t + 32 (i >> 1) + 4 (i & 1) + (0, 1, 2, 3). Word i holds, nibble n at bits
// 4n..4n+3: pair j = 0..3 at nibbles (j, j + 4) = A fragment register j, whose row is
// g + 8 (j & 1) and whose two k are the (2 (j >> 1) + 0, + 1)-th of the product's four.
// So one 16-byte load per lane per chunk brings 4 products' A operands in fragment order, and
// x's matching B operands are two 16-byte loads per lane, each covering 64 contiguous bytes
// per token across the warp. Scales: fp16 sc[rt][group][16].
//
// Codes become exact 16-bit values with the exponent trick: (w >> 4j) & 0x000f000f OR'ed into
// the mantissa of 128.0 (bf16) or 1024.0 (fp16) is 128 + q (1024 + q), one lop3. The products
// of those accumulate in fp32 per group; an extra product with an all-ones A sums x over the
// same k, and at the group's end acc += s * (part - 136 * xsum) (1032 for fp16) is the sum of
// (q - 8) * s * x without a per-code subtract. The scale multiplies fp32 partial sums, so the
// 16-bit operands never carry a rounded scale.
//
// Work split: a CTA of W warps owns R row tiles; its K (in whole groups) is cut across
// gridDim.y CTAs and then across its warps. Warps reduce in shared memory; with gridDim.y > 1
// the CTAs add into an fp32 workspace and the last to arrive writes the output and re-zeroes the
// workspace and its counter (so CUDA-graph replays need no memset). A fused gate|up weight
// whose tiles alternate gate / up can have that write be silu(gate) * up (reduce_parts' SILU).
//
// X8 (modes 9 and 10, tm_w4_gemv_x8): the products on int8 tensor cores (mma m16n8k32 s8), x
// arriving as int8 codes with a scale per token and group of 128, rounded by the kernel before
// (`reference.int4_mma_x8`): see chunk_products_x8.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <type_traits>

namespace {

template <bool BF16>
struct Num;
template <>
struct Num<true> {
  using T = __nv_bfloat16;
  static constexpr uint32_t EX = 0x43004300u;    // bf16 128.0, both halves
  static constexpr uint32_t ONES = 0x3f803f80u;  // bf16 1.0
  static constexpr float OFFSET = 136.f;         // 128 + the symmetric zero point 8
};
template <>
struct Num<false> {
  using T = __half;
  static constexpr uint32_t EX = 0x64006400u;    // fp16 1024.0
  static constexpr uint32_t ONES = 0x3c003c00u;  // fp16 1.0
  static constexpr float OFFSET = 1032.f;
};

// (a & b) | c in one instruction
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// A operands OFFSET - 8 + q (exact 16-bit values); the OFFSET * sum(x) part is taken off per
// group (see close_group), so a code costs one shift (3 of 4 pairs) and one lop3.
template <bool BF16>
__device__ __forceinline__ void dequant(uint32_t w, uint32_t (&a)[4]) {
  constexpr uint32_t M = 0x000f000fu;
#pragma unroll
  for (int j = 0; j < 4; ++j) a[j] = and_or(w >> (4 * j), M, Num<BF16>::EX);
}

template <bool BF16>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  if (BF16) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Weights are read once: no L1 allocation (x lives there).
__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// p advanced by `units` of `bytes` as one wide multiply-add (IMAD.WIDE.U32): a signed int index
// scaled in 64 bits took an index product, a shift and a 64-bit add a load.
// (The base pointers go through `opaque` once: otherwise the compiler keeps them as an index
// from the tensor's start, and each load pays the index's scaling again.)
__device__ __forceinline__ const uint4* opaque(const uint4* p) {
  asm("mov.b64 %0, %0;\n" : "+l"(p));
  return p;
}
template <unsigned bytes>
__device__ __forceinline__ const uint4* advance(const uint4* p, int units) {
  return reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(p) +
                                        (unsigned long long)(unsigned)units * bytes);
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Programmatic dependent launch (sm_90; worker/kernels/pdl.py says why): a GEMV launched with
// it starts beside the tail of the kernel before, streams its weights (constants), and waits
// here before it reads x or touches the workspace; then lets the next kernel launch. A no-op
// when the launch did not ask for it.
__device__ __forceinline__ void pdl_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  pdl_release();
}

// Launches `kernel`, opting it in to more than the default 48 KB of dynamic shared memory when
// `smem` asks for it.
template <typename... Params, typename... Args>
int launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                  cudaStream_t stream, bool pdl, Args... args) {
  if (smem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (err != cudaSuccess) return (int)err;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
  return err != cudaSuccess ? (int)err : (int)cudaGetLastError();
}

// This warp's K range, in whole groups: part p of P = splits * W.
struct Range {
  int g0, g1, c_begin, c_end, maxg;
};
// IL (interleaved): the CTA's range is cut by gridDim.y only and its warps take its chunks in
// turn (warp w reads chunks w, w + W, ...), so at each step the CTA reads one contiguous run.
template <bool IL>
__device__ __forceinline__ Range warp_range(int NC, int gc, int W, int warp) {
  const int G = (NC + gc - 1) / gc, P = gridDim.y * (IL ? 1 : W);
  const int p = blockIdx.y * (IL ? 1 : W) + (IL ? 0 : warp);
  Range r;
  r.g0 = (int)((long long)G * p / P);
  r.g1 = (int)((long long)G * (p + 1) / P);
  r.c_begin = r.g0 * gc;
  r.c_end = min(NC, r.g1 * gc);
  r.maxg = (G + P - 1) / P;
  return r;
}

// The warp's scales, rows (g, g + 8) of each tile per group, into its smem [R][maxg][16].
template <int R, bool IL>
__device__ __forceinline__ void load_scales(__half* my_sc, const __half* __restrict__ sc,
                                            const Range& rg, int G, int rb, int lane) {
  const int per_tile = (rg.g1 - rg.g0) * 16;
  const int first = IL ? (int)threadIdx.x : lane, step = IL ? (int)blockDim.x : 32;
  for (int idx = first; idx < R * per_tile; idx += step) {
    const int r = idx / per_tile, rest = idx % per_tile;
    const int gi = rest / 16, row = rest % 16;
    my_sc[(r * rg.maxg + gi) * 16 + row] = sc[((size_t)(rb * R + r) * G + rg.g0 + gi) * 16 + row];
  }
  if (IL) __syncthreads();
  else __syncwarp();
}

// The CTA's scales (interleaved chunks: all its warps share them) into smem [R][maxg][16]:
// tile r's groups [g0, g1) are (g1 - g0) * 32 contiguous bytes, copied 16 bytes a thread with
// every load issued before the stores and no division. (load_scales divides per element and
// waits out each load in turn; with it, the ring's GEMVs took 4-9% longer on one H200.)
template <int R>
__device__ __forceinline__ void load_scales_il(__half* my_sc, const __half* __restrict__ sc,
                                               const Range& rg, int G, int rb) {
  const int per = (rg.g1 - rg.g0) * 2;  // 16-byte pieces a tile
  constexpr int MAX = 2;                // pieces a thread holds at once, per tile
  uint4 v[R][MAX];
  for (int base = threadIdx.x; base < per; base += MAX * blockDim.x) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint4* src =
          reinterpret_cast<const uint4*>(sc + ((size_t)(rb * R + r) * G + rg.g0) * 16);
#pragma unroll
      for (int i = 0; i < MAX; ++i) {
        const int idx = base + i * blockDim.x;
        if (idx < per) v[r][i] = __ldg(src + idx);
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      uint4* dst = reinterpret_cast<uint4*>(my_sc + (size_t)r * rg.maxg * 16);
#pragma unroll
      for (int i = 0; i < MAX; ++i) {
        const int idx = base + i * blockDim.x;
        if (idx < per) dst[idx] = v[r][i];
      }
    }
  }
  __syncthreads();
}

// x's B operands, each lane's rows: token mt * 8 + g at k = 8 t, as 16-byte words, the
// pointers formed once (per chunk, a 64-bit product and a branch on M took ~9 of a chunk's
// instructions a token group). Rows past M read row M - 1 again: their sums are never written,
// so the loads need no branch and no zeroing.
template <bool BF16, int MT>
struct XRows {
  const uint4* p[MT];
  __device__ __forceinline__ XRows(const typename Num<BF16>::T* x, int M, int ldx, int g, int t) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      p[mt] = opaque(
          reinterpret_cast<const uint4*>(x + (size_t)min(mt * 8 + g, M - 1) * ldx + 8 * t));
  }
  // chunk c's: k = 64 c + 8 t and 64 c + 32 + 8 t, each load instruction covering 4 x 64
  // contiguous bytes
  __device__ __forceinline__ void load(uint4 (&xb)[MT][2], int c) const {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const uint4* q = advance<128>(p[mt], c);
      xb[mt][0] = __ldg(q);
      xb[mt][1] = __ldg(q + 4);
    }
  }
};

// One chunk: 4 products per row tile into the group's partial sums, and x's sums over the
// same k (a product with an all-ones A) for the OFFSET correction.
template <bool BF16, int MT, int R>
__device__ __forceinline__ void chunk_products(float (&part)[R][MT][4], float (&xsum)[MT][4],
                                               const uint4 (&w)[R], const uint4 (&xv)[MT][2]) {
  const uint32_t ones[4] = {Num<BF16>::ONES, Num<BF16>::ONES, Num<BF16>::ONES, Num<BF16>::ONES};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const uint4& v = xv[mt][i >> 1];
      mma<BF16>(xsum[mt], ones, (i & 1) ? v.z : v.x, (i & 1) ? v.w : v.y);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      uint32_t a[4];
      dequant<BF16>(word(w[r], i), a);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const uint4& v = xv[mt][i >> 1];
        mma<BF16>(part[r][mt], a, (i & 1) ? v.z : v.x, (i & 1) ? v.w : v.y);
      }
    }
  }
}

// At a group's end: acc += scale(row) * (part - OFFSET * xsum); part = xsum = 0.
// scale(r, h): the group's scale of tile r's row g (h 0) or g + 8 (h 1).
template <bool BF16, int MT, int R, typename Scale>
__device__ __forceinline__ void close_group_by(float (&acc)[R][MT][4], float (&part)[R][MT][4],
                                               float (&xsum)[MT][4], Scale scale) {
  constexpr float O = Num<BF16>::OFFSET;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float s0 = scale(r, 0);
    const float s1 = scale(r, 1);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      // xsum's rows are all alike: c0/c2 token 2t, c1/c3 token 2t + 1
      acc[r][mt][0] += s0 * (part[r][mt][0] - O * xsum[mt][0]);
      acc[r][mt][1] += s0 * (part[r][mt][1] - O * xsum[mt][1]);
      acc[r][mt][2] += s1 * (part[r][mt][2] - O * xsum[mt][2]);
      acc[r][mt][3] += s1 * (part[r][mt][3] - O * xsum[mt][3]);
#pragma unroll
      for (int q = 0; q < 4; ++q) part[r][mt][q] = 0.f;
    }
  }
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int q = 0; q < 4; ++q) xsum[mt][q] = 0.f;
}

// The same with the scales from the warp's or CTA's smem copy [R][maxg][16].
template <bool BF16, int MT, int R>
__device__ __forceinline__ void close_group(float (&acc)[R][MT][4], float (&part)[R][MT][4],
                                            float (&xsum)[MT][4], const __half* my_sc, int maxg,
                                            int gi, int g) {
  close_group_by<BF16, MT, R>(acc, part, xsum, [&](int r, int h) {
    return __half2float(my_sc[(r * maxg + gi) * 16 + g + 8 * h]);
  });
}

// ---- X8: the same weight words on int8 tensor cores.
// Word i of a lane's quad holds row g's codes in the low nibbles of its bytes and row g + 8's in
// the high ones, at real k base + (0, 2, 1, 3) byte by byte (base = 64 c + 8 t + 32 (i >> 1) +
// 4 (i & 1), the header's order). As bytes, (w << 4) & 0xf0 and w & 0xf0, each xor 0x80, are
// 16 (q - 8) in two's complement: an s8 A register in one shift and one lop3. So words 2p and
// 2p + 1 are A registers (a0, a1) and (a2, a3) of m16n8k32 product p, whose mma k 4t..4t+3 and
// 16+4t..16+4t+3 are real k base + (0, 2, 1, 3) and base + 4 + (0, 2, 1, 3). x arrives in that
// order (int4_mma_x8: token m's chunk c is 64 bytes, lane t's 16 of them at 16 t: product 0's
// B registers, then product 1's), so one 16-byte load a lane and token group brings a chunk's
// B operands. The int32 sums of a group's two chunks (|sum| < 2^22) reach fp32 once a group,
// times s_w / 16 * s_x.
__device__ __forceinline__ uint32_t and_xor(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0x6a;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

__device__ __forceinline__ void imma(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                     uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Each lane's rows of the int8 x: token mt * 8 + g's chunks (its 16 bytes at 16 t), and the
// group scales of the tokens its C fragment holds (2 t and 2 t + 1). Rows past M read row
// M - 1 again (their sums are never written).
template <int MT>
struct X8Rows {
  const uint4* p[MT];
  const float* s[MT][2];
  __device__ __forceinline__ X8Rows(const void* x8, const float* xs, int M, int K, int g, int t) {
    const int G = K >> 7;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      p[mt] = opaque(reinterpret_cast<const uint4*>(static_cast<const char*>(x8) +
                                                    (size_t)min(mt * 8 + g, M - 1) * K + 16 * t));
      s[mt][0] = xs + (size_t)min(mt * 8 + 2 * t, M - 1) * G;
      s[mt][1] = xs + (size_t)min(mt * 8 + 2 * t + 1, M - 1) * G;
    }
  }
  __device__ __forceinline__ void load(uint4 (&xb)[MT], int c) const {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) xb[mt] = __ldg(advance<64>(p[mt], c));
  }
};

template <int MT, int R>
__device__ __forceinline__ void chunk_products_x8(int (&isum)[R][MT][4], const uint4 (&w)[R],
                                                  const uint4 (&xb)[MT]) {
  constexpr uint32_t HI = 0xf0f0f0f0u, SIGN = 0x80808080u;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const uint32_t w0 = word(w[r], 2 * p), w1 = word(w[r], 2 * p + 1);
      const uint32_t a0 = and_xor(w0 << 4, HI, SIGN), a1 = and_xor(w0, HI, SIGN);
      const uint32_t a2 = and_xor(w1 << 4, HI, SIGN), a3 = and_xor(w1, HI, SIGN);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        imma(isum[r][mt], a0, a1, a2, a3, word(xb[mt], 2 * p), word(xb[mt], 2 * p + 1));
    }
}

// A group's end: acc += int32 sums * s_w * s_x / 16; sums = 0. gi: the group in the scales'
// smem copy [R][maxg][16]; gx: the group in x's scales.
template <int MT, int R>
__device__ __forceinline__ void close_group_x8(float (&acc)[R][MT][4], int (&isum)[R][MT][4],
                                               const X8Rows<MT>& xr, const __half* my_sc,
                                               int maxg, int gi, int gx, int g) {
  float sx[MT][2];  // the codes' 16 (q - 8) taken off once a token, not once a row
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // one wide multiply-add (a signed index took a sign extension and a 64-bit add)
      const float* p = reinterpret_cast<const float*>(
          reinterpret_cast<const char*>(xr.s[mt][h]) + (unsigned long long)(unsigned)gx * 4);
      sx[mt][h] = 0.0625f * __ldg(p);
    }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float s0 = __half2float(my_sc[(r * maxg + gi) * 16 + g]);
    const float s1 = __half2float(my_sc[(r * maxg + gi) * 16 + g + 8]);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      acc[r][mt][0] += (float)isum[r][mt][0] * (s0 * sx[mt][0]);
      acc[r][mt][1] += (float)isum[r][mt][1] * (s0 * sx[mt][1]);
      acc[r][mt][2] += (float)isum[r][mt][2] * (s1 * sx[mt][0]);
      acc[r][mt][3] += (float)isum[r][mt][3] * (s1 * sx[mt][1]);
#pragma unroll
      for (int q = 0; q < 4; ++q) isum[r][mt][q] = 0;
    }
  }
}

// silu(gate) * up from the projection's fp32 sums, rounded as the unfused path rounds (the
// projection to T, silu to T, then the product): ops.silu_mul's math on the GEMV's output.
template <typename T>
__device__ __forceinline__ T silu_mul(float gate, float up) {
  const float g = (float)(T)gate, u = (float)(T)up;
  const float act = (float)(T)(g / (1.f + __expf(-g)));
  return (T)(act * u);
}

// Reduce W warps (smem red[W][V][32], V = R * MT * 4 values per lane) for row block rb, of
// which they computed `count` of `total` parts: a whole block is written at once; a part goes
// to the workspace, and whoever completes the block writes it and re-zeroes the workspace and
// the counter. With `parts` > 0 (K split into that many CTAs, this one `part`), each part has a
// slot of its own, ws[parts][blocks][V][32], summed in part order: the same bits on every run,
// so greedy decoding repeats itself. With 0 (stream-K's segments, whose number per block
// varies) the parts are added atomically into ws[blocks][V][32], in arrival order.
// `sync` is the barrier of those warps (the whole CTA, or the bulk pipeline's consumers); it
// starts with one, so red and *last are free on entry.
// SILU: the N = 2F rows are a fused gate|up projection whose 16-row tiles alternate gate / up
// (tile 2j: gate rows 16 j.., 2j + 1: up rows 16 j..; R even, so a pair is in one block), and
// y [M, F] gets silu(gate) * up: one thread sums both cells of a pair and writes the product.
template <bool BF16, int MT, int R, bool SILU, typename Sync>
__device__ __forceinline__ void reduce_parts(const float (&acc)[R][MT][4], float* red, int* last,
                                             typename Num<BF16>::T* __restrict__ y, float* ws,
                                             int* arrivals, int M, int N, int ldy, int rb,
                                             int count, int total, int part, int parts, int W,
                                             Sync sync) {
  using T = typename Num<BF16>::T;
  constexpr int V = R * MT * 4;
  const size_t blocks = N / (16 * R);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const bool whole = count == total;
  sync();
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int q = 0; q < 4; ++q)
        red[((size_t)warp * V + (r * MT + mt) * 4 + q) * 32 + lane] = acc[r][mt][q];
  sync();
  bool done = whole;
  if (!whole) {
    float* slab = ws + ((parts > 0 ? part * blocks : 0) + rb) * V * 32;
    for (int v = warp; v < V; v += W) {
      float sum = 0.f;
      for (int w = 0; w < W; ++w) sum += red[((size_t)w * V + v) * 32 + lane];
      if (parts > 0) __stcg(slab + v * 32 + lane, sum);
      else atomicAdd(slab + v * 32 + lane, sum);
    }
    __threadfence();
    sync();
    if (threadIdx.x == 0) *last = atomicAdd(arrivals + rb, count) + count == total;
    sync();
    done = *last;
    if (done) __threadfence();
  }
  if (done) {
    // cell v's total: the parts' slots in part order (re-zeroed), or the CTA's warps
    auto total = [&](int v) {
      float sum = 0.f;
      if (!whole) {
        for (int p = 0; p < (parts > 0 ? parts : 1); ++p) {
          float* cell = ws + ((p * blocks + rb) * V + v) * 32 + lane;
          sum += __ldcg(cell);
          *cell = 0.f;
        }
      } else {
        for (int w = 0; w < W; ++w) sum += red[((size_t)w * V + v) * 32 + lane];
      }
      return sum;
    };
    if constexpr (SILU) {
      static_assert(R % 2 == 0, "a gate tile and its up tile share a row block");
      constexpr int H = MT * 4;  // a tile's cells: tile 2j's cell v pairs with 2j + 1's v + H
      for (int p = warp; p < V / 2; p += W) {
        const int j = p / H, rest = p % H, q = rest & 3, mt = rest >> 2;
        const int v = 2 * j * H + rest;
        const float gate = total(v), up = total(v + H);
        const int row = (rb * R / 2 + j) * 16 + g + 8 * (q >> 1);
        const int m = mt * 8 + 2 * t + (q & 1);
        if (m < M && row < N / 2) y[(size_t)m * ldy + row] = silu_mul<T>(gate, up);
      }
    } else {
      for (int v = warp; v < V; v += W) {
        const float sum = total(v);
        const int q = v & 3, rmt = v >> 2, r = rmt / MT, mt = rmt % MT;
        const int row = (rb * R + r) * 16 + g + 8 * (q >> 1);
        const int m = mt * 8 + 2 * t + (q & 1);
        if (m < M && row < N) y[(size_t)m * ldy + row] = (T)sum;
      }
    }
    if (!whole && threadIdx.x == 0) arrivals[rb] = 0;
  }
}

// The CTA's end of a row block: `reduce_parts` over all its warps. Ends with a barrier: smem
// is free for the caller again.
template <bool BF16, int MT, int R, bool SILU = false>
__device__ __forceinline__ void finish(const float (&acc)[R][MT][4], float* red,
                                       typename Num<BF16>::T* __restrict__ y, float* ws,
                                       int* arrivals, int M, int N, int ldy, int rb, int count,
                                       int total, int part, int parts) {
  __shared__ int last;
  reduce_parts<BF16, MT, R, SILU>(acc, red, &last, y, ws, arrivals, M, N, ldy, rb, count, total,
                                  part, parts, blockDim.x >> 5, [] { __syncthreads(); });
  __syncthreads();
}

template <int R, int MT>
__device__ __forceinline__ void zero(float (&a)[R][MT][4]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int q = 0; q < 4; ++q) a[r][mt][q] = 0.f;
}

// A warp's chunks: first, first + step, ... below rg.c_end (IL: its turn among the CTA's warps).
// Scales: per warp [R][maxg][16] (each warp its own groups) or, IL, per CTA (all warps share).
// gshift: log2(chunks per group), used when IL (its chunks change group every step).
// Both pipelines' parameters, and their start.
#define TM_GEMV_PARAMS                                                                    \
  const uint4 *__restrict__ qw, const __half *__restrict__ sc,                            \
      const typename Num<BF16>::T *__restrict__ x, typename Num<BF16>::T *__restrict__ y, \
      float *__restrict__ ws, int *__restrict__ arrivals, int M, int N, int K, int ldx,   \
      int ldy, int gc, int gshift
#define TM_WARP_CHUNKS                                                                    \
  extern __shared__ __align__(16) unsigned char smem[];                                   \
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;        \
  const int g = lane >> 2, t = lane & 3, rb = blockIdx.x;                                 \
  const XRows<BF16, MT> xr(x, M, ldx, g, t);                                              \
  const int NC = K >> 6, G = (NC + gc - 1) / gc;                                          \
  const Range rg = warp_range<IL>(NC, gc, W, warp);                                       \
  const int first = rg.c_begin + (IL ? warp : 0), step = IL ? W : 1;                      \
  const uint4* wp[R];                                                                     \
  _Pragma("unroll") for (int r = 0; r < R; ++r) wp[r] = qw + ((size_t)(rb * R + r) * NC) * 32 + lane;

template <bool BF16, int MT, int R, bool IL>
__device__ __forceinline__ void after_chunk(float (&acc)[R][MT][4], float (&part)[R][MT][4],
                                            float (&xsum)[MT][4], const __half* my_sc,
                                            const Range& rg, int c, int gc, int gshift,
                                            int& in_group, int& gi, int g) {
  if (IL) {
    close_group<BF16, MT, R>(acc, part, xsum, my_sc, rg.maxg, (c >> gshift) - rg.g0, g);
  } else if (++in_group == gc || c + 1 == rg.c_end) {
    close_group<BF16, MT, R>(acc, part, xsum, my_sc, rg.maxg, gi++, g);
    in_group = 0;
  }
}

// Register pipeline: MT token groups of 8 (M <= 8 MT), R row tiles per CTA, D chunks of weight
// in flight per warp in registers (16-byte loads that skip L1). SILU: see reduce_parts.
template <bool BF16, int MT, int R, int D, bool IL, bool PROBE = false, bool SILU = false>
__global__ void __launch_bounds__(256) w4_gemv_regs(TM_GEMV_PARAMS) {
  TM_WARP_CHUNKS
  __half* my_sc = reinterpret_cast<__half*>(smem) + (IL ? 0 : (size_t)warp * R * rg.maxg * 16);

  uint4 wbuf[D][R];
#pragma unroll
  for (int s = 0; s < D; ++s)
    if (first + s * step < rg.c_end)
#pragma unroll
      for (int r = 0; r < R; ++r) wbuf[s][r] = load_stream(wp[r] + (size_t)(first + s * step) * 32);
  load_scales<R, IL>(my_sc, sc, rg, G, rb, lane);
  pdl_wait();

  float acc[R][MT][4], part[R][MT][4], xsum[1][MT][4];
  zero(acc);
  zero(part);
  zero(xsum);
  int in_group = 0, gi = 0;  // chunk within its group, group index from g0: no divisions
  uint32_t probe = 0;
  for (int base = first; base < rg.c_end; base += D * step) {
#pragma unroll
    for (int s = 0; s < D; ++s) {
      const int c = base + s * step;
      if (c < rg.c_end) {
        uint4 wcur[R], xv[MT][2];
#pragma unroll
        for (int r = 0; r < R; ++r) wcur[r] = wbuf[s][r];
        if (!PROBE) xr.load(xv, c);
        if (c + D * step < rg.c_end)
#pragma unroll
          for (int r = 0; r < R; ++r) wbuf[s][r] = load_stream(wp[r] + (size_t)(c + D * step) * 32);
        if (PROBE) {
#pragma unroll
          for (int r = 0; r < R; ++r) probe ^= wcur[r].x ^ wcur[r].y ^ wcur[r].z ^ wcur[r].w;
        } else {
          chunk_products<BF16, MT, R>(part, xsum[0], wcur, xv);
          after_chunk<BF16, MT, R, IL>(acc, part, xsum[0], my_sc, rg, c, gc, gshift, in_group, gi,
                                       g);
        }
      }
    }
  }
  if (PROBE) acc[0][0][0] = __uint_as_float(probe & 0x3fffffffu);
  finish<BF16, MT, R, SILU>(acc, reinterpret_cast<float*>(smem), y, ws, arrivals, M, N, ldy, rb,
                            1, gridDim.y, blockIdx.y, gridDim.y);
}

// Register ring: the interleaved register pipeline (mode 2) with D + 1 sets of weight words,
// so that a load never waits. In mode 2 chunk c + D is loaded into the set chunk c is being
// read from; ptxas lands it in spare registers and copies them back at the chunk's end, and
// that copy waits for the load: each chunk then waits out a whole load latency (one chunk in
// flight, not D). Here chunk n is read from set n % S and chunk n + D goes into set
// (n + D) % S, the set of chunk n - 1, already read: the loop is unrolled S times so each set
// keeps its registers, and every load is unconditional (past the warp's range it reads the
// warp's last chunk again), so no old value has to survive beside it.
// ring_run: one row block's chunks [rg.c_begin, rg.c_end), the CTA's warps taking them in
// turn, into acc (zeroed here); the first D chunks and the scales are loaded before the PDL
// wait. PROBE: the stream alone (no x, no products). X8 (with PAIRS): x is int8 codes and xs
// their scales (X8Rows), the products on int8 tensor cores, each group closed once.
// PAIRS (groups of 128: gc == 2, the caller checks): the warp takes whole groups, g0 + warp,
// g0 + warp + W, ..., both chunks of each in turn, so a group's partial sums close once, after
// its second chunk, not after every chunk (a close is ~a fifth of a chunk's instructions at 2
// tiles); S even, so the closing chunks sit at fixed places in the unrolled turn.
template <bool BF16, int MT, int R, int D, bool PROBE, bool PAIRS = false, bool X8 = false>
__device__ __forceinline__ void ring_run(float (&acc)[R][MT][4], const uint4* __restrict__ qw,
                                         const __half* __restrict__ sc,
                                         const typename Num<BF16>::T* __restrict__ x,
                                         const float* __restrict__ xs, __half* my_sc,
                                         const Range& rg, int rb, int NC, int G, int M, int ldx,
                                         int gc, int gshift, uint32_t& probe) {
  constexpr int S = D + 1;
  static_assert(!PAIRS || S % 2 == 0, "a group's two chunks close at fixed places of a turn");
  static_assert(!X8 || PAIRS, "int8 sums close once a group, after its two chunks");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const XRows<BF16, MT> xr(x, M, ldx, g, t);
  const X8Rows<MT> x8r(x, xs, M, NC * 64, g, t);  // X8: x is the int8 codes
  const int first = rg.c_begin + (PAIRS ? 2 * warp : warp), step = W;
  const int groups = rg.g1 - rg.g0;
  const int count = PAIRS ? (warp < groups ? 2 * ((groups - 1 - warp) / W + 1) : 0)
                          : (first < rg.c_end ? (rg.c_end - first + step - 1) / step : 0);
  // the warp's n-th chunk: in turn (first + n W), or in pairs (first + (n / 2) 2W + n % 2)
  auto chunk_of = [&](int n) {
    return PAIRS ? first + (n >> 1) * 2 * W + (n & 1) : first + n * step;
  };
  const int last = count > 0 ? chunk_of(count - 1) : rg.c_begin;
  auto chunk = [&](int n) { return min(chunk_of(n), last); };
  const uint4* wp[R];
#pragma unroll
  for (int r = 0; r < R; ++r) wp[r] = opaque(qw + ((size_t)(rb * R + r) * NC) * 32 + lane);

  uint4 wbuf[S][R];
#pragma unroll
  for (int s = 0; s < D; ++s)
#pragma unroll
    for (int r = 0; r < R; ++r) wbuf[s][r] = load_stream(advance<512>(wp[r], chunk(s)));
  load_scales_il<R>(my_sc, sc, rg, G, rb);
  pdl_wait();

  float part[R][MT][4], xsum[1][MT][4];
  int isum[R][MT][4] = {};
  zero(acc);
  zero(part);
  zero(xsum);
  int in_group = 0, gi = 0;
  // s: the chunk's place in its turn (PAIRS: odd closes the group)
  auto consume = [&](int n, const uint4(&w)[R], int s) {
    if constexpr (PROBE) {
#pragma unroll
      for (int r = 0; r < R; ++r) probe ^= w[r].x ^ w[r].y ^ w[r].z ^ w[r].w;
    } else if constexpr (X8) {
      const int c = chunk_of(n);
      uint4 xb[MT];
      x8r.load(xb, c);
      chunk_products_x8<MT, R>(isum, w, xb);
      if (s & 1) close_group_x8<MT, R>(acc, isum, x8r, my_sc, rg.maxg, (c >> 1) - rg.g0, c >> 1, g);
    } else {
      const int c = chunk_of(n);
      uint4 xv[MT][2];
      xr.load(xv, c);
      chunk_products<BF16, MT, R>(part, xsum[0], w, xv);
      if (!PAIRS)
        after_chunk<BF16, MT, R, true>(acc, part, xsum[0], my_sc, rg, c, gc, gshift, in_group,
                                       gi, g);
      else if (s & 1)
        close_group<BF16, MT, R>(acc, part, xsum[0], my_sc, rg.maxg, (c >> 1) - rg.g0, g);
    }
  };
  // whole turns of the ring, with no branch between their chunks (a branch would let ptxas
  // sink a load to the one path that reads it: next to its use), then the last < S chunks
  int n = 0;
  for (; n + S <= count; n += S) {
#pragma unroll
    for (int s = 0; s < S; ++s) {
#pragma unroll
      for (int r = 0; r < R; ++r)
        wbuf[(s + D) % S][r] = load_stream(advance<512>(wp[r], chunk(n + s + D)));
      consume(n + s, wbuf[s], s);
    }
  }
#pragma unroll
  for (int s = 0; s < D; ++s)
    if (n + s < count) consume(n + s, wbuf[s], s);
}

// Modes 7 and 9 (PAIRS): the ring over the CTA's K range (split over gridDim.y). SILU: see
// reduce_parts.
template <bool BF16, int MT, int R, int D, bool PROBE = false, bool SILU = false,
          bool PAIRS = false, bool X8 = false>
__global__ void __launch_bounds__(256, 2) w4_gemv_ring(TM_GEMV_PARAMS,
                                                       const float* __restrict__ xs) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int NC = K >> 6, G = (NC + gc - 1) / gc, rb = blockIdx.x;
  const Range rg = warp_range<true>(NC, gc, blockDim.x >> 5, threadIdx.x >> 5);
  float acc[R][MT][4];
  uint32_t probe = 0;
  ring_run<BF16, MT, R, D, PROBE, PAIRS, X8>(acc, qw, sc, x, xs, reinterpret_cast<__half*>(smem),
                                             rg, rb, NC, G, M, ldx, gc, gshift, probe);
  if (PROBE) acc[0][0][0] = __uint_as_float(probe & 0x3fffffffu);
  finish<BF16, MT, R, SILU>(acc, reinterpret_cast<float*>(smem), y, ws, arrivals, M, N, ldy, rb,
                            1, gridDim.y, blockIdx.y, gridDim.y);
}

// Mode 10, the persistent ring (groups of 128, R = 2, M <= 16): gridDim.x CTAs stay resident and
// take row blocks blockIdx.x, + gridDim.x, ..., each over all of K, and the ring runs on across
// them: the last turn of a row block loads the next one's first chunks, and the next one's
// scales are copied (cp.async) into a second buffer while this one runs. A CTA of mode 9 pays a
// fixed ~2.8 us (8 warps) for its prologue, ring fill and reduction, a third of its life at
// K = 5120 on one H200 (bench/kernels/int4_mma_scaling.py); here that is paid once a CTA.
// Every warp has count = 2 G / W chunks a row block (the host checks G % W == 0 and count % S
// == 0), so the turns of the ring end where row blocks do. X8: as ring_run's.
template <bool BF16, int MT, int R, int D, bool SILU, bool X8 = false>
__global__ void __launch_bounds__(256, 2) w4_gemv_persist(TM_GEMV_PARAMS,
                                                          const float* __restrict__ xs) {
  constexpr int S = D + 1;
  static_assert(S % 2 == 0, "a group's two chunks close at fixed places of a turn");
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int NC = K >> 6, G = NC >> 1, blocks = N / (16 * R), P = gridDim.x;
  const int count = 2 * G / W;
  float* red = reinterpret_cast<float*>(smem);
  __half* scb = reinterpret_cast<__half*>(smem + (size_t)W * R * MT * 4 * 32 * sizeof(float));
  const int sc_per = R * G * 16;  // halves of one row block's scales: [R][G][16]
  const XRows<BF16, MT> xr(x, M, ldx, g, t);
  const X8Rows<MT> x8r(x, xs, M, K, g, t);  // X8: x is the int8 codes
  auto chunk_of = [&](int n) { return 2 * warp + (n >> 1) * 2 * W + (n & 1); };
  auto block_ptrs = [&](int rb, const uint4* (&p)[R]) {
#pragma unroll
    for (int r = 0; r < R; ++r) p[r] = opaque(qw + ((size_t)(rb * R + r) * NC) * 32 + lane);
  };
  // row block rb's scales into buffer b: R runs of G * 32 bytes, 16 bytes a copy
  auto copy_scales = [&](int rb, int b) {
    const int per = 2 * G;
    for (int i = threadIdx.x; i < R * per; i += blockDim.x) {
      const int r = i >= per, piece = i - r * per;  // R == 2
      cp_async16(scb + b * sc_per + r * G * 16 + piece * 8,
                 sc + ((size_t)(rb * R + r) * G) * 16 + piece * 8);
    }
    cp_async_commit();
  };
  int rb = blockIdx.x;
  const uint4 *wcur[R], *wnext[R];
  block_ptrs(rb, wcur);
  block_ptrs(rb + P < blocks ? rb + P : rb, wnext);  // past the last block: its own, from L2
  uint4 wbuf[S][R];
#pragma unroll
  for (int s = 0; s < D; ++s)
#pragma unroll
    for (int r = 0; r < R; ++r) wbuf[s][r] = load_stream(advance<512>(wcur[r], chunk_of(s)));
  copy_scales(rb, 0);
  if (rb + P < blocks) copy_scales(rb + P, 1);
  else cp_async_commit();
  cp_async_wait<1>();
  __syncthreads();
  pdl_wait();

  float acc[R][MT][4], part[R][MT][4], xsum[1][MT][4];
  int isum[R][MT][4] = {};
  zero(acc);
  zero(part);
  zero(xsum);
  for (int b = 0;; b ^= 1) {
    const __half* my_sc = scb + b * sc_per;
    for (int n = 0; n < count; n += S) {
#pragma unroll
      for (int s = 0; s < S; ++s) {
        const int ln = n + s + D;  // the chunk this step loads: this row block's, or the next's
        const bool here = ln < count;
        const int lc = chunk_of(here ? ln : ln - count);
#pragma unroll
        for (int r = 0; r < R; ++r)
          wbuf[(s + D) % S][r] = load_stream(advance<512>(here ? wcur[r] : wnext[r], lc));
        const int c = chunk_of(n + s);
        if constexpr (X8) {
          uint4 xb[MT];
          x8r.load(xb, c);
          chunk_products_x8<MT, R>(isum, wbuf[s], xb);
          if (s & 1) close_group_x8<MT, R>(acc, isum, x8r, my_sc, G, c >> 1, c >> 1, g);
        } else {
          uint4 xv[MT][2];
          xr.load(xv, c);
          chunk_products<BF16, MT, R>(part, xsum[0], wbuf[s], xv);
          if (s & 1) close_group<BF16, MT, R>(acc, part, xsum[0], my_sc, G, c >> 1, g);
        }
      }
    }
    cp_async_wait<0>();  // the next row block's scales (this thread's copies; finish syncs)
    finish<BF16, MT, R, SILU>(acc, red, y, ws, arrivals, M, N, ldy, rb, 1, 1, 0, 1);
    rb += P;
    if (rb >= blocks) break;
#pragma unroll
    for (int r = 0; r < R; ++r) wcur[r] = wnext[r];
    block_ptrs(rb + P < blocks ? rb + P : rb, wnext);
    if (rb + P < blocks) copy_scales(rb + P, b);  // the buffer the block before last read
    else cp_async_commit();
    zero(acc);
  }
}

// cp.async pipeline: each lane copies its own 16-byte quads (L2 -> smem, no registers held,
// not tracked by L1) D - 1 chunks ahead into the warp's ring [D][R][32]. SILU: see reduce_parts.
template <bool BF16, int MT, int R, int D, bool IL, bool SILU = false>
__global__ void __launch_bounds__(256) w4_gemv_async(TM_GEMV_PARAMS) {
  TM_WARP_CHUNKS
  uint4* ring = reinterpret_cast<uint4*>(smem) + (size_t)warp * D * R * 32;
  __half* my_sc = reinterpret_cast<__half*>(reinterpret_cast<uint4*>(smem) + (size_t)W * D * R * 32) +
                  (IL ? 0 : (size_t)warp * R * rg.maxg * 16);
  auto issue = [&](int n) {  // the warp's n-th chunk
    const int c = first + n * step;
    if (c < rg.c_end) {
      const int slot = n & (D - 1);
#pragma unroll
      for (int r = 0; r < R; ++r) cp_async16(ring + (slot * R + r) * 32 + lane, wp[r] + (size_t)c * 32);
    }
    cp_async_commit();  // empty groups keep the count uniform
  };
#pragma unroll
  for (int s = 0; s < D - 1; ++s) issue(s);
  load_scales<R, IL>(my_sc, sc, rg, G, rb, lane);
  pdl_wait();

  float acc[R][MT][4], part[R][MT][4], xsum[1][MT][4];
  zero(acc);
  zero(part);
  zero(xsum);
  int in_group = 0, gi = 0;
  int n = 0;
  for (int c = first; c < rg.c_end; c += step, ++n) {
    uint4 xv[MT][2];
    xr.load(xv, c);
    issue(n + D - 1);  // into the slot chunk n - 1 was read from
    cp_async_wait<D - 1>();
    const int slot = n & (D - 1);
    uint4 w[R];
#pragma unroll
    for (int r = 0; r < R; ++r) w[r] = ring[(slot * R + r) * 32 + lane];
    chunk_products<BF16, MT, R>(part, xsum[0], w, xv);
    after_chunk<BF16, MT, R, IL>(acc, part, xsum[0], my_sc, rg, c, gc, gshift, in_group, gi, g);
  }
  cp_async_wait<0>();
  finish<BF16, MT, R, SILU>(acc, reinterpret_cast<float*>(smem), y, ws, arrivals, M, N, ldy, rb,
                            1, gridDim.y, blockIdx.y, gridDim.y);
}

// Stream-K: gridDim.x CTAs (a few per SM, all resident) split the N / 16R row blocks x K / 64
// chunks evenly, in row-block order; each CTA runs its range as segments of one row block, its
// warps taking the segment's chunks in turn (register pipeline, D in flight), and finishes each
// segment as a part of its row block. No partial last wave, whatever the shape.
template <bool BF16, int MT, int R, int D>
__global__ void __launch_bounds__(256) w4_gemv_streamk(TM_GEMV_PARAMS) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const XRows<BF16, MT> xr(x, M, ldx, g, t);
  const int NC = K >> 6, G = (NC + gc - 1) / gc, blocks = N / (16 * R);
  const long long U = (long long)blocks * NC, P = gridDim.x;
  const long long u_end = U * (blockIdx.x + 1) / P;
  const int maxg = (int)((U + P - 1) / P) / gc + 2;  // groups one segment can touch
  __half* cta_sc = reinterpret_cast<__half*>(smem);
  pdl_wait();
  for (long long u = U * blockIdx.x / P; u < u_end;) {
    const int rb = (int)(u / NC), c0 = (int)(u % NC);
    const int c1 = (int)min((long long)NC, c0 + (u_end - u));
    Range rg;
    rg.g0 = c0 >> gshift;
    rg.g1 = ((c1 - 1) >> gshift) + 1;
    rg.c_begin = c0;
    rg.c_end = c1;
    rg.maxg = maxg;
    const uint4* wp[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wp[r] = qw + ((size_t)(rb * R + r) * NC) * 32 + lane;
    const int first = c0 + warp;
    uint4 wbuf[D][R];
#pragma unroll
    for (int s = 0; s < D; ++s)
      if (first + s * W < c1)
#pragma unroll
        for (int r = 0; r < R; ++r) wbuf[s][r] = load_stream(wp[r] + (size_t)(first + s * W) * 32);
    load_scales<R, true>(cta_sc, sc, rg, G, rb, lane);

    float acc[R][MT][4], part[R][MT][4], xsum[1][MT][4];
    zero(acc);
    zero(part);
    zero(xsum);
    int in_group = 0, gi = 0;
    for (int base = first; base < c1; base += D * W) {
#pragma unroll
      for (int s = 0; s < D; ++s) {
        const int c = base + s * W;
        if (c < c1) {
          uint4 wcur[R], xv[MT][2];
#pragma unroll
          for (int r = 0; r < R; ++r) wcur[r] = wbuf[s][r];
          xr.load(xv, c);
          if (c + D * W < c1)
#pragma unroll
            for (int r = 0; r < R; ++r) wbuf[s][r] = load_stream(wp[r] + (size_t)(c + D * W) * 32);
          chunk_products<BF16, MT, R>(part, xsum[0], wcur, xv);
          after_chunk<BF16, MT, R, true>(acc, part, xsum[0], cta_sc, rg, c, gc, gshift, in_group,
                                         gi, g);
        }
      }
    }
    finish<BF16, MT, R>(acc, reinterpret_cast<float*>(smem), y, ws, arrivals, M, N, ldy, rb,
                        c1 - c0, NC, 0, 0);
    u += c1 - c0;
  }
}

// Bulk-copy pipeline (sm_90): one producer warp streams the weights into a shared-memory ring
// with `cp.async.bulk` (the copy engine; one instruction moves a whole stage of a tile, and
// the bytes in flight are set by the ring, not by registers or by how soon the math warps come
// back), and W consumer warps turn them into products. gridDim.x CTAs stay resident and split
// the N / 16R row blocks x NC / W stages evenly, in row-block order (as stream-K does), so the
// producer never drains between row blocks and no wave is partial. A stage is W chunks of one
// row block (one per consumer warp), R copies of W x 512 contiguous bytes. Barriers: full[d]
// (the producer's expect_tx, completed by the copies' bytes) and empty[d] (one arrival per
// consumer warp). PROBE: the consumers skip x and the products (the stream alone, for timing).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred P1;\n"
      "TM_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra TM_DONE;\n"
      "bra TM_WAIT;\n"
      "TM_DONE:\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
#endif

// The bulk pipeline's consumer warps synchronize among themselves (the producer never joins).
__device__ __forceinline__ void consumer_sync(int threads) {
  asm volatile("bar.sync 1, %0;\n" ::"r"(threads) : "memory");
}

template <bool BF16, int MT, int R, bool PROBE>
__global__ void __launch_bounds__(288, 2) w4_gemv_bulk(TM_GEMV_PARAMS, int D) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int V = R * MT * 4;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = (blockDim.x >> 5) - 1;
  const int g = lane >> 2, t = lane & 3;
  const XRows<BF16, MT> xr(x, M, ldx, g, t);
  const int NC = K >> 6, G = (NC + gc - 1) / gc, SPB = NC / W;  // stages per row block
  const long long stages = (long long)(N / (16 * R)) * SPB;
  const long long t0 = stages * blockIdx.x / gridDim.x, t1 = stages * (blockIdx.x + 1) / gridDim.x;
  uint4* ring = reinterpret_cast<uint4*>(smem);  // [D][R][W chunks][32 lanes]
  float* red = reinterpret_cast<float*>(ring + (size_t)D * R * W * 32);
  uint64_t* full = reinterpret_cast<uint64_t*>(red + (size_t)W * V * 32);
  uint64_t* empty = full + D;
  if (threadIdx.x == 0) {
    for (int d = 0; d < D; ++d) {
      mbar_init(full + d, 1);
      mbar_init(empty + d, W);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (warp == W) {  // the producer: weights are constants, so it never waits for the kernel before
    pdl_release();
    if (lane == 0) {
      const uint32_t bytes = (uint32_t)W * 512;
      int d = 0;
      uint32_t phase = 0;
      for (long long s = t0; s < t1; ++s) {
        mbar_wait(empty + d, phase ^ 1);  // a fresh barrier passes parity 1 at once
        mbar_expect_tx(full + d, bytes * R);
        const int rb = (int)(s / SPB), c0 = (int)(s % SPB) * W;
#pragma unroll
        for (int r = 0; r < R; ++r)
          bulk_copy(ring + ((size_t)d * R + r) * W * 32, qw + ((size_t)(rb * R + r) * NC + c0) * 32,
                    bytes, full + d);
        if (++d == D) {
          d = 0;
          phase ^= 1;
        }
      }
    }
    return;
  }
  pdl_wait();
  int d = 0;
  uint32_t phase = 0;
  // x and the scales of a chunk do not wait for its weights: each stage's are loaded one stage
  // ahead (an L2 round trip, otherwise on every stage's critical path)
  uint4 xv[MT][2], xn[MT][2];
  float s0[R], s1[R], n0[R], n1[R];
  auto fetch = [&](long long st, uint4(&xo)[MT][2], float(&o0)[R], float(&o1)[R]) {
    if (PROBE) return;
    const int rb = (int)(st / SPB), c = (int)(st % SPB) * W + warp, grp = c >> gshift;
    xr.load(xo, c);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const __half* sp = sc + ((size_t)(rb * R + r) * G + grp) * 16 + g;
      o0[r] = __half2float(sp[0]);
      o1[r] = __half2float(sp[8]);
    }
  };
  if (t0 < t1) fetch(t0, xv, s0, s1);
  for (long long s = t0; s < t1;) {
    const int rb = (int)(s / SPB);
    const long long seg_end = min(t1, (long long)(rb + 1) * SPB);
    const int count = (int)(seg_end - s) * W;
    float acc[R][MT][4], part[R][MT][4], xsum[1][MT][4];
    zero(acc);
    zero(part);  // close_group_by zeroes them again after each chunk
    zero(xsum);
    uint32_t probe = 0;
    for (; s < seg_end; ++s) {
      mbar_wait(full + d, phase);
      uint4 w[R];
#pragma unroll
      for (int r = 0; r < R; ++r) w[r] = ring[(((size_t)d * R + r) * W + warp) * 32 + lane];
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + d);  // the words are in registers: the slot is free
      if (++d == D) {
        d = 0;
        phase ^= 1;
      }
      if (s + 1 < t1) fetch(s + 1, xn, n0, n1);
      if (PROBE) {
#pragma unroll
        for (int r = 0; r < R; ++r) probe ^= w[r].x ^ w[r].y ^ w[r].z ^ w[r].w;
      } else {
        chunk_products<BF16, MT, R>(part, xsum[0], w, xv);
        close_group_by<BF16, MT, R>(acc, part, xsum[0],
                                    [&](int r, int h) { return h ? s1[r] : s0[r]; });
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          xv[mt][0] = xn[mt][0];
          xv[mt][1] = xn[mt][1];
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
          s0[r] = n0[r];
          s1[r] = n1[r];
        }
      }
    }
    if (PROBE) acc[0][0][0] = __uint_as_float(probe & 0x3fffffffu);
    reduce_parts<BF16, MT, R, false>(acc, red, &last, y, ws, arrivals, M, N, ldy, rb, count, NC,
                                     0, 0, W, [W] { consumer_sync(W * 32); });
  }
#endif
}

// One thread per 16-byte word quad: rows (g, g + 8) of its tile, 16 consecutive k each, as
// 16-bit floats (prefill through cuBLAS) or, SCALED, as e4m3 of q * s_g / cs_n, cs the scale
// per output channel (the FP8 prefill path's scaled_mm operand), or, CODES, q - 8 itself
// (exact in e4m3: the W4A8 prefill GEMM applies the group scales to its fp32 sums). With
// CODES and `bs`, the same launch writes those group scales as cuBLAS's 1x128 blocks, fp32
// bs[K / 128][N] (groups of a multiple of 128): the GEMM's other operand, which four torch
// ops a GEMM built before.
template <typename Out, bool SCALED, bool CODES = false>
__global__ void w4_dequant_kernel(const uint4* __restrict__ qw, const __half* __restrict__ sc,
                                  const float* __restrict__ cs, Out* __restrict__ out, int N,
                                  int K, int gc, float* __restrict__ bs) {
  using Vec = typename std::conditional<sizeof(Out) == 2, uint4, uint2>::type;  // 8 values
  const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int NC = K >> 6, G = (NC + gc - 1) / gc;
  if (idx >= (size_t)(N >> 4) * NC * 32) return;
  const int lane = idx & 31, c = (idx >> 5) % NC, rt = (int)((idx >> 5) / NC);
  const int g = lane >> 2, t = lane & 3;
  if (CODES && bs != nullptr && t == 0 && (c & 1) == 0) {
    const __half* s = sc + ((size_t)rt * G + c / gc) * 16 + g;
    float* b = bs + (size_t)(c >> 1) * N + rt * 16 + g;
    b[0] = __half2float(s[0]);
    b[8] = __half2float(s[8]);
  }
  float s0 = CODES ? 1.f : __half2float(sc[((size_t)rt * G + c / gc) * 16 + g]);
  float s1 = CODES ? 1.f : __half2float(sc[((size_t)rt * G + c / gc) * 16 + g + 8]);
  if (SCALED) {
    s0 *= 1.f / cs[rt * 16 + g];
    s1 *= 1.f / cs[rt * 16 + g + 8];
  }
  const uint4 w = qw[idx];
  __align__(16) Out lo[16], hi[16];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t v = word(w, i);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int e = 4 * i + 2 * (j >> 1);
      const float q0 = (float)((v >> (4 * j)) & 0xf) - 8.f;
      const float q1 = (float)((v >> (4 * j + 16)) & 0xf) - 8.f;
      if (j & 1) {
        hi[e] = Out(q0 * s1);
        hi[e + 1] = Out(q1 * s1);
      } else {
        lo[e] = Out(q0 * s0);
        lo[e + 1] = Out(q1 * s0);
      }
    }
  }
  // products 0, 1 hold k = 64 c + 8 t + 0..7; products 2, 3 hold 64 c + 32 + 8 t + 0..7
  const size_t k0 = (size_t)c * 64 + 8 * t;
  Vec* o0 = reinterpret_cast<Vec*>(out + ((size_t)rt * 16 + g) * K + k0);
  Vec* o1 = reinterpret_cast<Vec*>(out + ((size_t)rt * 16 + g + 8) * K + k0);
  o0[0] = reinterpret_cast<Vec*>(lo)[0];
  o0[4] = reinterpret_cast<Vec*>(lo)[1];
  o1[0] = reinterpret_cast<Vec*>(hi)[0];
  o1[4] = reinterpret_cast<Vec*>(hi)[1];
}

// The device's multiprocessor count and compute capability, asked once (one GPU a process).
struct DeviceInfo {
  int sms = 0, major = 0;
};
inline const DeviceInfo& device_info() {
  static const DeviceInfo info = [] {
    DeviceInfo d;
    int device = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, device);
    return d;
  }();
  return info;
}

template <bool BF16, int MT, int R, bool PROBE>
int launch_bulk(const void* qw, const void* sc, const void* x, void* y, void* ws, void* arrivals,
                int M, int N, int K, int ldx, int ldy, int gc, int warps, int ctas_per_sm,
                int depth, bool pdl, cudaStream_t stream) {
  using T = typename Num<BF16>::T;
  const int sms = device_info().sms, NC = K / 64;
  // the copy engine is sm_90's; a stage is one chunk per consumer warp; groups by a shift
  if (device_info().major < 9 || (gc & (gc - 1)) || NC % warps || depth < 2 || depth > 8)
    return -1;
  const long long stages = (long long)(N / (16 * R)) * (NC / warps);
  const int P = (int)(stages < (long long)sms * ctas_per_sm ? stages : (long long)sms * ctas_per_sm);
  const size_t bytes = (size_t)depth * R * warps * 512 + (size_t)warps * R * MT * 4 * 32 * 4 +
                       2 * (size_t)depth * sizeof(uint64_t);
  auto kernel = w4_gemv_bulk<BF16, MT, R, PROBE>;
  return launch_kernel(kernel, dim3(P), dim3((warps + 1) * 32), bytes, stream, pdl,
                       static_cast<const uint4*>(qw), static_cast<const __half*>(sc),
                       static_cast<const T*>(x), static_cast<T*>(y), static_cast<float*>(ws),
                       static_cast<int*>(arrivals), M, N, K, ldx, ldy, gc, __builtin_ctz(gc),
                       depth);
}

template <bool BF16, int MT, int R, int D, bool ASYNC, bool IL, bool PROBE = false,
          bool SILU = false, int RING = 0, bool X8 = false>
int launch_gemv(const void* qw, const void* sc, const void* x, void* y, void* ws, void* arrivals,
                int M, int N, int K, int ldx, int ldy, int gc, int warps, int splits, bool pdl,
                cudaStream_t stream, const float* xs = nullptr) {
  using T = typename Num<BF16>::T;
  const int NC = K / 64, G = (NC + gc - 1) / gc, P = splits * (IL ? 1 : warps);
  const int maxg = (G + P - 1) / P;
  if (IL && (gc & (gc - 1))) return -1;  // interleaved chunks find their group by a shift
  const int gshift = __builtin_ctz(gc);
  const size_t sc_bytes = (size_t)(IL ? 1 : warps) * R * maxg * 16 * sizeof(__half);
  const size_t ring_bytes = ASYNC ? (size_t)warps * D * R * 32 * 16 : 0;
  const size_t red_bytes = (size_t)warps * R * MT * 4 * 32 * sizeof(float);
  const size_t bytes = ring_bytes + sc_bytes > red_bytes ? ring_bytes + sc_bytes : red_bytes;
  // if constexpr, not ?: (which would build both kernels, one never launched)
  auto kernel = [] {
    if constexpr (RING > 0) return w4_gemv_ring<BF16, MT, R, D, PROBE, SILU, RING == 2, X8>;
    else if constexpr (ASYNC) return w4_gemv_async<BF16, MT, R, D, IL, SILU>;
    else return w4_gemv_regs<BF16, MT, R, D, IL, PROBE, SILU>;
  }();
  dim3 grid(N / (16 * R), splits);
  if constexpr (RING > 0)
    return launch_kernel(kernel, grid, dim3(warps * 32), bytes, stream, pdl,
                         static_cast<const uint4*>(qw), static_cast<const __half*>(sc),
                         static_cast<const T*>(x), static_cast<T*>(y), static_cast<float*>(ws),
                         static_cast<int*>(arrivals), M, N, K, ldx, ldy, gc, gshift, xs);
  else
    return launch_kernel(kernel, grid, dim3(warps * 32), bytes, stream, pdl,
                         static_cast<const uint4*>(qw), static_cast<const __half*>(sc),
                         static_cast<const T*>(x), static_cast<T*>(y), static_cast<float*>(ws),
                         static_cast<int*>(arrivals), M, N, K, ldx, ldy, gc, gshift);
}

template <bool BF16, int MT, int R, int D>
int launch_streamk(const void* qw, const void* sc, const void* x, void* y, void* ws,
                   void* arrivals, int M, int N, int K, int ldx, int ldy, int gc, int warps,
                   int ctas_per_sm, bool pdl, cudaStream_t stream) {
  using T = typename Num<BF16>::T;
  if (gc & (gc - 1)) return -1;
  const int sms = device_info().sms;
  const long long U = (long long)(N / (16 * R)) * (K / 64);
  const int P = (int)(U < (long long)sms * ctas_per_sm ? U : (long long)sms * ctas_per_sm);
  const int maxg = (int)((U + P - 1) / P) / gc + 2;
  const size_t sc_bytes = (size_t)R * maxg * 16 * sizeof(__half);
  const size_t red_bytes = (size_t)warps * R * MT * 4 * 32 * sizeof(float);
  const size_t bytes = sc_bytes > red_bytes ? sc_bytes : red_bytes;
  auto kernel = w4_gemv_streamk<BF16, MT, R, D>;
  return launch_kernel(kernel, dim3(P), dim3(warps * 32), bytes, stream, pdl,
                       static_cast<const uint4*>(qw), static_cast<const __half*>(sc),
                       static_cast<const T*>(x), static_cast<T*>(y), static_cast<float*>(ws),
                       static_cast<int*>(arrivals), M, N, K, ldx, ldy, gc, __builtin_ctz(gc));
}

template <bool BF16, int MT, int R, bool SILU, bool X8 = false>
int launch_persist(const void* qw, const void* sc, const void* x, void* y, int M, int N, int K,
                   int ldx, int ldy, int gc, int warps, int ctas_per_sm, bool pdl,
                   cudaStream_t stream, const float* xs = nullptr) {
  using T = typename Num<BF16>::T;
  constexpr int D = 3;
  const int NC = K / 64, G = NC / 2, blocks = N / (16 * R);
  if (gc != 2 || NC % 2 || G % warps || (2 * G / warps) % (D + 1) || ctas_per_sm < 1) return -1;
  const int slots = device_info().sms * ctas_per_sm, P = blocks < slots ? blocks : slots;
  const size_t bytes = (size_t)warps * R * MT * 4 * 32 * sizeof(float) +
                       2 * (size_t)R * G * 16 * sizeof(__half);
  auto kernel = w4_gemv_persist<BF16, MT, R, D, SILU, X8>;
  return launch_kernel(kernel, dim3(P), dim3(warps * 32), bytes, stream, pdl,
                       static_cast<const uint4*>(qw), static_cast<const __half*>(sc),
                       static_cast<const T*>(x), static_cast<T*>(y), nullptr, nullptr, M, N, K,
                       ldx, ldy, gc, 1, xs);
}

// Modes 0-2, 7 and 9: K split over the grid's y.
template <bool BF16, int MT, int R, bool SILU>
int gemv_split_k(const void* qw, const void* sc, const void* x, void* y, void* ws, void* arrivals,
                 int M, int N, int K, int ldx, int ldy, int gc, int warps, int splits, int depth,
                 int mode, bool pdl, cudaStream_t s) {
#define TM_GEMV(D, ASYNC, IL, RING)                                                           \
  launch_gemv<BF16, MT, R, D, ASYNC, IL, false, SILU, RING>(qw, sc, x, y, ws, arrivals, M, N, K, \
                                                            ldx, ldy, gc, warps, splits, pdl, s)
  switch (mode) {
    case 0: return TM_GEMV(2, false, false, 0);
    case 1: return TM_GEMV(4, true, false, 0);
    case 2: return depth >= 4 ? TM_GEMV(4, false, true, 0) : TM_GEMV(2, false, true, 0);
    case 7: return depth >= 4 ? TM_GEMV(4, false, true, 1) : TM_GEMV(2, false, true, 1);
    case 9: return gc == 2 && (K / 64) % 2 == 0 ? TM_GEMV(3, false, true, 2) : -1;
    default: return -1;
  }
#undef TM_GEMV
}

// mode: 0 register pipeline (2 chunks in flight per warp), 1 cp.async ring (4 slots), 2 the
// register pipeline with interleaved chunks (the CTA's warps take turns along one run; depth 2
// or 4), 3 stream-K over that pipeline (`splits` CTAs per SM; depth 2 or 4), 4 the bulk-copy
// pipeline (`warps` consumer warps and a producer, `splits` CTAs per SM, a ring of `depth`
// stages; sm_90), 7 the register ring (mode 2 with a set of registers more than chunks in
// flight, depth 2 or 4), 9 the ring taking whole groups of 128 (3 chunks in flight), 10 mode 9's
// ring in `splits` persistent CTAs per SM (2 tiles, M <= 16; w4_gemv_persist). Probes for
// timing only (their output is not the product, M <= 8): 5 mode 4's stream without the math,
// 6 mode 2's (depth 2) likewise, 8 mode 7's (depth 2). The variants that lost on one H200
// (deeper rings, interleaved cp.async, stream-K on the ring, x loaded a chunk ahead in the
// ring) are not built: each costs compile time at the worker's first start. SILU (modes 0-2,
// 7, 9 and 10): the fused gate|up epilogue of reduce_parts.
template <bool BF16, int MT, int R, bool SILU>
int gemv_by_mode(const void* qw, const void* sc, const void* x, void* y, void* ws, void* arrivals,
                 int M, int N, int K, int ldx, int ldy, int gc, int warps, int splits, int depth,
                 int mode, bool pdl, cudaStream_t s) {
  if (mode <= 2 || mode == 7 || mode == 9)
    return gemv_split_k<BF16, MT, R, SILU>(qw, sc, x, y, ws, arrivals, M, N, K, ldx, ldy, gc,
                                           warps, splits, depth, mode, pdl, s);
  if (mode == 10) {  // `splits` is CTAs per SM
    if constexpr (R == 2 && MT <= 2)
      return launch_persist<BF16, MT, R, SILU>(qw, sc, x, y, M, N, K, ldx, ldy, gc, warps, splits,
                                               pdl, s);
    else return -1;
  }
  if constexpr (SILU) return -1;
  else switch (mode) {
    case 3:  // stream-K: `splits` is CTAs per SM
      return depth >= 4 ? launch_streamk<BF16, MT, R, 4>(qw, sc, x, y, ws, arrivals, M, N, K, ldx,
                                                         ldy, gc, warps, splits, pdl, s)
                        : launch_streamk<BF16, MT, R, 2>(qw, sc, x, y, ws, arrivals, M, N, K, ldx,
                                                         ldy, gc, warps, splits, pdl, s);
    case 4:
      return launch_bulk<BF16, MT, R, false>(qw, sc, x, y, ws, arrivals, M, N, K, ldx, ldy, gc,
                                             warps, splits, depth, pdl, s);
    case 5:
    case 6:
    case 8:
      if constexpr (MT == 1 && BF16) {
        if (mode == 6) return launch_gemv<BF16, MT, R, 2, false, true, true>(
            qw, sc, x, y, ws, arrivals, M, N, K, ldx, ldy, gc, warps, splits, pdl, s);
        if (mode == 8) return launch_gemv<BF16, MT, R, 2, false, true, true, false, 1>(
            qw, sc, x, y, ws, arrivals, M, N, K, ldx, ldy, gc, warps, splits, pdl, s);
        return launch_bulk<BF16, MT, R, true>(qw, sc, x, y, ws, arrivals, M, N, K, ldx, ldy, gc,
                                              warps, splits, depth, pdl, s);
      }
      return -1;
    default: return -1;
  }
}

template <bool BF16, int R, bool SILU>
int gemv_by_rows(const void* qw, const void* sc, const void* x, void* y, void* ws, void* arrivals,
                 int M, int N, int K, int ldx, int ldy, int gc, int warps, int splits, int depth,
                 int mode, bool pdl, cudaStream_t s) {
#define TM_ROWS(MT)                                                                            \
  gemv_by_mode<BF16, MT, R, SILU>(qw, sc, x, y, ws, arrivals, M, N, K, ldx, ldy, gc, warps,      \
                                  splits, depth, mode, pdl, s)
  if (M <= 8) return TM_ROWS(1);
  if (M <= 16) return TM_ROWS(2);
  if constexpr (R == 4) return -1;  // 4 tiles x 4+ token groups spill: callers use fewer tiles
  else {
    if (M <= 32) return TM_ROWS(4);
    if constexpr (R == 1) return TM_ROWS(8);
    else return -1;  // 8 token groups x 2 tiles spill registers: callers use one tile per CTA
  }
#undef TM_ROWS
}

// X8 (bf16 output, 2 row tiles a CTA, groups of 128, M <= 16): mode 9 over gridDim.y splits,
// or mode 10 with `splits` CTAs an SM.
template <int MT, bool SILU>
int gemv_x8(const void* qw, const void* sc, const void* x8, const float* xs, void* y, void* ws,
            void* arrivals, int M, int N, int K, int ldy, int warps, int splits, int mode,
            bool pdl, cudaStream_t s) {
  if (mode == 9)
    return launch_gemv<true, MT, 2, 3, false, true, false, SILU, 2, true>(
        qw, sc, x8, y, ws, arrivals, M, N, K, K, ldy, 2, warps, splits, pdl, s, xs);
  if (mode == 10)
    return launch_persist<true, MT, 2, SILU, true>(qw, sc, x8, y, M, N, K, K, ldy, 2, warps, splits,
                                                   pdl, s, xs);
  return -1;
}

}  // namespace

extern "C" {

// y[M, N] = x[M, K] @ W^T. Returns a cudaError_t (0: launched; -1: bad arguments).
// rows_per_cta 1, 2 or 4 (N a multiple of 16 * rows_per_cta; more tiles per CTA share each x
// operand load); warps 1..8; splits >= 1 (> 1 needs ws and arrivals, zeroed, sized
// splits * N / 16 * MT * 128 floats (modes 0-2, 6-9; modes 3-5: N / 16 * MT * 128) and N / 16
// ints; mode 10 neither); mode 0-10 (gemv_by_mode); M > 16 needs rows_per_cta <= 2, M > 32
// rows_per_cta 1. silu_mul: W is a fused gate|up projection whose 16-row tiles alternate gate /
// up (N = 2F), and y [M, F] (row stride ldy) = silu(gate) * up; needs rows_per_cta 2 or 4 and
// mode 0-2, 7, 9 or 10. pdl: launched with programmatic dependent launch (sm_90), overlapping
// the kernel before's tail.
int tm_w4_gemv(const void* qw, const void* sc, const void* x, void* y, void* ws, void* arrivals,
               int M, int N, int K, int ldx, int ldy, int gc, int bf16, int rows_per_cta,
               int warps, int splits, int depth, int mode, int silu_mul, int pdl, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (M < 1 || M > 64 || K % 64 || gc < 1 || warps < 1 || warps > 8 || splits < 1) return -1;
  if ((rows_per_cta != 1 && rows_per_cta != 2 && rows_per_cta != 4) || N % (16 * rows_per_cta))
    return -1;
  if (silu_mul &&
      (rows_per_cta == 1 || mode < 0 || (mode > 2 && mode != 7 && mode != 9 && mode != 10)))
    return -1;
#define TM_CALL(B, R)                                                                           \
  (silu_mul ? gemv_by_rows<B, R, true>(qw, sc, x, y, ws, arrivals, M, N, K, ldx, ldy, gc, warps, \
                                       splits, depth, mode, pdl, s)                             \
            : gemv_by_rows<B, R, false>(qw, sc, x, y, ws, arrivals, M, N, K, ldx, ldy, gc,       \
                                        warps, splits, depth, mode, pdl, s))
  if (rows_per_cta == 4) return bf16 ? TM_CALL(true, 4) : TM_CALL(false, 4);
  if (rows_per_cta == 2) return bf16 ? TM_CALL(true, 2) : TM_CALL(false, 2);
#undef TM_CALL
  return bf16 ? gemv_by_rows<true, 1, false>(qw, sc, x, y, ws, arrivals, M, N, K, ldx, ldy, gc,
                                             warps, splits, depth, mode, pdl, s)
              : gemv_by_rows<false, 1, false>(qw, sc, x, y, ws, arrivals, M, N, K, ldx, ldy, gc,
                                              warps, splits, depth, mode, pdl, s);
}

// y[M, N] (bf16) = x @ W^T with x as int8 codes x8 [M, K] in `reference.int4_mma_x8`'s order and
// fp32 scales xs [M, K / 128] (x = codes * scale per token and group of 128): the products on
// int8 tensor cores. Groups of 128 (gc 2), 2 row tiles a CTA, M <= 16, mode 9 (`splits` over
// gridDim.y, ws and arrivals as tm_w4_gemv's) or 10 (`splits` CTAs an SM); silu_mul as there.
int tm_w4_gemv_x8(const void* qw, const void* sc, const void* x8, const void* xs, void* y,
                  void* ws, void* arrivals, int M, int N, int K, int ldy, int warps, int splits,
                  int mode, int silu_mul, int pdl, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (M < 1 || M > 16 || K % 128 || N % 32 || warps < 1 || warps > 8 || splits < 1) return -1;
  if (mode != 9 && mode != 10) return -1;
  const float* f = static_cast<const float*>(xs);
#define TM_X8(MT)                                                                                (silu_mul ? gemv_x8<MT, true>(qw, sc, x8, f, y, ws, arrivals, M, N, K, ldy, warps, splits, mode,                                 pdl, s)                                                                    : gemv_x8<MT, false>(qw, sc, x8, f, y, ws, arrivals, M, N, K, ldy, warps, splits,                                   mode, pdl, s))
  return M <= 8 ? TM_X8(1) : TM_X8(2);
#undef TM_X8
}

// out[N, K] (x's dtype) = (q - 8) * s from the int4-mma layout.
int tm_w4_dequant(const void* qw, const void* sc, void* out, int N, int K, int gc, int bf16,
                  void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (N % 16 || K % 64 || gc < 1) return -1;
  const unsigned blocks = (unsigned)(((size_t)(N / 16) * (K / 64) * 32 + 255) / 256);
  const uint4* q = static_cast<const uint4*>(qw);
  const __half* h = static_cast<const __half*>(sc);
  if (bf16)
    w4_dequant_kernel<__nv_bfloat16, false>
        <<<blocks, 256, 0, s>>>(q, h, nullptr, static_cast<__nv_bfloat16*>(out), N, K, gc, nullptr);
  else
    w4_dequant_kernel<__half, false>
        <<<blocks, 256, 0, s>>>(q, h, nullptr, static_cast<__half*>(out), N, K, gc, nullptr);
  return (int)cudaGetLastError();
}

int tm_w4_dequant_e4m3(const void* qw, const void* sc, const void* cs, void* out, int N, int K,
                       int gc, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (N % 16 || K % 64 || gc < 1) return -1;
  const unsigned blocks = (unsigned)(((size_t)(N / 16) * (K / 64) * 32 + 255) / 256);
  w4_dequant_kernel<__nv_fp8_e4m3, true><<<blocks, 256, 0, s>>>(
      static_cast<const uint4*>(qw), static_cast<const __half*>(sc),
      static_cast<const float*>(cs), static_cast<__nv_fp8_e4m3*>(out), N, K, gc, nullptr);
  return (int)cudaGetLastError();
}

// out[N, K] e4m3 = q - 8 from the int4-mma layout: the codes alone, in row-major order; with
// `bs`, also the group scales sc (groups of gc chunks, gc even) as fp32 bs[K / 128][N].
int tm_w4_codes_e4m3(const void* qw, const void* sc, void* bs, void* out, int N, int K, int gc,
                     void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (N % 16 || K % 64 || (bs != nullptr && (gc < 2 || gc % 2 || K % 128))) return -1;
  const unsigned blocks = (unsigned)(((size_t)(N / 16) * (K / 64) * 32 + 255) / 256);
  w4_dequant_kernel<__nv_fp8_e4m3, false, true><<<blocks, 256, 0, s>>>(
      static_cast<const uint4*>(qw), static_cast<const __half*>(sc), nullptr,
      static_cast<__nv_fp8_e4m3*>(out), N, K, bs != nullptr ? gc : 1, static_cast<float*>(bs));
  return (int)cudaGetLastError();
}

}  // extern "C"
