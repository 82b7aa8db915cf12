// Attention whose every query row is computed the same way whatever else is in the batch (the low-bit
// model's attention, so its whole forward is batch-invariant bit for bit).
//
// For query row n, head h: the keys it may see are visited in key order j = 0..K-1 (masked and padded
// keys skipped); score_j = dot(q, k_j) * scale (the dot: 16 lanes over head_dim, then a fixed-order
// tree sum), m = max score, p_j = exp(score_j - m), out = (sum_j p_j v_j) / (sum_j p_j), both sums in key
// order. A verify forward over k + 1 tokens sees, for its i-th token, exactly the keys (and slots, in the
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

namespace {

typedef float f32x16 __attribute__((vector_size(64)));

inline f32x16 load16(const float *p) {
    f32x16 v;
    std::memcpy(&v, p, sizeof(v));
    return v;
}

inline float tree_sum(f32x16 v) {
    float t[16];
    std::memcpy(t, &v, sizeof(t));
    for (int width = 8; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) t[i] = t[i] + t[i + width];
    return t[0];
}

inline float dot(const float *a, const float *b, int64_t D) {
    f32x16 acc{};
    int64_t i = 0;
    for (; i + 16 <= D; i += 16) acc += load16(a + i) * load16(b + i);
    float tail[16] = {};
    for (int64_t l = 0; i + l < D; l++) tail[l] = a[i + l] * b[i + l];
    return tree_sum(acc + load16(tail));
}

}  // namespace

extern "C" void lowbit_attention(const float *q, int64_t N, int64_t q_stride, int64_t H, int64_t KVH, int64_t D,
                                 const float *k_cache, const float *v_cache, const int64_t *key_slots,
                                 int64_t first_slot, int64_t K, const uint8_t *mask, int64_t T, const int64_t *rows,
                                 float scale, float *out, int num_threads) {
    const int64_t group = H / KVH;
    if (N * H * K * D < (int64_t)1 << 19) num_threads = 1;  // a decode step: waking a second thread costs more
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> scores(K);
        std::vector<float> acc(D);
#pragma omp for schedule(static)
        for (int64_t task = 0; task < N * H; task++) {
            const int64_t n = task / H, h = task % H;
            const int64_t row = rows ? rows[n] : n, b = rows ? row / T : 0;
            const uint8_t *visible = mask ? mask + row * K : nullptr;
            const int64_t *slots = key_slots ? key_slots + b * K : nullptr;
            const float *qv = q + n * q_stride + h * D;
            const int64_t head_offset = (h / group) * D;
            float best = -std::numeric_limits<float>::infinity();
            for (int64_t j = 0; j < K; j++) {
                if (visible && !visible[j]) continue;
                const int64_t slot = slots ? slots[j] : first_slot + j;
                scores[j] = dot(qv, k_cache + slot * KVH * D + head_offset, D) * scale;
                best = scores[j] > best ? scores[j] : best;
            }
            float total = 0.0f;
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (int64_t j = 0; j < K; j++) {
                if (visible && !visible[j]) continue;
                const int64_t slot = slots ? slots[j] : first_slot + j;
                const float p = std::exp(scores[j] - best);
                total += p;
                const float *vv = v_cache + slot * KVH * D + head_offset;
                for (int64_t i = 0; i < D; i++) acc[i] = std::fma(p, vv[i], acc[i]);
            }
            float *o = out + n * H * D + h * D;
            for (int64_t i = 0; i < D; i++) o[i] = acc[i] / total;
        }
    }
}
