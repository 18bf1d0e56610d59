/* attn/rope_kern.h: the rope sub-table (attn/attn_table.h); included by kern/table.h. */

/* Rotary embedding of one head row x: pair i = (x[i], x[i + h]) (GPT-NeoX halves) or
 * (x[2i], x[2i+1]) (interleaved, GPT-J) becomes (a c[i] - b s[i], a s[i] + b c[i]), i < h. */
static void rope(float *x, int h, const float *c, const float *s, int interleaved)
{
    int i = 0;
    if (!interleaved) {
        for (; i + VL <= h; i += VL) {
            const vf a = vload(x + i), b = vload(x + h + i), cv = vload(c + i), sv = vload(s + i);
            vstore(x + i, vsub(vmul(a, cv), vmul(b, sv)));
            vstore(x + h + i, vadd(vmul(a, sv), vmul(b, cv)));
        }
    }
    for (; i < h; i++) {
        float *pa = interleaved ? x + 2 * i : x + i, *pb = interleaved ? pa + 1 : x + h + i;
        const float a = *pa, b = *pb;
        *pa = a * c[i] - b * s[i];
        *pb = a * s[i] + b * c[i];
    }
}

#define FW_ROPE_TABLE {.rotate = rope}
