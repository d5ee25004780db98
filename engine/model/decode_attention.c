/* The two products of a decode group's attention (engine/model/attention.py,
 * _attend_decodes) read straight from the paged KV pool, with torch's bits.
 *
 * torch's bfloat16 matmul here (oneDNN) gives each output the VDPBF16PS sum of its
 * bfloat16 pairs in order, restarting every `chunk` inputs (scores: the 64 of a head,
 * one chunk; probabilities x values: 1,024 positions on the CPUs measured), the chunks
 * added, the total rounded once. The Python side checks these bits against torch's
 * products at first use and keeps torch's where they differ.
 *
 * Layout: q and probs [kv_heads, n, R, .] (R padded query rows per KV head), the pool's
 * layer [kv_heads * (blocks + 1) rows, block_size, head_dim], `rows` the group's block
 * table as pool rows, head-major ([kv_heads][n][blocks_per_seq], KVStorage.rows).
 * block_size a multiple of 16, head_dim of 32. Sequences (h, i) are split between
 * OpenMP threads. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define MAX_R 8

static inline const uint16_t* position(const uint16_t* layer, const int64_t* table, int p, int bs, int hd) {
  return layer + ((size_t)table[p / bs] * bs + (size_t)(p % bs)) * hd;
}

/* scores[h][i][r][p] = q[h][i][r] . key(h, i, p), for p < blocks_per_seq * block_size. */
void decode_scores(const uint16_t* q, int kv, int n, int R, int hd, const uint16_t* keys, const int64_t* rows,
                   int bps, int bs, uint16_t* scores, int threads) {
  const int L = bps * bs;
  const __m512i offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                             _mm512_set1_epi32(hd * 2));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int s = 0; s < kv * n; s++) {
    const int64_t* table = rows + (size_t)s * bps;
    const uint16_t* qs = q + (size_t)s * R * hd;
    uint16_t* out = scores + (size_t)s * R * L;
    for (int p0 = 0; p0 < L; p0 += 16) {
      const uint16_t* base = position(keys, table, p0, bs, hd);  /* 16 positions in one block */
      __m512 acc[MAX_R];
      for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
      for (int k = 0; k < hd; k += 2) {
        __m512i pairs = _mm512_i32gather_epi32(offsets, (const void*)(base + k), 1);
        for (int r = 0; r < R; r++) {
          uint32_t qp;
          memcpy(&qp, qs + (size_t)r * hd + k, 4);
          acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)qp), (__m512bh)pairs);
        }
      }
      for (int r = 0; r < R; r++)
        _mm256_storeu_si256((__m256i*)(out + (size_t)r * L + p0), (__m256i)_mm512_cvtneps_pbh(acc[r]));
    }
  }
}

/* out[h][i][r][d] = sum_p probs[h][i][r][p] * value(h, i, p)[d], head_dim 64. */
void decode_values(const uint16_t* probs, int kv, int n, int R, int hd, const uint16_t* values,
                   const int64_t* rows, int bps, int bs, int chunk, uint16_t* out, int threads) {
  const int L = bps * bs;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int s = 0; s < kv * n; s++) {
    const int64_t* table = rows + (size_t)s * bps;
    for (int r = 0; r < R; r++) {
      const uint16_t* pr = probs + ((size_t)s * R + r) * L;
      __m512 acc[4], total[4];
      for (int x = 0; x < 4; x++) total[x] = acc[x] = _mm512_setzero_ps();
      for (int p = 0; p < L; p += 2) {
        const uint16_t* v0 = position(values, table, p, bs, hd);
        const uint16_t* v1 = v0 + hd; /* p + 1: the same block (block_size even) */
        __m512i a_lo = _mm512_loadu_si512(v0), a_hi = _mm512_loadu_si512(v0 + 32);
        __m512i b_lo = _mm512_loadu_si512(v1), b_hi = _mm512_loadu_si512(v1 + 32);
        uint32_t pp;
        memcpy(&pp, pr + p, 4);
        const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pp);
        acc[0] = _mm512_dpbf16_ps(acc[0], w, (__m512bh)_mm512_unpacklo_epi16(a_lo, b_lo));
        acc[1] = _mm512_dpbf16_ps(acc[1], w, (__m512bh)_mm512_unpackhi_epi16(a_lo, b_lo));
        acc[2] = _mm512_dpbf16_ps(acc[2], w, (__m512bh)_mm512_unpacklo_epi16(a_hi, b_hi));
        acc[3] = _mm512_dpbf16_ps(acc[3], w, (__m512bh)_mm512_unpackhi_epi16(a_hi, b_hi));
        const int end = p + 2;
        if (end % chunk == 0 || end == L) {
          for (int x = 0; x < 4; x++) {
            total[x] = end <= chunk ? acc[x] : _mm512_add_ps(total[x], acc[x]);
            acc[x] = _mm512_setzero_ps();
          }
        }
      }
      /* lane l of acc[x]: 128-bit lane l / 4, word l % 4 of the unpacked halves */
      float dims[64];
      for (int x = 0; x < 4; x++) {
        float lanes[16];
        _mm512_storeu_ps(lanes, total[x]);
        for (int l = 0; l < 16; l++) dims[(x / 2) * 32 + (l / 4) * 8 + (x % 2) * 4 + l % 4] = lanes[l];
      }
      uint16_t* o = out + ((size_t)s * R + r) * hd;
      _mm256_storeu_si256((__m256i*)o, (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(dims)));
      _mm256_storeu_si256((__m256i*)(o + 16), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(dims + 16)));
      _mm256_storeu_si256((__m256i*)(o + 32), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(dims + 32)));
      _mm256_storeu_si256((__m256i*)(o + 48), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(dims + 48)));
    }
  }
}
