/* The few-row products of engine/model/gguf_decode.py: y = x @ W^T for bfloat16 rows x
 * and a GGUF matrix W in Q4_1 or Q8_0 blocks, giving every output the bits of oneDNN's
 * packed bfloat16 product of the same rows with W's bfloat16 dequantization.
 *
 * Why those bits: oneDNN's kernel (brg_matmul, avx512_core_bf16) multiplies bfloat16
 * pairs with VDPBF16PS into one float32 accumulator per output, the pairs (k, k + 1)
 * in order, restarting from zero every `chunk` inputs and adding each chunk's sum to
 * the total, which is rounded to bfloat16 once. This kernel does exactly that, with
 * `chunk` probed against oneDNN by the Python side. Each weight is dequantized as the
 * dense checkpoint was, in float32 without fused multiply-adds (-ffp-contract=off):
 * Q4_1 `d * q + m`, Q8_0 `d * q`; then rounded to bfloat16, to nearest even.
 *
 * Layout (built by gguf_decode.pack): per block of 16 output columns, per group of 32
 * inputs: d of the 16 columns (float16, 32 bytes), for Q4_1 m (32 bytes), then the
 * codes of 16 input pairs. Q4_1: 16 bytes a pair; byte j holds column j / 2's code for
 * input 2p + j % 2 (low nibble) and column 8 + j / 2's (high nibble). Q8_0: 32 bytes a
 * pair; byte j holds column j / 2 (j < 16) or 8 + (j - 16) / 2, input 2p + j % 2. Either
 * way two float vectors of 8 columns x 2 inputs convert (VCVTNE2PS2BF16) into one
 * vector whose lane i holds column i's weights for inputs (2p, 2p + 1): VDPBF16PS's
 * operand.
 *
 * Columns are split between OpenMP threads (torch's runtime: the library is loaded
 * after torch, whose libgomp.so.1 it then shares); a row's bits never depend on the
 * number of rows or threads. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define GROUP 32
#define MAX_PASS 8
enum { Q4_1 = 0, Q8_0 = 1 };

static inline int group_bytes(int format) { return format == Q4_1 ? 320 : 544; }

static inline void expand(const uint8_t* halves, __m512* first8, __m512* last8) {
  __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)halves));
  const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  *first8 = _mm512_permutexvar_ps(lo, v);
  *last8 = _mm512_permutexvar_ps(hi, v);
}

static inline __m512i q4_pair(const uint8_t* codes, __m512 d0, __m512 m0, __m512 d1, __m512 m1) {
  __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)codes));
  __m512 q0 = _mm512_cvtepi32_ps(_mm512_and_si512(c, _mm512_set1_epi32(15)));
  __m512 q1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4));
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_add_ps(_mm512_mul_ps(q1, d1), m1),
                                      _mm512_add_ps(_mm512_mul_ps(q0, d0), m0));
}

static inline __m512i q8_pair(const uint8_t* codes, __m512 d0, __m512 d1) {
  __m512 q0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)codes)));
  __m512 q1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(codes + 16))));
  return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(q1, d1), _mm512_mul_ps(q0, d0));
}

/* The 16 pairs of one group, in order, handed to `use` as weight vectors. */
#define FOR_PAIRS(format, g, w, body)                                          \
  do {                                                                         \
    __m512 d0, d1, m0, m1;                                                     \
    expand(g, &d0, &d1);                                                       \
    if (format == Q4_1) expand(g + 32, &m0, &m1);                              \
    for (int p = 0; p < GROUP / 2; p++) {                                      \
      __m512i w = format == Q4_1 ? q4_pair(g + 64 + 16 * p, d0, m0, d1, m1)    \
                                 : q8_pair(g + 32 + 32 * p, d0, d1);           \
      body                                                                     \
    }                                                                          \
  } while (0)

static inline __attribute__((always_inline)) void rows(const int format, const int R, const uint8_t* block,
                                                        int K, int chunk, const uint16_t* x, uint16_t* y,
                                                        int ldy) {
  __m512 acc[MAX_PASS], total[MAX_PASS];
  for (int r = 0; r < R; r++) total[r] = acc[r] = _mm512_setzero_ps();
  for (int k0 = 0; k0 < K; k0 += GROUP) {
    const uint8_t* g = block + (size_t)(k0 / GROUP) * group_bytes(format);
    FOR_PAIRS(format, g, w, {
      for (int r = 0; r < R; r++) {
        uint32_t pair;
        memcpy(&pair, x + (size_t)r * K + k0 + 2 * p, 4);
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)pair), (__m512bh)w);
      }
    });
    int end = k0 + GROUP;
    if (end % chunk == 0 || end == K) {
      for (int r = 0; r < R; r++) {
        total[r] = end <= chunk ? acc[r] : _mm512_add_ps(total[r], acc[r]);
        acc[r] = _mm512_setzero_ps();
      }
    }
  }
  for (int r = 0; r < R; r++)
    _mm256_storeu_si256((__m256i*)(y + (size_t)r * ldy), (__m256i)_mm512_cvtneps_pbh(total[r]));
}

typedef void (*rows_kernel)(const uint8_t*, int, int, const uint16_t*, uint16_t*, int);
#define KERNEL(F, R) \
  static void F##_rows##R(const uint8_t* b, int K, int c, const uint16_t* x, uint16_t* y, int ldy) { \
    rows(F, R, b, K, c, x, y, ldy);                                                                   \
  }
#define KERNELS(F) KERNEL(F, 1) KERNEL(F, 2) KERNEL(F, 3) KERNEL(F, 4) KERNEL(F, 5) KERNEL(F, 6) \
  KERNEL(F, 7) KERNEL(F, 8)                                                                        \
  static const rows_kernel F##_KERNELS[MAX_PASS + 1] = {0, F##_rows1, F##_rows2, F##_rows3,       \
                                                        F##_rows4, F##_rows5, F##_rows6,          \
                                                        F##_rows7, F##_rows8};
KERNELS(Q4_1)
KERNELS(Q8_0)

/* y[M, N] = x[M, K] @ W^T. N a multiple of 16, K of GROUP, chunk of GROUP. */
void gguf_decode_product(int format, const uint8_t* packed, int N, int K, int chunk, const uint16_t* x,
                         int M, uint16_t* y, int threads) {
  const rows_kernel* kernels = format == Q4_1 ? Q4_1_KERNELS : Q8_0_KERNELS;
  const size_t block_bytes = (size_t)(K / GROUP) * group_bytes(format);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int j = 0; j < N / 16; j++) {
    for (int r0 = 0; r0 < M; r0 += MAX_PASS) {
      int n = M - r0 < MAX_PASS ? M - r0 : MAX_PASS;
      kernels[n](packed + (size_t)j * block_bytes, K, chunk, x + (size_t)r0 * K, y + (size_t)r0 * N + 16 * j, N);
    }
  }
}

/* How many weights of W's bfloat16 dequantization differ from `dense` ([N, K], row-major,
 * bfloat16): the check at load that the blocks are the dense weights. */
long gguf_decode_mismatches(int format, const uint8_t* packed, int N, int K, const uint16_t* dense) {
  const size_t block_bytes = (size_t)(K / GROUP) * group_bytes(format);
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(K * 2));
  long differ = 0;
  for (int j = 0; j < N / 16; j++) {
    for (int k0 = 0; k0 < K; k0 += GROUP) {
      const uint8_t* g = packed + (size_t)j * block_bytes + (size_t)(k0 / GROUP) * group_bytes(format);
      FOR_PAIRS(format, g, w, {
        const uint16_t* base = dense + (size_t)(16 * j) * K + k0 + 2 * p;
        __m512i expected = _mm512_i32gather_epi32(rows, (const void*)base, 1);
        differ += __builtin_popcount(_mm512_cmpneq_epi16_mask(w, expected));
      });
    }
  }
  return differ;
}
