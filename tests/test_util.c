#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include "test_util.h"

static int n_pass, n_fail, cur_ok;
static char cur_name[256];

void case_begin(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cur_name, sizeof cur_name, fmt, ap);
    va_end(ap);
    cur_ok = 1;
}

void case_check(int ok, const char *fmt, ...)
{
    if (ok)
        return;
    if (cur_ok)
        fprintf(stderr, "FAIL %s\n", cur_name);
    cur_ok = 0;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "    ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
}

int case_end(void)
{
    if (cur_ok)
        n_pass++;
    else
        n_fail++;
    return cur_ok;
}

void tally_print(void) { printf("%d passed, %d failed\n", n_pass, n_fail); }
int tally_failed(void) { return n_fail; }

int quick_mode(void)
{
    const char *q = getenv("FW_TEST_QUICK");
    return q && *q && *q != '0';
}

/* Whether the comma-separated list has the item name (n characters). */
static int has_item(const char *list, const char *name, size_t n)
{
    for (const char *s = list;; s++) {
        const size_t len = strcspn(s, ",");
        if (len == n && strncmp(s, name, n) == 0)
            return 1;
        s += len;
        if (!*s)
            return 0;
    }
}

static const char *tables_env(void)
{
    const char *t = getenv("FW_TEST_TABLES");
    return t && *t ? t : NULL;
}

int test_table(const char *name)
{
    const char *list = tables_env(), *def = fw_isa_default();
    return fw_isa_supported(name) &&
           (!list || has_item(list, name, strlen(name)) ||
            (def && strcmp(name, def) == 0 && has_item(list, "default", 7)));
}

int tables_check(void)
{
    const char *list = tables_env();
    if (!list)
        return 1;
    for (const char *s = list;; s++) {
        const size_t len = strcspn(s, ",");
        int known = len == 7 && strncmp(s, "default", 7) == 0;
        for (int i = 0; i < fw_isa_count(); i++)
            known |= strlen(fw_isa_name(i)) == len && strncmp(s, fw_isa_name(i), len) == 0;
        if (!known) {
            fprintf(stderr, "test_flywheel: FW_TEST_TABLES: no table '%.*s'\n", (int)len, s);
            return 0;
        }
        s += len;
        if (!*s)
            break;
    }
    for (int i = 0; i < fw_isa_count(); i++)
        if (test_table(fw_isa_name(i)))
            return 1;
    fprintf(stderr, "test_flywheel: FW_TEST_TABLES=%s: this CPU runs none of them\n", list);
    return 0;
}

gbuf gbuf_new(size_t bytes)
{
    gbuf b;
    b.bytes = bytes;
    b.base = malloc(bytes + 2 * GUARD);
    if (!b.base) {
        fprintf(stderr, "test: out of memory (%zu bytes)\n", bytes);
        exit(2);
    }
    memset(b.base, 0xA5, bytes + 2 * GUARD);
    b.p = b.base + GUARD;
    return b;
}

void gbuf_free(gbuf *b)
{
    free(b->base);
    b->base = NULL;
    b->p = NULL;
}

int gbuf_guards_ok(const gbuf *b)
{
    for (size_t i = 0; i < GUARD; i++)
        if (b->base[i] != 0xA5 || b->base[GUARD + b->bytes + i] != 0xA5)
            return 0;
    return 1;
}

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
void rng_seed(uint64_t s) { rng_state = s * 0x9E3779B97F4A7C15ull + 1; }

double rng_uniform(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) * 0x1p-53;
}

double rng_normal(void)
{
    double u = rng_uniform(), v = rng_uniform();
    return sqrt(-2.0 * log(u + 1e-300)) * cos(6.283185307179586 * v);
}

int64_t toffset(const fw_tensor *t, const int64_t *idx)
{
    int64_t o = 0;
    for (int i = 0; i < t->ndim; i++)
        o += idx[i] * t->stride[i];
    return o;
}

double tget(const fw_tensor *t, const int64_t *idx)
{
    int64_t o = toffset(t, idx);
    switch (t->dtype) {
    case FW_F32: return ((float *)t->data)[o];
    case FW_BF16: return fw_bf16_to_f32(((uint16_t *)t->data)[o]);
    case FW_F16: return fw_f16_to_f32(((uint16_t *)t->data)[o]);
    case FW_F64: return ((double *)t->data)[o];
    case FW_F8E4M3: case FW_F8E5M2: return fw_f8_to_f32(((uint8_t *)t->data)[o], t->dtype);
    }
    return 0;
}

void tset(const fw_tensor *t, const int64_t *idx, double x)
{
    int64_t o = toffset(t, idx);
    switch (t->dtype) {
    case FW_F32: ((float *)t->data)[o] = (float)x; break;
    case FW_BF16: ((uint16_t *)t->data)[o] = fw_f32_to_bf16((float)x); break;
    case FW_F16: ((uint16_t *)t->data)[o] = fw_f32_to_f16((float)x); break;
    case FW_F64: ((double *)t->data)[o] = x; break;
    case FW_F8E4M3: case FW_F8E5M2: ((uint8_t *)t->data)[o] = fw_f32_to_f8((float)x, t->dtype); break;
    }
}

int tnext(const fw_tensor *t, int64_t *idx)
{
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (++idx[i] < t->shape[i])
            return 1;
        idx[i] = 0;
    }
    return 0;
}

void tfill_normal(const fw_tensor *t, double scale)
{
    int64_t idx[FW_MAX_DIMS] = {0};
    for (int i = 0; i < t->ndim; i++)
        if (t->shape[i] == 0)
            return;
    do
        tset(t, idx, scale * rng_normal());
    while (tnext(t, idx));
}

double round_to(fw_dtype dt, double x)
{
    switch (dt) {
    case FW_F32: return (float)x;
    case FW_BF16: return fw_bf16_to_f32(fw_f32_to_bf16((float)x));
    case FW_F16: return fw_f16_to_f32(fw_f32_to_f16((float)x));
    case FW_F8E4M3: case FW_F8E5M2: return fw_f8_to_f32(fw_f32_to_f8((float)x, dt), dt);
    default: return x;
    }
}

void sr_errors(const double *so, const double *sl, const double *ro, const double *rl, int64_t no,
               int64_t nl, fw_dtype dt, double *eo, double *el)
{
    *eo = *el = 0;
    for (int64_t x = 0; x < no; x++)
        *eo = fmax(*eo, fabs(round_to(dt, so[x]) - ro[x]));
    for (int64_t x = 0; x < nl; x++)
        if (!(isinf(sl[x]) && sl[x] == rl[x]))
            *el = fmax(*el, fabs(sl[x] - rl[x]));
}

/* A 4-D view [a, b, c, e] whose memory order is given by `perm` (perm[0] outermost) with
 * `pad` extra elements after each innermost run and a last-dim stride of `es`. */
fw_tensor tview4(void *data, fw_dtype dt, const int64_t *shape, const int *perm, int64_t pad,
                 int64_t es, int64_t *extent)
{
    fw_tensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.dtype = dt;
    t.ndim = 4;
    int64_t s = es;
    for (int i = 3; i >= 0; i--) {
        int dim = perm[i];
        t.shape[dim] = shape[dim];
        t.stride[dim] = s;
        s *= shape[dim] > 0 ? shape[dim] : 1;
        if (i == 3)
            s += pad;
    }
    for (int i = 0; i < 4; i++)
        t.shape[i] = shape[i];
    *extent = s;
    return t;
}

int tuntouched(const gbuf *b, const fw_tensor *t)
{
    size_t es = fw_dtype_size(t->dtype);
    unsigned char *mark = calloc(b->bytes, 1);
    int64_t idx[FW_MAX_DIMS] = {0};
    int empty = 0;
    for (int i = 0; i < t->ndim; i++)
        empty |= t->shape[i] == 0;
    if (!empty)
        do
            memset(mark + (size_t)toffset(t, idx) * es, 1, es);
        while (tnext(t, idx));
    int ok = gbuf_guards_ok(b);
    for (size_t i = 0; i < b->bytes && ok; i++)
        if (!mark[i] && ((unsigned char *)b->p)[i] != 0xA5)
            ok = 0;
    free(mark);
    return ok;
}

double worse(double worst, double e) { return e <= worst ? worst : e == e ? e : INFINITY; }
