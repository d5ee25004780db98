/* The few-row RMSNorm of engine/model/native.py: torch's rms_norm over bfloat16 rows,
 * then the weight, with torch's bits.
 *
 * torch (CPU, bfloat16 input) upcasts to float32, sums the squares with ATen's inner
 * sum, divides by n, adds eps, takes 1 / sqrt, multiplies, rounds to bfloat16; the
 * weight multiplies that in bfloat16 (float32 product, rounded). ATen's inner sum has
 * a fixed order: 8-lane vectors, vector i into partial i % 4 through a cascade of
 * levels (16 or more groups of 4 vectors each), the partials added in order, then the
 * scalar tail and the lanes one by one. aten_sum below is that order (the Python side
 * checks the bits against torch at load and keeps torch's norm where they differ). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 8
#define ILP 4
#define LEVELS 4
#define MAX_WIDTH 16384

static inline float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t to_bf16(float f) { /* to nearest even, as torch; NaN stays NaN */
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
  u += 0x7fff + ((u >> 16) & 1);
  return (uint16_t)(u >> 16);
}

static float aten_sum(const float* v, int n) {
  const int vectors = n / LANES, groups = vectors / ILP;
  int log2_groups = 0;
  while ((1 << log2_groups) < groups) log2_groups++;
  int power = groups > 1 ? log2_groups / LEVELS : 0;
  if (power < 4) power = 4;
  const int step = 1 << power, mask = step - 1;
  __m256 acc[LEVELS][ILP];
  int live[LEVELS] = {0};
#define ADD_GROUP(level, g)                                                             \
  do {                                                                                  \
    for (int k = 0; k < ILP; k++) {                                                     \
      __m256 x = _mm256_loadu_ps(v + ((size_t)(g) * ILP + k) * LANES);                  \
      acc[level][k] = live[level] ? _mm256_add_ps(acc[level][k], x) : x;                \
    }                                                                                   \
    live[level] = 1;                                                                    \
  } while (0)
  int i = 0;
  while (i + step <= groups) {
    for (int s = 0; s < step; s++, i++) ADD_GROUP(0, i);
    for (int level = 1; level < LEVELS; level++) {
      if (live[level - 1]) {
        for (int k = 0; k < ILP; k++)
          acc[level][k] = live[level] ? _mm256_add_ps(acc[level][k], acc[level - 1][k]) : acc[level - 1][k];
        live[level] = 1;
        live[level - 1] = 0;
      }
      if (i & (mask << (level * power))) break;
    }
  }
  for (int g = i; g < groups; g++) ADD_GROUP(0, g);
  for (int level = 1; level < LEVELS; level++) {
    if (!live[level]) continue;
    for (int k = 0; k < ILP; k++) acc[0][k] = live[0] ? _mm256_add_ps(acc[0][k], acc[level][k]) : acc[level][k];
    live[0] = 1;
  }
  __m256 parts[ILP];
  int parts_live[ILP] = {0};
  if (live[0])
    for (int k = 0; k < ILP; k++) {
      parts[k] = acc[0][k];
      parts_live[k] = 1;
    }
  for (int w = groups * ILP; w < vectors; w++) {
    __m256 x = _mm256_loadu_ps(v + (size_t)w * LANES);
    parts[0] = parts_live[0] ? _mm256_add_ps(parts[0], x) : x;
    parts_live[0] = 1;
  }
  __m256 vec = _mm256_setzero_ps();
  int vec_live = 0;
  for (int k = 0; k < ILP; k++) {
    if (!parts_live[k]) continue;
    vec = vec_live ? _mm256_add_ps(vec, parts[k]) : parts[k];
    vec_live = 1;
  }
  float total = 0.0f;
  int total_live = 0;
  for (int k = vectors * LANES; k < n; k++) {
    total = total_live ? total + v[k] : v[k];
    total_live = 1;
  }
  if (vec_live) {
    float lanes[LANES];
    _mm256_storeu_ps(lanes, vec);
    for (int l = 0; l < LANES; l++) {
      total = total_live ? total + lanes[l] : lanes[l];
      total_live = 1;
    }
  }
  return total;
}

/* y[r] = weight * bf16(x[r] * 1 / sqrt(sum(x[r]^2) / n + eps)), rows of n <= MAX_WIDTH.
 * Returns -1 (nothing written) for a wider row. */
int rms_norm_rows(const uint16_t* x, int rows, int n, const uint16_t* weight, float eps, uint16_t* y) {
  static __thread float upcast[MAX_WIDTH], squares[MAX_WIDTH];
  if (n > MAX_WIDTH) return -1;
  for (int r = 0; r < rows; r++) {
    const uint16_t* row = x + (size_t)r * n;
    for (int i = 0; i < n; i++) {
      upcast[i] = from_bf16(row[i]);
      squares[i] = upcast[i] * upcast[i];
    }
    const float rstd = 1.0f / sqrtf(aten_sum(squares, n) / (float)n + eps);
    for (int i = 0; i < n; i++)
      y[(size_t)r * n + i] = to_bf16(from_bf16(weight[i]) * from_bf16(to_bf16(upcast[i] * rstd)));
  }
  return 0;
}
