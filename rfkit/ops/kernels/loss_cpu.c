/* The training loss on the logits (rfkit.training.distill.rowwise_loss) on the CPU: for every
 * position, cross-entropy against its target and KL(teacher || student) at temperature T, and the
 * gradient for the student's logits, in one call and three passes over the row. Its PyTorch twin
 * (distill._rowwise_torch) takes a dozen full-vocabulary passes per row; the tests compare them.
 *
 *   s        : (rows, vocab)  student logits, float32 or bf16 words (s_bf16), rows s_stride apart
 *   t        : (rows, vocab)  teacher logits (NULL: no KL), float32 or bf16 (t_bf16)
 *   targets  : (rows,)        target ids, already >= 0 (NULL: no CE)
 *   ga, gb   : (rows,)        gradient weights of the CE and KL terms per row (ce_weight * a and
 *                             kl_weight * b / T in distill's words); NULL with their term
 *   grad     : (rows, vocab)  out, the student's dtype (NULL: no gradient wanted)
 *   ce, kl   : (rows,)        out, each row's CE and KL (unweighted; NULL with their term)
 *   inv_t    : 1 / T
 *
 * Per row: m = max s, Z = sum exp(s - m), CE = m + log Z - s[target]; with q = softmax(s / T) and
 * p = softmax(t / T), KL = sum p (t - s) / T - lse(t / T) + lse(s / T) and the gradient
 * ga (softmax(s) - onehot) + gb (q - p). Sums are float32 over vectorised lanes. Rows run on the
 * OpenMP threads when the library has OpenMP. Returns 0, or -1 when a row buffer cannot be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "bf16.h"

static inline void load_row(const void *p, int is_bf16, int64_t n, float scale, float *restrict out) {
    if (is_bf16) {
        const rf_bf16 *w = (const rf_bf16 *)p;
        for (int64_t j = 0; j < n; ++j) out[j] = bf16_to_f32(w[j]) * scale;
    } else {
        const float *x = (const float *)p;
        for (int64_t j = 0; j < n; ++j) out[j] = x[j] * scale;
    }
}

static inline float row_max(const float *restrict x, int64_t n) {
    float m = -INFINITY;
    for (int64_t j = 0; j < n; ++j) m = x[j] > m ? x[j] : m;
    return m;
}

static void loss_row(const void *s, int s_bf16, const void *t, int t_bf16, int64_t target, float ga, float gb,
                    void *grad, int g_bf16, float *ce, float *kl, int64_t n, float inv_t, float *xs, float *xt,
                    float *qs) {
    load_row(s, s_bf16, n, 1.0f, xs);
    const float ms = row_max(xs, n);
    const int scaled = inv_t != 1.0f;
    const float s_target = target >= 0 ? xs[target] : 0.0f;
    float zs = 0.0f, zq = 0.0f, zt = 0.0f, a = 0.0f, mt = 0.0f;
    if (t) {
        load_row(t, t_bf16, n, inv_t, xt);
        mt = row_max(xt, n);
        for (int64_t j = 0; j < n; ++j) {
            const float e = expf(xt[j] - mt);
            a += e * (xt[j] - xs[j] * inv_t);
            xt[j] = e;  /* exp(t/T - mt) from here on */
            zt += e;
        }
    }
    if (scaled && t) {
        const float mq = ms * inv_t;
        for (int64_t j = 0; j < n; ++j) {
            qs[j] = expf(xs[j] * inv_t - mq);
            zq += qs[j];
        }
    }
    for (int64_t j = 0; j < n; ++j) {
        xs[j] = expf(xs[j] - ms);  /* exp(s - ms) from here on */
        zs += xs[j];
    }
    if (!scaled) {
        qs = xs;
        zq = zs;
    }
    const float lse_s = ms + logf(zs);
    if (ce) *ce = lse_s - s_target;
    if (kl) *kl = a / zt - (mt + logf(zt)) + (ms * inv_t + logf(zq));
    if (!grad) return;
    const float cs = ga / zs, cq = gb / zq, ct = t ? gb / zt : 0.0f;
    if (g_bf16) {
        rf_bf16 *g = (rf_bf16 *)grad;
        for (int64_t j = 0; j < n; ++j)
            g[j] = f32_to_bf16(cs * xs[j] + (t ? cq * qs[j] - ct * xt[j] : 0.0f) - (j == target ? ga : 0.0f));
    } else {
        float *g = (float *)grad;
        for (int64_t j = 0; j < n; ++j) g[j] = cs * xs[j] + (t ? cq * qs[j] - ct * xt[j] : 0.0f) - (j == target ? ga : 0.0f);
    }
}

int rf_rowwise_loss(const void *s, int64_t s_bf16, int64_t s_stride, const void *t, int64_t t_bf16, int64_t t_stride,
                    const int64_t *targets, const float *ga, const float *gb, void *grad, int64_t g_bf16,
                    int64_t g_stride, float *ce, float *kl, int64_t rows, int64_t vocab, float inv_t, int64_t threads) {
    int rc = 0;
    const int64_t s_size = s_bf16 ? 2 : 4, t_size = t_bf16 ? 2 : 4, g_size = g_bf16 ? 2 : 4;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) reduction(| : rc)
#endif
    {
        float *buf = (float *)malloc(sizeof(float) * 3 * (size_t)vocab);
        if (!buf) rc |= -1;
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t r = 0; r < rows; ++r) {
            if (!buf) continue;
            const char *sr = (const char *)s + r * s_stride * s_size;
            const char *tr = t ? (const char *)t + r * t_stride * t_size : NULL;
            char *gr = grad ? (char *)grad + r * g_stride * g_size : NULL;
            loss_row(sr, (int)s_bf16, tr, (int)t_bf16, targets ? targets[r] : -1, ga ? ga[r] : 0.0f, gb ? gb[r] : 0.0f,
                     gr, (int)g_bf16, ce ? ce + r : NULL, kl ? kl + r : NULL, vocab, inv_t, buf, buf + vocab,
                     buf + 2 * vocab);
        }
        free(buf);
    }
    (void)threads;
    return rc;
}
