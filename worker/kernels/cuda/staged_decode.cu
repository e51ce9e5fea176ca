// Decode attention over staged KV pages (worker/models/cache.py StagedAttentionCache) on
// mma.sync tensor cores, with every operand built in registers: codes are decoded straight into
// mma fragments, so a tile never passes through shared memory (the Triton kernel's chain per
// tile is load -> decode -> shared-memory store -> barrier -> MMA).
//
// Shapes: head dim 256, 4-bit keys, 3- or 4-bit values, an fp8 e4m3 recent pool, pages of a
// multiple of 16 tokens, at most 8 query heads per KV head (staged_decode.py checks these and
// sends anything else to the Triton kernel). Grid (sequence, KV head, split) as the Triton
// kernel's flash-decoding; a CTA of W warps takes its split's 16-token tiles in turn (warp w:
// tiles w, w + W, ...), each warp with its own online softmax, merged in shared memory at the
// end. A 16-token tile lies in one page, so it is all codes or all FP8.
//
// Per tile and warp (lane = 4 g + t), with m16n8k16 products (A 16 x 16, B 16 x 8, fp32 C):
// - Scores, transposed: S^T [16 tokens x 8 heads] = K [16 x 256] Q^T. A is the keys: lane
//   (g, t) holds tokens g and g + 8. The sum over coordinates is order-free, so the products'
//   k order is permuted: k-step s's positions (2t, 2t+1, 2t+8, 2t+9) are coordinates
//   64 t + 4 s + (0..3). Lane t then reads one contiguous quarter of each key row (32 bytes of
//   4-bit codes, 64 of fp8), and its query operand B is the same quarter of its head g's query
//   (32 registers, loaded once).
// - Softmax in fp32 on the C fragment (tokens g, g + 8; heads 2t, 2t + 1), base 2; the
//   per-vector norms scale the scores (keys) and the probabilities (values); fp8 tokens use the
//   pool's scales instead.
// - Output, transposed: O^T [256 x 8 heads] += V^T [256 x 16 tokens] P^T. P^T's B fragment is
//   the scores' C fragment in fp16 transposed by `movmatrix` (two 8 x 8 blocks). A is the
//   values: m-tile i's rows g and g + 8 are coordinates 32 g + 2 i and 32 g + 2 i + 1, so lane
//   (g, t) reads one contiguous 32-coordinate slice (12 bytes at 3 bits) of tokens 2t, 2t+1,
//   2t+8, 2t+9, and pairs two tokens' values of one coordinate with a byte permute.
// Codes decode by byte permutes (as the Triton kernel's `_decode_codes_prmt`): the codebook's
// 8 magnitudes as fp16 byte tables, the folded codes' low bits select bytes, their top bits
// become the sign; 3-bit codes are spread to nibbles first.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

namespace {

constexpr int D = 256;          // head dim
constexpr int K_RANGE = D / 4;  // key coordinates per lane and token
constexpr int V_RANGE = D / 8;  // value coordinates per lane and token
constexpr int HEADS = 8;        // query heads per KV head, at most (the B operand's n)
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

struct Params {
  const void* q;
  const uint8_t* k_cache;  // fp8 e4m3 [recent blocks, block_size, Hkv, D]
  const uint8_t* v_cache;
  const uint8_t* k_codes;  // [compressed blocks, block_size, Hkv, D * kb / 8]
  const __half* k_norms;   // [compressed blocks, block_size, Hkv]
  const uint8_t* v_codes;
  const __half* v_norms;
  const float* k_centroids;  // [2^kb], ascending
  const float* v_centroids;
  const int* context_lens;  // [B]
  const int* block_tables;  // [B, stride_bt]
  float* part_out;          // [B, Hq, splits, D] (splits > 1)
  float* part_lse;          // [B, Hq, splits]
  void* out;                // [B, Hq, D], q's dtype
  float scale_log2;         // softmax scale * log2(e)
  float k_scale, v_scale;   // the recent pool's
  int num_recent, stride_qb, stride_qh, stride_bt, num_splits, partition, hq, hkv, block_size;
};

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(s));
  return d;
}

// a ^ (b & c)
__device__ __forceinline__ uint32_t xor_and(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0x78;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

__device__ __forceinline__ void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                    uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t transpose8x8(uint32_t a) {
  uint32_t d;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(a));
  return d;
}

// two fp8 e4m3 (the low and high byte of v) -> half2 (low, high)
__device__ __forceinline__ uint32_t e4m3x2(uint32_t v) {
  uint32_t d;
  asm("{\n.reg .b16 x;\ncvt.u16.u32 x, %1;\ncvt.rn.f16x2.e4m3x2 %0, x;\n}\n" : "=r"(d) : "r"(v));
  return d;
}

__device__ __forceinline__ uint32_t half2_bits(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// The 8 magnitudes of a folded codebook's lower half (c[i % 2^(b-1)]) as fp16 byte tables:
// lo bytes of c[0..3], of c[4..7], hi bytes of c[0..3], of c[4..7].
struct Tables {
  uint32_t lo0, lo1, hi0, hi1;
};
__device__ __forceinline__ Tables tables_of(const float* centroids, int bits) {
  const int h = 1 << (bits - 1);
  uint32_t b[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) b[i] = __half_as_ushort(__float2half_rn(centroids[i % h]));
  Tables t;
  t.lo0 = (b[0] & 0xff) | (b[1] & 0xff) << 8 | (b[2] & 0xff) << 16 | (b[3] & 0xff) << 24;
  t.lo1 = (b[4] & 0xff) | (b[5] & 0xff) << 8 | (b[6] & 0xff) << 16 | (b[7] & 0xff) << 24;
  t.hi0 = (b[0] >> 8) | (b[1] >> 8) << 8 | (b[2] >> 8) << 16 | (b[3] >> 8) << 24;
  t.hi1 = (b[4] >> 8) | (b[5] >> 8) << 8 | (b[6] >> 8) << 16 | (b[7] >> 8) << 24;
  return t;
}

// 8 folded codes, one a nibble (coordinate i at bits 4i..4i+3: low 3 bits the magnitude's
// index, bit 3 the sign) -> 4 half2: (c0, c1), (c2, c3), (c4, c5), (c6, c7).
__device__ __forceinline__ void decode8(uint32_t w, const Tables& tb, uint32_t (&p)[4]) {
  const uint32_t s03 = w & 0x7777u, s47 = (w >> 16) & 0x7777u;
  const uint32_t l03 = prmt(tb.lo0, tb.lo1, s03), l47 = prmt(tb.lo0, tb.lo1, s47);
  uint32_t h03 = prmt(tb.hi0, tb.hi1, s03), h47 = prmt(tb.hi0, tb.hi1, s47);
  const uint32_t w4 = w << 4;
  // sign-replicate mode: 0xff where a nibble's bit 3 is set
  h03 = xor_and(h03, prmt(w4, w, 0xD9C8u), 0x80808080u);
  h47 = xor_and(h47, prmt(w4, w, 0xFBEAu), 0x80808080u);
  p[0] = prmt(l03, h03, 0x5140u);
  p[1] = prmt(l03, h03, 0x7362u);
  p[2] = prmt(l47, h47, 0x5140u);
  p[3] = prmt(l47, h47, 0x7362u);
}

// 8 folded 3-bit codes (bits 3i..3i+2) -> one a nibble, bit 3 a copy of the code's top bit
__device__ __forceinline__ uint32_t nibbles3(uint32_t x) {
  x = (x & 0xfffu) | ((x << 4) & 0xfff0000u);
  x = (x & 0x3f003fu) | ((x << 2) & 0x3f003f00u);
  x = (x & 0x07070707u) | ((x << 1) & 0x70707070u);
  return x | ((x << 1) & 0x88888888u);
}

// A lane's codes of one 16-token tile: keys of tokens g, g + 8 (2 x 32 bytes) with the four
// norms it scales by, and values of tokens 2t, 2t+1, 2t+8, 2t+9 (VB words each: 32
// coordinates of VB bits).
struct KeyCodes {
  uint4 k[2][2];
  float kn[2], vn[2];
};
template <int VB>
struct ValueCodes {
  uint32_t v[4][VB];
};

__device__ __forceinline__ int code_row_base(const Params& p, int page, int off) {
  return (page - p.num_recent) * p.block_size + off;
}

__device__ __forceinline__ void load_keys(const Params& p, int base, int hkv, int g, int t,
                                          KeyCodes& c) {
  constexpr int KROW = D * 4 / 8;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = (base + g + 8 * r) * p.hkv + hkv;
    const uint4* src = reinterpret_cast<const uint4*>(p.k_codes + (size_t)row * KROW + 32 * t);
    c.k[r][0] = __ldg(src);
    c.k[r][1] = __ldg(src + 1);
    c.kn[r] = __half2float(p.k_norms[row]);
    c.vn[r] = __half2float(p.v_norms[row]);
  }
}

template <int VB>
__device__ __forceinline__ void load_values(const Params& p, int base, int hkv, int g, int t,
                                            ValueCodes<VB>& c) {
  constexpr int VROW = D * VB / 8;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int tok = 2 * t + (j & 1) + 8 * (j >> 1);
    const int row = (base + tok) * p.hkv + hkv;
    const uint32_t* src =
        reinterpret_cast<const uint32_t*>(p.v_codes + (size_t)row * VROW + 4 * VB * g);
    if constexpr (VB == 4) {
      const uint4 w = __ldg(reinterpret_cast<const uint4*>(src));
      c.v[j][0] = w.x, c.v[j][1] = w.y, c.v[j][2] = w.z, c.v[j][3] = w.w;
    } else {
#pragma unroll
      for (int e = 0; e < VB; ++e) c.v[j][e] = __ldg(src + e);
    }
  }
}

// The code group (8 coordinates, as nibbles) e = 0..3 of a value slice of VB words
template <int VB>
__device__ __forceinline__ uint32_t value_group(const uint32_t (&v)[VB], int e) {
  if constexpr (VB == 4) {
    return v[e];
  } else {
    const uint32_t g = e == 0   ? v[0]
                       : e == 1 ? (v[0] >> 24) | (v[1] << 8)
                       : e == 2 ? (v[1] >> 16) | (v[2] << 16)
                                : v[2] >> 8;
    return nibbles3(g);
  }
}

// The online softmax of one tile and its P^T operands: scores s (C fragment of S^T, raw dot
// products) times kn (per token row g, g + 8) in base 2; rows past `valid` masked.
struct Softmax {
  float m[2], l[2];
};
__device__ __forceinline__ void softmax_tile(float (&s)[4], const float (&kn)[2],
                                             const float (&vn)[2], const bool (&valid)[2],
                                             float scale_log2, Softmax& sm, float (&o)[D / 16][4],
                                             uint32_t& b0, uint32_t& b1) {
  float x[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) x[i] = valid[i >> 1] ? s[i] * kn[i >> 1] * scale_log2 : -INFINITY;
  float mx[2] = {fmaxf(x[0], x[2]), fmaxf(x[1], x[3])};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int d = 4; d < 32; d <<= 1) mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], d));
  }
  float alpha[2], mn[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    mn[h] = fmaxf(sm.m[h], mx[h]);  // finite: a tile holds at least one valid token
    alpha[h] = exp2f(sm.m[h] - mn[h]);
    sm.m[h] = mn[h];
  }
  float pr[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) pr[i] = exp2f(x[i] - mn[i & 1]);
#pragma unroll
  for (int h = 0; h < 2; ++h) sm.l[h] = sm.l[h] * alpha[h] + pr[h] + pr[h + 2];
#pragma unroll
  for (int i = 0; i < D / 16; ++i) {
    o[i][0] *= alpha[0], o[i][1] *= alpha[1], o[i][2] *= alpha[0], o[i][3] *= alpha[1];
  }
  // masked rows: p is 0 but a norm past the context may be anything
  const float f0 = valid[0] ? vn[0] : 0.f, f1 = valid[1] ? vn[1] : 0.f;
  b0 = transpose8x8(half2_bits(pr[0] * f0, pr[1] * f0));
  b1 = transpose8x8(half2_bits(pr[2] * f1, pr[3] * f1));
}

// S^T of a code tile
__device__ __forceinline__ void code_scores(const KeyCodes& c, const uint32_t (&qf)[D / 8],
                                            const Tables& kt, float (&s)[4]) {
  float s2[4] = {0.f, 0.f, 0.f, 0.f};
  const uint32_t* k0 = reinterpret_cast<const uint32_t*>(&c.k[0][0]);
  const uint32_t* k1 = reinterpret_cast<const uint32_t*>(&c.k[1][0]);
#pragma unroll
  for (int w = 0; w < 8; ++w) {  // word w: 8 coordinates, k-steps 2w and 2w + 1
    uint32_t a[4], b[4];
    decode8(k0[w], kt, a);
    decode8(k1[w], kt, b);
    mma(s, a[0], b[0], a[1], b[1], qf[4 * w], qf[4 * w + 1]);
    mma(s2, a[2], b[2], a[3], b[3], qf[4 * w + 2], qf[4 * w + 3]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) s[i] += s2[i];
}

// O^T += V^T P^T over a code tile
template <int VB>
__device__ __forceinline__ void code_values(const ValueCodes<VB>& c, const Tables& vt, uint32_t b0,
                                            uint32_t b1, float (&o)[D / 16][4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) {  // coordinates 8e..8e+7 of the lane's slice: m-tiles 4e..4e+3
    uint32_t x[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) decode8(value_group<VB>(c.v[j], e), vt, x[j]);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      mma(o[4 * e + i], prmt(x[0][i], x[1][i], 0x5410u), prmt(x[0][i], x[1][i], 0x7632u),
          prmt(x[2][i], x[3][i], 0x5410u), prmt(x[2][i], x[3][i], 0x7632u), b0, b1);
    }
  }
}

// One FP8 tile (a sequence's anchor or window page): loads, scores, softmax and values
__device__ __forceinline__ void fp8_tile(const Params& p, int page, int off, int hkv, int g,
                                         int t, const bool (&valid)[2], const int tile_valid,
                                         const uint32_t (&qf)[D / 8], Softmax& sm,
                                         float (&o)[D / 16][4]) {
  const int base = page * p.block_size + off;
  float s[4] = {0.f, 0.f, 0.f, 0.f}, s2[4] = {0.f, 0.f, 0.f, 0.f};
  const uint4* k0 = reinterpret_cast<const uint4*>(p.k_cache + ((size_t)(base + g) * p.hkv + hkv) * D + 64 * t);  // fmt: skip
  const uint4* k1 = reinterpret_cast<const uint4*>(p.k_cache + ((size_t)(base + g + 8) * p.hkv + hkv) * D + 64 * t);  // fmt: skip
#pragma unroll
  for (int c = 0; c < 4; ++c) {  // 16 bytes: 16 coordinates, k-steps 4c..4c+3
    const uint4 a = __ldg(k0 + c), b = __ldg(k1 + c);
    const uint32_t aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int st = 4 * c + e;
      mma(e & 1 ? s2 : s, e4m3x2(aw[e]), e4m3x2(bw[e]), e4m3x2(aw[e] >> 16), e4m3x2(bw[e] >> 16),
          qf[2 * st], qf[2 * st + 1]);
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) s[i] += s2[i];
  const float kn[2] = {p.k_scale, p.k_scale}, vn[2] = {p.v_scale, p.v_scale};
  uint32_t b0, b1;
  softmax_tile(s, kn, vn, valid, p.scale_log2, sm, o, b0, b1);
  // values: 32 bytes of tokens 2t, 2t+1, 2t+8, 2t+9 (zero past the context: fp8 may be NaN)
  uint32_t x[4][8];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int tok = 2 * t + (j & 1) + 8 * (j >> 1);
    const uint4* src = reinterpret_cast<const uint4*>(p.v_cache + ((size_t)(base + tok) * p.hkv + hkv) * D + 32 * g);  // fmt: skip
    uint4 u0 = make_uint4(0, 0, 0, 0), u1 = u0;
    if (tok < tile_valid) u0 = __ldg(src), u1 = __ldg(src + 1);
    const uint32_t w[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
#pragma unroll
    for (int e = 0; e < 8; ++e) x[j][e] = w[e];
  }
#pragma unroll
  for (int i = 0; i < D / 16; ++i) {  // m-tile i: coordinates 32 g + 2 i, + 1 = word i / 2
    const int e = i >> 1, sh = (i & 1) * 16;
    const uint32_t v0 = e4m3x2(x[0][e] >> sh), v1 = e4m3x2(x[1][e] >> sh);
    const uint32_t v2 = e4m3x2(x[2][e] >> sh), v3 = e4m3x2(x[3][e] >> sh);
    mma(o[i], prmt(v0, v1, 0x5410u), prmt(v0, v1, 0x7632u), prmt(v2, v3, 0x5410u),
        prmt(v2, v3, 0x7632u), b0, b1);
  }
}

template <int VB, bool BF16, int W, int MINB, bool PREV>
__global__ void __launch_bounds__(32 * W, MINB) staged_decode(const Params p) {
  extern __shared__ float smem[];  // [W][HEADS][D] outputs, then [W][HEADS] m, [W][HEADS] l
  const int b = blockIdx.x, hkv = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int group = p.hq / p.hkv;
  const Tables kt = tables_of(p.k_centroids, 4), vt = tables_of(p.v_centroids, VB);
  pdl_wait();

  const int ctx = p.context_lens[b];
  int per = p.partition;
  if (per <= 0) {
    const int share = (ctx + p.num_splits - 1) / p.num_splits;
    per = max((share + 63) / 64 * 64, 128);
  }
  const int start = split * per, end = min(start + per, ctx);

  // the query operand: head g's coordinates 64 t .. 64 t + 63, as 32 half2 (0 past the group)
  uint32_t qf[D / 8];
  {
    const int head = hkv * group + g;
    const bool real = g < group;
    const char* qb = static_cast<const char*>(p.q) +
                     2 * ((size_t)b * p.stride_qb + (size_t)head * p.stride_qh + K_RANGE * t);
#pragma unroll
    for (int c = 0; c < K_RANGE / 8; ++c) {
      uint4 u = make_uint4(0, 0, 0, 0);
      if (real) u = *reinterpret_cast<const uint4*>(qb + 16 * c);
      const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if constexpr (BF16) {
          const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[e]));
          qf[4 * c + e] = half2_bits(f.x, f.y);
        } else {
          qf[4 * c + e] = w[e];
        }
      }
    }
  }

  Softmax sm = {{-INFINITY, -INFINITY}, {0.f, 0.f}};
  float o[D / 16][4];
#pragma unroll
  for (int i = 0; i < D / 16; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;

  // The next tile's page and key codes load while this one computes; its value codes load
  // before its scores (PREV: with the keys, a tile ahead, at the cost of registers).
  const int* table = p.block_tables + (size_t)b * p.stride_bt;
  int t0 = start + 16 * warp;
  int page = t0 < end ? table[t0 / p.block_size] : 0;
  KeyCodes keys;
  ValueCodes<VB> values;
  if (t0 < end && page >= p.num_recent) {
    load_keys(p, code_row_base(p, page, t0 % p.block_size), hkv, g, t, keys);
    if (PREV) load_values<VB>(p, code_row_base(p, page, t0 % p.block_size), hkv, g, t, values);
  }
  while (t0 < end) {
    const int tn = t0 + 16 * W;
    const int next_page = tn < end ? table[tn / p.block_size] : 0;
    const bool next_codes = tn < end && next_page >= p.num_recent;
    const int next_base = code_row_base(p, next_page, tn % p.block_size);
    KeyCodes next_keys;
    ValueCodes<VB> next_values;
    if (next_codes) {
      load_keys(p, next_base, hkv, g, t, next_keys);
      if (PREV) load_values<VB>(p, next_base, hkv, g, t, next_values);
    }
    const int tile_valid = end - t0;  // tokens of the tile inside the split
    const bool valid[2] = {g < tile_valid, g + 8 < tile_valid};
    if (page >= p.num_recent) {
      if (!PREV) load_values<VB>(p, code_row_base(p, page, t0 % p.block_size), hkv, g, t, values);
      float s[4] = {0.f, 0.f, 0.f, 0.f};
      code_scores(keys, qf, kt, s);
      uint32_t b0, b1;
      softmax_tile(s, keys.kn, keys.vn, valid, p.scale_log2, sm, o, b0, b1);
      code_values<VB>(values, vt, b0, b1, o);
    } else {
      fp8_tile(p, page, t0 % p.block_size, hkv, g, t, valid, tile_valid, qf, sm, o);
    }
    keys = next_keys;
    if (PREV) values = next_values;
    page = next_page;
    t0 = tn;
  }

  // merge the warps: each writes its m, l (summed over its lanes) and unnormalised O^T
  float* so = smem;
  float* sm_m = smem + W * HEADS * D;
  float* sm_l = sm_m + W * HEADS;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int d = 4; d < 32; d <<= 1) sm.l[h] += __shfl_xor_sync(0xffffffffu, sm.l[h], d);
  }
  if (g == 0) {
    sm_m[warp * HEADS + 2 * t] = sm.m[0], sm_m[warp * HEADS + 2 * t + 1] = sm.m[1];
    sm_l[warp * HEADS + 2 * t] = sm.l[0], sm_l[warp * HEADS + 2 * t + 1] = sm.l[1];
  }
  float* mine = so + warp * HEADS * D;
#pragma unroll
  for (int i = 0; i < D / 16; ++i) {
    const int c = V_RANGE * g + 2 * i;
    mine[(2 * t) * D + c] = o[i][0];
    mine[(2 * t + 1) * D + c] = o[i][1];
    mine[(2 * t) * D + c + 1] = o[i][2];
    mine[(2 * t + 1) * D + c + 1] = o[i][3];
  }
  __syncthreads();
  for (int e = threadIdx.x; e < group * D; e += 32 * W) {
    const int h = e / D, c = e % D;
    float top = -INFINITY;
#pragma unroll
    for (int w = 0; w < W; ++w) top = fmaxf(top, sm_m[w * HEADS + h]);
    float total = 0.f, acc = 0.f;
    if (top > -INFINITY) {
#pragma unroll
      for (int w = 0; w < W; ++w) {
        const float f = exp2f(sm_m[w * HEADS + h] - top);  // 0 for a warp with no tile
        total += f * sm_l[w * HEADS + h];
        acc += f * so[(w * HEADS + h) * D + c];
      }
    }
    const int head = hkv * group + h;
    const size_t bh = (size_t)b * p.hq + head;
    if (p.num_splits == 1) {
      const float r = total > 0.f ? acc / total : 0.f;
      if constexpr (BF16) {
        static_cast<__nv_bfloat16*>(p.out)[bh * D + c] = __float2bfloat16(r);
      } else {
        static_cast<__half*>(p.out)[bh * D + c] = __float2half(r);
      }
    } else {
      const size_t slot = bh * p.num_splits + split;
      if (c == 0) p.part_lse[slot] = total > 0.f ? top * LN2 + logf(total) : -INFINITY;
      if (total > 0.f) p.part_out[slot * D + c] = acc / total;  // an empty split writes its lse only
    }
  }
}

size_t smem_bytes(int warps) { return (size_t)warps * HEADS * (D + 2) * sizeof(float); }

// As int4_mma.cu's launch_kernel, not shared through a header: build.py keys its cache on the
// one source file's bytes, so an included header's change would not rebuild the library.
template <int VB, bool BF16, int W, int MINB, bool PREV>
int launch(const Params& p, int batch, cudaStream_t stream, bool pdl) {
  auto kernel = staged_decode<VB, BF16, W, MINB, PREV>;
  const size_t smem = smem_bytes(W);
  if (smem > 48 * 1024) {
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (err != cudaSuccess) return (int)err;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(batch, p.hkv, p.num_splits);
  config.blockDim = dim3(32 * W);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  const cudaError_t err = cudaLaunchKernelEx(&config, kernel, p);
  return err != cudaSuccess ? (int)err : (int)cudaGetLastError();
}

// The compiled shapes of a CTA (staged_decode.py VARIANTS names them): warps, CTAs an SM the
// registers are held to, values prefetched a tile ahead
template <int VB, bool BF16>
int launch_variant(int variant, const Params& p, int batch, cudaStream_t stream, bool pdl) {
  switch (variant) {
    case 0: return launch<VB, BF16, 4, 2, true>(p, batch, stream, pdl);
    case 1: return launch<VB, BF16, 4, 3, false>(p, batch, stream, pdl);
    case 2: return launch<VB, BF16, 8, 1, true>(p, batch, stream, pdl);
    case 3: return launch<VB, BF16, 4, 2, false>(p, batch, stream, pdl);
    case 4: return launch<VB, BF16, 8, 1, false>(p, batch, stream, pdl);
    default: return -1;
  }
}

}  // namespace

extern "C" {

// Staged decode attention (see the header). Returns a cudaError_t (0: launched; -1: bad
// arguments). q [B, Hq, 256] (bf16 if bf16, else fp16; rows 16-byte aligned), rotated; out
// [B, Hq, 256] in q's dtype, written directly when splits == 1, else part_out / part_lse for the
// merge. variant 0-4 (launch_variant); v_bits 3 or 4; block_size a multiple of 16; Hq / Hkv <= 8.
int tm_staged_decode(const void* q, const void* k_cache, const void* v_cache, const void* k_codes,
                     const void* k_norms, const void* v_codes, const void* v_norms,
                     const void* k_centroids, const void* v_centroids, const void* context_lens,
                     const void* block_tables, void* part_out, void* part_lse, void* out,
                     float scale, float k_scale, float v_scale, int batch, int hq, int hkv,
                     int block_size, int num_recent, int stride_qb, int stride_qh, int stride_bt,
                     int num_splits, int partition, int v_bits, int bf16, int variant, int pdl,
                     void* stream) {
  if (batch < 1 || hkv < 1 || hq % hkv || hq / hkv > HEADS || block_size % 16 ||
      partition % 16 || num_splits < 1 || (v_bits != 3 && v_bits != 4))
    return -1;
  Params p;
  p.q = q;
  p.k_cache = static_cast<const uint8_t*>(k_cache);
  p.v_cache = static_cast<const uint8_t*>(v_cache);
  p.k_codes = static_cast<const uint8_t*>(k_codes);
  p.k_norms = static_cast<const __half*>(k_norms);
  p.v_codes = static_cast<const uint8_t*>(v_codes);
  p.v_norms = static_cast<const __half*>(v_norms);
  p.k_centroids = static_cast<const float*>(k_centroids);
  p.v_centroids = static_cast<const float*>(v_centroids);
  p.context_lens = static_cast<const int*>(context_lens);
  p.block_tables = static_cast<const int*>(block_tables);
  p.part_out = static_cast<float*>(part_out);
  p.part_lse = static_cast<float*>(part_lse);
  p.out = out;
  p.scale_log2 = scale * LOG2E;
  p.k_scale = k_scale;
  p.v_scale = v_scale;
  p.num_recent = num_recent;
  p.stride_qb = stride_qb;
  p.stride_qh = stride_qh;
  p.stride_bt = stride_bt;
  p.num_splits = num_splits;
  p.partition = partition;
  p.hq = hq;
  p.hkv = hkv;
  p.block_size = block_size;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (v_bits == 3)
    return bf16 ? launch_variant<3, true>(variant, p, batch, s, pdl)
                : launch_variant<3, false>(variant, p, batch, s, pdl);
  return bf16 ? launch_variant<4, true>(variant, p, batch, s, pdl)
              : launch_variant<4, false>(variant, p, batch, s, pdl);
}

}  // extern "C"
