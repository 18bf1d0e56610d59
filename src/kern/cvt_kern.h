/* kern/cvt_kern.h: the cvt sub-table (kern/kernels.h) over the vector layer; included by
 * kern/table.h. */

/* ------------------------------------------------------------- conversion -- */

/* Strided bf16 / f16 rows move their 16-bit elements through a contiguous block of this many,
 * converted in vectors (the scalar conversions, a rounding with its NaN test per element, took
 * 45% of a decode of Qwen3-Next's conv with transformers' [batch, dim, state_len] state,
 * whose rows have a stride of 4: 66 us a call for 8192 channels). */
#define CVT_BLOCK 256

static void to_f32(const void *src, fw_dtype dt, int64_t stride, int64_t n, float scale, float *dst)
{
    int64_t i = 0;
    if (stride == 1)
        for (; i + VL <= n; i += VL)
            cvt_in_vec(src, dt, i, scale, dst);
    else if (dt == FW_BF16 || dt == FW_F16)
        for (; i + VL <= n;) {
            uint16_t h[CVT_BLOCK];
            const uint16_t *s = (const uint16_t *)src + i * stride;
            const int m = (int)((n - i < CVT_BLOCK ? n - i : CVT_BLOCK) / VL * VL);
            for (int e = 0; e < m; e++)
                h[e] = s[e * stride];
            for (int e = 0; e < m; e += VL)
                cvt_in_vec(h, dt, e, scale, dst + i);
            i += m;
        }
    for (; i < n; i++)
        dst[i] = fw_load_elem(src, dt, i * stride) * scale;
}

static void from_f32(const float *src, int64_t n, void *dst, fw_dtype dt, int64_t stride)
{
    int64_t i = 0;
    if (stride == 1)
        for (; i + VL <= n; i += VL)
            cvt_out_vec(src, i, dst, dt);
    else if (dt != FW_F32)
        for (; i + VL <= n;) {
            uint16_t h[CVT_BLOCK];
            uint16_t *d = (uint16_t *)dst + i * stride;
            const int m = (int)((n - i < CVT_BLOCK ? n - i : CVT_BLOCK) / VL * VL);
            for (int e = 0; e < m; e += VL)
                cvt_out_vec(src + i, e, h, dt);
            for (int e = 0; e < m; e++)
                d[e * stride] = h[e];
            i += m;
        }
    for (; i < n; i++) {
        int64_t o = i * stride;
        if (dt == FW_F32)
            ((float *)dst)[o] = src[i];
        else if (dt == FW_BF16)
            ((uint16_t *)dst)[o] = fw_cvt_f32_bf16(src[i]);
        else
            ((uint16_t *)dst)[o] = fw_cvt_f32_f16(src[i]);
    }
}

#define FW_CVT_TABLE {.to_f32 = to_f32, .from_f32 = from_f32}
