/* bf16 helpers shared by the CPU kernels (window_cpu.c, loss_cpu.c). */
#ifndef RF_BF16_H
#define RF_BF16_H
#include <stdint.h>
#include <string.h>

/* bf16 words (uint16): the upper half of a float32. Loading is exact; storing rounds to nearest,
 * ties to even, as torch's CPU tensor cast (.to(torch.bfloat16)) does, and turns every NaN into
 * 0xFFFF as that cast does (ATen's vectorised conversion; c10's scalar one writes 0x7FC0). The NaN
 * test reads the bits: -ffast-math lets the compiler assume x == x. */
typedef uint16_t rf_bf16;

static inline float bf16_to_f32(rf_bf16 w) {
    const uint32_t u = (uint32_t)w << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static inline rf_bf16 f32_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFF;
    return (rf_bf16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#endif
