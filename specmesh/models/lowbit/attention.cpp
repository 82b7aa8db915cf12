// Attention whose every query row is computed the same way whatever else is in the batch (the low-bit
// model's attention, so its whole forward is batch-invariant bit for bit).
//
// For query row n, head h: the keys it may see are visited in key order j = 0..K-1 (masked and padded
// keys skipped); score_j = dot(q, k_j) * scale (the dot: 16 lanes over head_dim, then a fixed-order
// tree sum), m = max score, p_j = exp(score_j - m) (exp_nonpositive), out = (sum_j p_j v_j) / (sum_j p_j),
// both sums in key order. A verify forward over k + 1 tokens sees, for its i-th token, exactly the keys (and slots, in the
// same order) that a one-token step at that position sees, so the rows are equal bit for bit; SDPA's
// blocked reductions change with the number of queries and keys, and the activations' 8-bit rounding
// would turn those last-bit differences into different codes.
//
// Shapes: q rows of H heads x D (row stride q_stride floats); the cache layer [slots, KVH, D] for K and V;
// key slots [B, K] (or, with key_slots null, first_slot + j); mask [B, T, K] bytes (null: every key
// visible); rows [N] the padded row b * T + t of each query (null: b = 0, t = n); out [N, H * D].
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t PREFETCH_KEYS = 8;

inline float tree_sum(const float *lanes) {  // the fixed order: halves, quarters, pairs, the last two
    float t[16];
    std::memcpy(t, lanes, sizeof(t));
    for (int width = 8; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) t[i] = t[i] + t[i + width];
    return t[0];
}

// The dot products and the weighted sum of values are fused multiply-adds, each rounded once, spelled out
// because the library is built with -ffp-contract=off: a compiler left to contract `acc += a * b` fuses it on a
// CPU with FMA and not on one without, and the numbers would differ by build. With AVX-512 or AVX2 + FMA the
// intrinsics, without them libm's fmaf: the same numbers.

// dot(a, b): 16 lanes, lane l the chain of fmas over inputs l, l + 16, ... below D, then the fixed tree.
inline float dot(const float *a, const float *b, int64_t D) {
    alignas(64) float lanes[16] = {};
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= D; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    if (i < D) {
        const __mmask16 tail = (__mmask16)((1u << (D - i)) - 1);
        acc = _mm512_mask3_fmadd_ps(_mm512_maskz_loadu_ps(tail, a + i), _mm512_maskz_loadu_ps(tail, b + i), acc, tail);
    }
    _mm512_store_ps(lanes, acc);
#elif defined(__FMA__)
    __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();  // lanes 0..7 and 8..15
    for (; i + 16 <= D; i += 16) {
        low = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), low);
        high = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), high);
    }
    _mm256_store_ps(lanes, low);
    _mm256_store_ps(lanes + 8, high);
    for (int64_t l = 0; i + l < D; l++) lanes[l] = std::fma(a[i + l], b[i + l], lanes[l]);
#else
    for (; i + 16 <= D; i += 16)
        for (int l = 0; l < 16; l++) lanes[l] = std::fma(a[i + l], b[i + l], lanes[l]);
    for (int64_t l = 0; i + l < D; l++) lanes[l] = std::fma(a[i + l], b[i + l], lanes[l]);
#endif
    return tree_sum(lanes);
}

// acc[i] = fma(p, value[i], acc[i]) for i < D: element by element, so the vector width does not change a number.
inline void add_weighted(float p, const float *value, float *acc, int64_t D) {
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 weight = _mm512_set1_ps(p);
    for (; i + 16 <= D; i += 16)
        _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(weight, _mm512_loadu_ps(value + i), _mm512_loadu_ps(acc + i)));
#elif defined(__FMA__)
    const __m256 weight = _mm256_set1_ps(p);
    for (; i + 8 <= D; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(weight, _mm256_loadu_ps(value + i), _mm256_loadu_ps(acc + i)));
#endif
    for (; i < D; i++) acc[i] = std::fma(p, value[i], acc[i]);
}

// exp(x) for x <= 0 (scores minus their max): x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^7
// (truncation below 6e-9, under float's last bit), times 2^n through the exponent; 0 below -87. Written as
// straight-line float code so the loop over keys vectorises, and it is the same function for every row.
inline float exp_nonpositive(float x) {
    const float clamped = x < -87.0f ? -87.0f : x;
    const float n = std::nearbyint(clamped * 1.44269504088896341f);
    float r = std::fma(n, -0.693145751953125f, clamped);  // ln 2 in two parts: the first is exact in float
    r = std::fma(n, -1.428606765330187e-06f, r);
    float p = 1.0f / 5040.0f;
    p = std::fma(p, r, 1.0f / 720.0f);
    p = std::fma(p, r, 1.0f / 120.0f);
    p = std::fma(p, r, 1.0f / 24.0f);
    p = std::fma(p, r, 1.0f / 6.0f);
    p = std::fma(p, r, 0.5f);
    p = std::fma(p, r, 1.0f);
    p = std::fma(p, r, 1.0f);
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, sizeof(two_n));
    return x < -87.0f ? 0.0f : p * two_n;
}

}  // namespace

extern "C" void lowbit_attention(const float *q, int64_t N, int64_t q_stride, int64_t H, int64_t KVH, int64_t D,
                                 const float *k_cache, const float *v_cache, const int64_t *key_slots,
                                 int64_t first_slot, int64_t K, const uint8_t *mask, int64_t T, const int64_t *rows,
                                 float scale, float *out, int num_threads) {
    const int64_t group = H / KVH;  // query heads per key/value head: one task reads each key row once for them all
    if (N * H * K * D < (int64_t)1 << 16) num_threads = 1;  // a short decode step: waking a second thread costs more
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> scores(group * K), best(group), total(group), acc(group * D);
        std::vector<int64_t> visible_slots(K);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < N * KVH; task++) {
            const int64_t n = task / KVH, g = task % KVH;
            const int64_t row = rows ? rows[n] : n, b = rows ? row / T : 0;
            const uint8_t *visible = mask ? mask + row * K : nullptr;
            const int64_t *slots = key_slots ? key_slots + b * K : nullptr;
            int64_t count = 0;  // the visible keys' slots, in key order
            for (int64_t j = 0; j < K; j++)
                if (!visible || visible[j]) visible_slots[count++] = slots ? slots[j] : first_slot + j;
            const int64_t offset = g * D;
            for (int64_t h = 0; h < group; h++) best[h] = -std::numeric_limits<float>::infinity();
            for (int64_t j = 0; j < count; j++) {
                if (j + PREFETCH_KEYS < count)  // a hint: rows of other slots are far apart in the cache
                    for (int64_t i = 0; i < D; i += 16) __builtin_prefetch(k_cache + visible_slots[j + PREFETCH_KEYS] * KVH * D + offset + i);
                const float *key = k_cache + visible_slots[j] * KVH * D + offset;
                for (int64_t h = 0; h < group; h++) {
                    const float s = dot(q + n * q_stride + (g * group + h) * D, key, D) * scale;
                    scores[h * K + j] = s;
                    best[h] = s > best[h] ? s : best[h];
                }
            }
            for (int64_t h = 0; h < group; h++) {
                float *p = scores.data() + h * K;
                for (int64_t j = 0; j < count; j++) p[j] = exp_nonpositive(p[j] - best[h]);
                float sum = 0.0f;
                for (int64_t j = 0; j < count; j++) sum += p[j];
                total[h] = sum;
            }
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (int64_t j = 0; j < count; j++) {
                if (j + PREFETCH_KEYS < count)
                    for (int64_t i = 0; i < D; i += 16) __builtin_prefetch(v_cache + visible_slots[j + PREFETCH_KEYS] * KVH * D + offset + i);
                const float *value = v_cache + visible_slots[j] * KVH * D + offset;
                for (int64_t h = 0; h < group; h++) {
                    const float p = scores[h * K + j];
                    float *a = acc.data() + h * D;
                    add_weighted(p, value, a, D);
                }
            }
            for (int64_t h = 0; h < group; h++) {
                float *o = out + n * H * D + (g * group + h) * D;
                for (int64_t i = 0; i < D; i++) o[i] = acc[h * D + i] / total[h];
            }
        }
    }
}
