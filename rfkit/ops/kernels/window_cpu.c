/* The decode step of the window mixers (rfkit.models.window / rfkit.models.hybrid) on the CPU.
 *
 * One call does what WindowAttention.step_qkv does in about 35 small PyTorch ops: write the new
 * key and value into their slot of the sink + ring buffer, fold the key the token evicts from the
 * ring into the linear-attention state (hybrid), attend over the buffer, add the state's
 * contribution under the same normaliser, and count the token. The PyTorch step is its twin and
 * the tests compare the two. Inference only, float32, every array contiguous.
 *
 *   q        : (batch, hq, hd)       rotated queries of the replaced heads (unscaled)
 *   k, v     : (batch, hkv, hd)      the new token's rotated key and value
 *   keys     : (batch, hkv, ns, hd)  ns = sink + window: slots 0..sink-1 the first tokens, then a
 *   values                           ring, rank r >= sink in slot sink + r % window (in place)
 *   seen     : (batch,)              real tokens so far (in place: +1)
 *   S_state  : (batch, hkv, f, hd)   hybrid only (NULL for plain window attention), in place
 *   z_state  : (batch, hkv, f)
 *   fmap     : (hkv, hd, f / 2)      feature map: phi(x) = [softmax(x W), softmax(-x W)]
 *   g        : (hq,)                 weight of the old tokens, relu(gate) * exp(log_scale)
 *   kvq      : (hq,)                 KV head of every query head
 *   out      : (batch, hq, hd)
 *
 * Old tokens enter as y = (A + c a) / (Z + c zl) with c = g exp(-max(m, -60)), m the window's
 * highest score, A and Z the window's unnormalised sums, a = phi(q) S and zl = phi(q) . z.
 * Returns 0, or -1 when the work buffer cannot be allocated.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static void feature(const float *x, const float *w, int64_t hd, int64_t half, float *phi) {
    float mx = -FLT_MAX, mn = FLT_MAX;
    for (int64_t j = 0; j < half; ++j) {
        float acc = 0.0f;
        for (int64_t d = 0; d < hd; ++d) acc += x[d] * w[d * half + j];
        phi[j] = acc;
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

int rf_window_step_f32(const float *q, const float *k, const float *v, float *keys, float *values,
                       int64_t *seen, float *S_state, float *z_state, const float *fmap,
                       const float *g, const int64_t *kvq, float *out, int64_t batch, int64_t hq,
                       int64_t hkv, int64_t hd, int64_t sink, int64_t window, int64_t f,
                       float scaling) {
    const int64_t ns = sink + window, half = f / 2;
    float *work = (float *)malloc(sizeof(float) * (size_t)(ns + 2 * f + 2));
    if (!work) return -1;
    float *p = work, *phi = work + ns;
    unsigned char valid[ns > 0 ? ns : 1];
    for (int64_t b = 0; b < batch; ++b) {
        const int64_t n = seen[b];
        const int64_t ring = sink + n % window;
        float *kb = keys + b * hkv * ns * hd, *vb = values + b * hkv * ns * hd;
        if (S_state && n - window >= sink) { /* fold the evicted token (rank n - window) */
            for (int64_t h = 0; h < hkv; ++h) {
                const float *ko = kb + (h * ns + ring) * hd, *vo = vb + (h * ns + ring) * hd;
                feature(ko, fmap + h * hd * half, hd, half, phi);
                float *S = S_state + (b * hkv + h) * f * hd, *z = z_state + (b * hkv + h) * f;
                for (int64_t j = 0; j < f; ++j) {
                    z[j] += phi[j];
                    for (int64_t d = 0; d < hd; ++d) S[j * hd + d] += phi[j] * vo[d];
                }
            }
        }
        const int64_t slot = n < sink ? n : ring;
        for (int64_t h = 0; h < hkv; ++h) {
            memcpy(kb + (h * ns + slot) * hd, k + (b * hkv + h) * hd, sizeof(float) * (size_t)hd);
            memcpy(vb + (h * ns + slot) * hd, v + (b * hkv + h) * hd, sizeof(float) * (size_t)hd);
        }
        /* slots visible to the new token (rank n): sink slots i <= n, ring ranks >= sink */
        for (int64_t i = 0; i < sink; ++i) valid[i] = i <= n;
        for (int64_t j = 0; j < window; ++j) {
            const int64_t back = ((n - j) % window + window) % window;
            valid[sink + j] = n - back >= sink;
        }
        for (int64_t h = 0; h < hq; ++h) {
            const int64_t kv = kvq[h];
            const float *qh = q + (b * hq + h) * hd;
            const float *kk = kb + kv * ns * hd, *vv = vb + kv * ns * hd;
            float m = -FLT_MAX; /* every query sees at least itself */
            for (int64_t t = 0; t < ns; ++t) {
                if (!valid[t]) continue;
                float acc = 0.0f;
                for (int64_t d = 0; d < hd; ++d) acc += qh[d] * kk[t * hd + d];
                p[t] = acc * scaling;
                if (p[t] > m) m = p[t];
            }
            float Z = 0.0f;
            float *y = out + (b * hq + h) * hd;
            for (int64_t d = 0; d < hd; ++d) y[d] = 0.0f;
            for (int64_t t = 0; t < ns; ++t) {
                if (!valid[t]) continue;
                const float e = expf(p[t] - m);
                Z += e;
                for (int64_t d = 0; d < hd; ++d) y[d] += e * vv[t * hd + d];
            }
            float c = 0.0f, zl = 0.0f;
            if (S_state && g[h] > 0.0f) {
                c = g[h] * expf(-(m > -60.0f ? m : -60.0f));
                feature(qh, fmap + kv * hd * half, hd, half, phi);
                const float *S = S_state + (b * hkv + kv) * f * hd, *z = z_state + (b * hkv + kv) * f;
                for (int64_t j = 0; j < f; ++j) {
                    zl += phi[j] * z[j];
                    const float cj = c * phi[j];
                    for (int64_t d = 0; d < hd; ++d) y[d] += cj * S[j * hd + d];
                }
            }
            const float inv = 1.0f / (Z + c * zl);
            for (int64_t d = 0; d < hd; ++d) y[d] *= inv;
        }
        seen[b] = n + 1;
    }
    free(work);
    return 0;
}
