/* The hybrid's feature map phi(x) = [softmax(x W), softmax(-x W)] (W: hd x half, row-major),
 * shared by the CPU kernels that read it (window_cpu.c: inference; hybrid_train_cpu.c: training). */
#ifndef RF_PHI_H
#define RF_PHI_H
#include <float.h>
#include <math.h>
#include <stdint.h>

/* phi for 16 features (half 8), the default: four independent accumulators over the channels, so
 * the matrix-vector product is not one serial chain of dependent additions, and one 16-wide exp. */
static inline void feature_16(const float *restrict x, const float *restrict w, int64_t hd, float *restrict phi) {
    float a0[8] = {0}, a1[8] = {0}, a2[8] = {0}, a3[8] = {0};
    const int64_t hd4 = hd & ~(int64_t)3;
    for (int64_t d = 0; d < hd4; d += 4) {
        const float *wd = w + d * 8;
        for (int j = 0; j < 8; ++j) {
            a0[j] += x[d] * wd[j];
            a1[j] += x[d + 1] * wd[8 + j];
            a2[j] += x[d + 2] * wd[16 + j];
            a3[j] += x[d + 3] * wd[24 + j];
        }
    }
    for (int64_t d = hd4; d < hd; ++d)
        for (int j = 0; j < 8; ++j) a0[j] += x[d] * w[d * 8 + j];
    float acc[8], e[16];
    for (int j = 0; j < 8; ++j) acc[j] = (a0[j] + a1[j]) + (a2[j] + a3[j]);
    float mx = acc[0], mn = acc[0];
    for (int j = 1; j < 8; ++j) {
        mx = acc[j] > mx ? acc[j] : mx;
        mn = acc[j] < mn ? acc[j] : mn;
    }
    for (int j = 0; j < 8; ++j) {
        e[j] = acc[j] - mx;
        e[8 + j] = mn - acc[j];
    }
    for (int j = 0; j < 16; ++j) e[j] = expf(e[j]);
    float sp = 0.0f, sn = 0.0f;
    for (int j = 0; j < 8; ++j) {
        sp += e[j];
        sn += e[8 + j];
    }
    const float ip = 1.0f / sp, in = 1.0f / sn;
    for (int j = 0; j < 8; ++j) {
        phi[j] = e[j] * ip;
        phi[8 + j] = e[8 + j] * in;
    }
}

static void feature_any(const float *restrict x, const float *restrict w, int64_t hd, int64_t half,
                        float *restrict phi);

static inline void feature(const float *restrict x, const float *restrict w, int64_t hd, int64_t half,
                           float *restrict phi) {
    if (half == 8)
        feature_16(x, w, hd, phi);
    else
        feature_any(x, w, hd, half, phi);
}

static void feature_any(const float *restrict x, const float *restrict w, int64_t hd, int64_t half,
                        float *restrict phi) {
    float mx = -FLT_MAX, mn = FLT_MAX;
    for (int64_t j = 0; j < half; ++j) phi[j] = 0.0f;
    for (int64_t d = 0; d < hd; ++d) {
        const float xd = x[d], *wd = w + d * half;
        for (int64_t j = 0; j < half; ++j) phi[j] += xd * wd[j];
    }
    for (int64_t j = 0; j < half; ++j) {
        const float acc = phi[j];
        if (acc > mx) mx = acc;
        if (acc < mn) mn = acc;
    }
    float sp = 0.0f, sn = 0.0f;
    for (int64_t j = 0; j < half; ++j) {
        const float p = expf(phi[j] - mx), n = expf(mn - phi[j]);
        phi[j] = p;
        phi[half + j] = n;
        sp += p;
        sn += n;
    }
    for (int64_t j = 0; j < half; ++j) {
        phi[j] /= sp;
        phi[half + j] /= sn;
    }
}

#endif
