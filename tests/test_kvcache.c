/*
 * test_kvcache.c: append-and-attend against the float64 reference, for contiguous and paged
 * caches holding the same logical context (paged pages shuffled, unused rows filled with
 * junk). Checks: error <= 2 x plain + 1e-5, paged == contiguous bit for bit, the cache after
 * the call equals the expected image (new rows in place, nothing else touched), 1 and 3
 * threads bit-identical, and bad input returning a status with cache and outputs untouched.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "attn/attn.h"
#include "test_util.h"

typedef struct {
    int64_t b, hq, hkv, d, dv, page; /* page 0: contiguous only */
    fw_dtype dt;
    int causal, append;
    int64_t wl;
    float softcap;
    const int32_t *old, *nnew; /* per sequence: cached tokens, new tokens */
    int sinks;                 /* 1: attention sinks, f32 [hq] */
    fw_dtype f8;               /* an fp8 cache (FW_F8E4M3, FW_F8E5M2) with descales, or FW_F32: none */
    int desc_heads;            /* fp8: descales [b, hkv] (1) or scalar (0) */
} kv_case;

/* The cache's dtype: an fp8 case's, else the inputs'. */
static fw_dtype cdt(const kv_case *t) { return t->f8 != FW_F32 ? t->f8 : t->dt; }

typedef struct {
    gbuf k, v;          /* cache storage */
    fw_kv_cache c;
    int32_t *bt;
} cache_buf;

static size_t esz(fw_dtype t) { return fw_dtype_size(t); }

/* The library's key addressing (fw_attn_key) for a cache, so the test writes and checks rows
 * exactly where the kernel reads them. */
static void addressing_of(const fw_kv_cache *c, fw_attn_prob *p)
{
    memset(p, 0, sizeof *p);
    p->bt = c->block_table;
    p->bt_stride = c->max_pages;
    p->page = c->k.shape[1];
    p->page_shift = -1; /* the general addressing: the library's shift must agree with it */
    p->d = c->k.shape[3];
    p->dv = c->v.shape[3];
    p->tiles = c->layout == FW_KV_TILES;
    p->kpage = p->kb = c->k.stride[0];
    p->vpage = p->vb = c->v.stride[0];
    for (int i = 0; i < 3; i++) {
        p->ks[i] = c->k.stride[i + 1];
        p->vs[i] = c->v.stride[i + 1];
    }
}

static fw_attn_seq seq_of(const fw_attn_prob *p, int64_t i)
{
    fw_attn_seq s;
    memset(&s, 0, sizeof s);
    s.index = i;
    s.k0 = i * p->kb;
    s.v0 = i * p->vb;
    return s;
}

/* Logical context rows as doubles [b][cap][hkv][d] are not kept: both caches are written from
 * the same random draws, row by row. */
/* Element offset of channel x of row j, head h, in K (v = 0) or V (v = 1): the library's
 * addressing of either layout. */
static int64_t elem_of(const fw_attn_prob *p, const fw_attn_seq *s, int64_t j, int64_t h, int64_t x, int v)
{
    if (p->tiles)
        return fw_attn_tile_elem(p, s, j, h, x, v);
    return fw_attn_key(p, s, j, v) + h * (v ? p->vs[1] : p->ks[1]) + x * (v ? p->vs[2] : p->ks[2]);
}

/* kcols 1: K pages laid out as vLLM's CPU "vec" cache keeps them, [hkv][d][page] (each
 * channel's keys contiguous), V as usual; kcols 2: FW_KV_TILES, pages [hkv][page][d] with
 * each (page, head) block in AMX's tile order (vLLM's "amx" cache). */
static void cache_make(cache_buf *cb, const kv_case *t, int paged, int64_t cap, int32_t *seqlens,
                       uint64_t seed, int kcols)
{
    memset(cb, 0, sizeof *cb);
    const int64_t ps = paged ? t->page : cap;
    const int64_t per_seq = (cap + ps - 1) / ps;
    const int64_t npages = paged ? t->b * per_seq + 3 : t->b; /* spare pages hold junk */
    int64_t ks[4] = {npages, ps, t->hkv, t->d}, vs[4] = {npages, ps, t->hkv, t->dv};
    cb->k = gbuf_new((size_t)(npages * ps * t->hkv * t->d) * esz(cdt(t)));
    cb->v = gbuf_new((size_t)(npages * ps * t->hkv * t->dv) * esz(cdt(t)));
    cb->c.k = fw_tensor_contiguous(cb->k.p, cdt(t), 4, ks);
    cb->c.v = fw_tensor_contiguous(cb->v.p, cdt(t), 4, vs);
    if (kcols == 1) {
        cb->c.k.stride[1] = 1;
        cb->c.k.stride[2] = t->d * ps;
        cb->c.k.stride[3] = ps;
    } else if (kcols == 2) {
        cb->c.k.stride[1] = t->d;
        cb->c.k.stride[2] = t->d * ps;
        cb->c.v.stride[1] = t->dv;
        cb->c.v.stride[2] = t->dv * ps;
        cb->c.layout = FW_KV_TILES;
    }
    rng_seed(seed + 1000);
    tfill_normal(&cb->c.k, 3.0); /* junk everywhere first */
    tfill_normal(&cb->c.v, 3.0);
    if (paged) {
        /* a shuffled assignment of pages to (sequence, page slot) */
        int64_t n = t->b * per_seq;
        int32_t *perm = malloc(sizeof(int32_t) * (size_t)(npages));
        for (int64_t i = 0; i < npages; i++)
            perm[i] = (int32_t)i;
        rng_seed(seed + 7);
        for (int64_t i = npages - 1; i > 0; i--) {
            int64_t j = (int64_t)(rng_uniform() * (double)(i + 1));
            int32_t x = perm[i]; perm[i] = perm[j]; perm[j] = x;
        }
        cb->bt = malloc(sizeof(int32_t) * (size_t)(n + 1));
        for (int64_t i = 0; i < n; i++)
            cb->bt[i] = perm[i];
        free(perm);
        cb->c.block_table = cb->bt;
        cb->c.max_pages = per_seq;
    }
    cb->c.seqlens = seqlens;
    /* the logical cached rows, drawn in the same order for both layouts */
    rng_seed(seed);
    fw_attn_prob p;
    addressing_of(&cb->c, &p);
    for (int64_t i = 0; i < t->b; i++) {
        fw_attn_seq s = seq_of(&p, i);
        for (int64_t j = 0; j < t->old[i]; j++)
            for (int v = 0; v < 2; v++) {
                const fw_tensor *tt = v ? &cb->c.v : &cb->c.k;
                const int64_t n = v ? t->dv : t->d;
                for (int64_t h = 0; h < t->hkv; h++)
                    for (int64_t x = 0; x < n; x++) {
                        const double val = rng_normal();
                        if (!p.tiles) {
                            const int64_t row = fw_attn_key(&p, &s, j, v);
                            int64_t idx[4];
                            idx[0] = row / tt->stride[0];
                            idx[1] = (row - idx[0] * tt->stride[0]) / tt->stride[1];
                            idx[2] = h;
                            idx[3] = x;
                            tset(tt, idx, val);
                        } else { /* bf16 only */
                            ((uint16_t *)tt->data)[elem_of(&p, &s, j, h, x, v)] = fw_f32_to_bf16((float)val);
                        }
                    }
            }
    }
}

static void cache_free(cache_buf *cb)
{
    gbuf_free(&cb->k);
    gbuf_free(&cb->v);
    free(cb->bt);
}

/* The cache copy `after` must equal `before` except the new rows, which must equal k_new/v_new
 * (an fp8 cache: k_new / descale rounded to it, fw_f32_to_f8; ds: the K and V descales of
 * each sequence and head, [2][b * hkv]). */
static int cache_image_ok(const kv_case *t, const cache_buf *before_k, const cache_buf *after,
                          const fw_tensor *kn, const fw_tensor *vn, const int32_t *cuq, int paged,
                          const float *const ds[2])
{
    (void)paged;
    const size_t nk = after->k.bytes, nv = after->v.bytes;
    unsigned char *ek = malloc(nk), *ev = malloc(nv);
    memcpy(ek, before_k->k.p, nk);
    memcpy(ev, before_k->v.p, nv);
    if (kn) {
        fw_attn_prob p;
        addressing_of(&after->c, &p);
        for (int64_t i = 0; i < t->b; i++) {
            fw_attn_seq s = seq_of(&p, i);
            for (int64_t r = 0; r < t->nnew[i]; r++)
                for (int v = 0; v < 2; v++) {
                    const fw_tensor *src = v ? vn : kn;
                    const int64_t n = v ? t->dv : t->d;
                    for (int64_t h = 0; h < t->hkv; h++)
                        for (int64_t x = 0; x < n; x++) {
                            const size_t at = (size_t)elem_of(&p, &s, t->old[i] + r, h, x, v) * esz(cdt(t));
                            const int64_t from = ((cuq[i] + r) * t->hkv + h) * n + x;
                            if (t->f8 != FW_F32) {
                                const int64_t idx[3] = {cuq[i] + r, h, x};
                                (v ? ev : ek)[at] = fw_f32_to_f8((float)tget(src, idx) / ds[v][i * t->hkv + h], t->f8);
                            } else {
                                memcpy((v ? ev : ek) + at, (char *)src->data + (size_t)from * esz(t->dt), esz(t->dt));
                            }
                        }
                }
        }
    }
    int ok = memcmp(ek, after->k.p, nk) == 0 && memcmp(ev, after->v.p, nv) == 0 &&
             gbuf_guards_ok(&after->k) && gbuf_guards_ok(&after->v);
    free(ek);
    free(ev);
    return ok;
}

static void cache_copy(cache_buf *dst, const cache_buf *src)
{
    *dst = *src;
    dst->k = gbuf_new(src->k.bytes);
    dst->v = gbuf_new(src->v.bytes);
    memcpy(dst->k.p, src->k.p, src->k.bytes);
    memcpy(dst->v.p, src->v.p, src->v.bytes);
    dst->c.k.data = dst->k.p;
    dst->c.v.data = dst->v.p;
    dst->bt = NULL; /* the block table stays shared with src */
}

static void cache_copy_free(cache_buf *cb)
{
    gbuf_free(&cb->k);
    gbuf_free(&cb->v);
}

/* Whether two caches of one shape hold the same bytes. */
static int cache_same(const cache_buf *a, const cache_buf *b)
{
    return memcmp(a->k.p, b->k.p, a->k.bytes) == 0 && memcmp(a->v.p, b->v.p, a->v.bytes) == 0;
}

static double maxdiff(const fw_tensor *a, const double *ref, int64_t n, int lse)
{
    double e = 0;
    for (int64_t i = 0; i < n; i++) {
        double x = a->dtype == FW_F32 ? ((float *)a->data)[i]
                   : a->dtype == FW_BF16 ? fw_bf16_to_f32(((uint16_t *)a->data)[i])
                                         : fw_f16_to_f32(((uint16_t *)a->data)[i]);
        double d = (lse && isinf(ref[i]) && x == ref[i]) ? 0 : fabs(x - ref[i]);
        if (!(d <= e))
            e = isnan(d) ? INFINITY : d;
    }
    return e;
}

static void run_kv_case(const kv_case *t, uint64_t seed)
{
    int32_t cuq[64] = {0}, seqlens[64];
    int64_t cap = 1;
    for (int64_t i = 0; i < t->b; i++) {
        cuq[i + 1] = cuq[i] + t->nnew[i];
        seqlens[i] = t->old[i];
        cap = fw_max64(cap, t->old[i] + (t->append ? t->nnew[i] : 0));
    }
    const int64_t tq = cuq[t->b];
    case_begin("kvcache b%lld h%lld:%lld d%lld/%lld page %lld %s cache %s%s causal %d append %d w%lld cap%g%s",
               (long long)t->b, (long long)t->hq, (long long)t->hkv, (long long)t->d,
               (long long)t->dv, (long long)t->page, fw_dtype_name(t->dt), fw_dtype_name(cdt(t)),
               t->f8 != FW_F32 ? (t->desc_heads ? " descales [b, hkv]" : " scalar descales") : "",
               t->causal, t->append, (long long)t->wl, (double)t->softcap, t->sinks ? " sinks" : "");
    int64_t qs[3] = {tq, t->hq, t->d}, kns[3] = {tq, t->hkv, t->d}, vns[3] = {tq, t->hkv, t->dv},
            os[3] = {tq, t->hq, t->dv}, ls[2] = {t->hq, tq};
    gbuf bq = gbuf_new((size_t)(tq * t->hq * t->d) * esz(t->dt) + 1);
    gbuf bkn = gbuf_new((size_t)(tq * t->hkv * t->d) * esz(t->dt) + 1);
    gbuf bvn = gbuf_new((size_t)(tq * t->hkv * t->dv) * esz(t->dt) + 1);
    fw_tensor q = fw_tensor_contiguous(bq.p, t->dt, 3, qs);
    fw_tensor kn = fw_tensor_contiguous(bkn.p, t->dt, 3, kns), vn = fw_tensor_contiguous(bvn.p, t->dt, 3, vns);
    rng_seed(seed + 99);
    tfill_normal(&q, 1.0);
    tfill_normal(&kn, 1.0);
    tfill_normal(&vn, 1.0);
    const fw_tensor *pk = t->append ? &kn : NULL, *pv = t->append ? &vn : NULL;

    cache_buf cont, pag, cols, tiles;
    /* FW_KV_TILES where it applies: paged bf16, page, d and dv multiples of 32 */
    const int tiled = t->page && cdt(t) == FW_BF16 && t->page % 32 == 0 && t->d % 32 == 0 && t->dv % 32 == 0;
    /* an fp8 cache's descales, by sequence and head (0.25 .. 1.75), or one scalar each */
    float desc[2][64 * 8];
    const float *ds[2] = {desc[0], desc[1]};
    const int64_t dshape[2] = {t->b, t->hkv};
    fw_tensor tkd = fw_tensor_contiguous(desc[0], FW_F32, t->desc_heads ? 2 : 0, dshape);
    fw_tensor tvd = fw_tensor_contiguous(desc[1], FW_F32, t->desc_heads ? 2 : 0, dshape);
    for (int64_t e = 0; e < t->b * t->hkv; e++) {
        desc[0][e] = t->desc_heads ? 0.25f * (float)(1 + e % 7) : 0.75f;
        desc[1][e] = t->desc_heads ? 0.25f * (float)(1 + (e + 3) % 7) : 1.25f;
    }
    cache_make(&cont, t, 0, cap, seqlens, seed, 0);
    if (t->page) {
        cache_make(&pag, t, 1, cap, seqlens, seed, 0);
        cache_make(&cols, t, 1, cap, seqlens, seed, 1);
    }
    cache_buf *all[3] = {&cont, &pag, &cols};
    for (int i = 0; i < (t->page ? 3 : 1) && t->f8 != FW_F32; i++) {
        all[i]->c.k_descale = &tkd;
        all[i]->c.v_descale = &tvd;
    }
    if (tiled)
        cache_make(&tiles, t, 1, cap, seqlens, seed, 2);

    fw_attn_params p;
    fw_attn_params_init(&p);
    p.causal = t->causal;
    p.window_left = t->wl;
    p.softcap = t->softcap;
    /* sinks by head: near the rows' lse, dominating it, far below it, random */
    float sinks[64];
    fw_tensor ts = fw_tensor_contiguous(sinks, FW_F32, 1, &t->hq);
    for (int64_t h = 0; h < t->hq; h++)
        sinks[h] = h % 4 == 0 ? 7.5f : h % 4 == 1 ? 40.0f : h % 4 == 2 ? -30.0f : (float)(2 * rng_normal());
    p.sinks = t->sinks ? &ts : NULL;
    double *ro = calloc((size_t)(tq * t->hq * t->dv) + 1, 8), *rl = calloc((size_t)(tq * t->hq) + 1, 8);
    fw_tensor fro = fw_tensor_contiguous(ro, FW_F64, 3, os), frl = fw_tensor_contiguous(rl, FW_F64, 2, ls);
    p.precision = FW_PREC_F32;
    fw_status st = fw_attn_kvcache_ref(&q, pk, pv, cuq, t->b, &cont.c, &fro, &frl, &p);
    case_check(st == FW_OK, "reference: %s", fw_last_error());
    /* the same-roundings reference of bf16 products: its error is the bf16 bar */
    double sre = 0, srl = 0;
    {
        double *so = calloc((size_t)(tq * t->hq * t->dv) + 1, 8), *sl = calloc((size_t)(tq * t->hq) + 1, 8);
        fw_tensor fso = fw_tensor_contiguous(so, FW_F64, 3, os), fsl = fw_tensor_contiguous(sl, FW_F64, 2, ls);
        p.precision = FW_PREC_BF16;
        st = fw_attn_kvcache_ref(&q, pk, pv, cuq, t->b, &cont.c, &fso, &fsl, &p);
        case_check(st == FW_OK, "same-roundings reference: %s", fw_last_error());
        sr_errors(so, sl, ro, rl, tq * t->hq * t->dv, tq * t->hq, t->dt, &sre, &srl);
        free(so);
        free(sl);
        p.precision = FW_PREC_F32;
    }
    for (int lay = 0; lay < 2 && t->page; lay++) {
        if (lay && !tiled)
            break;
        double *ro2 = calloc((size_t)(tq * t->hq * t->dv) + 1, 8);
        fw_tensor f2 = fw_tensor_contiguous(ro2, FW_F64, 3, os);
        st = fw_attn_kvcache_ref(&q, pk, pv, cuq, t->b, lay ? &tiles.c : &pag.c, &f2, NULL, &p);
        case_check(st == FW_OK && memcmp(ro, ro2, (size_t)(tq * t->hq * t->dv) * 8) == 0,
                   "the reference differs between %s and contiguous layouts", lay ? "tiles" : "paged");
        free(ro2);
    }

    const size_t ob = (size_t)(tq * t->hq * t->dv) * esz(t->dt), lb = (size_t)(tq * t->hq) * 4;
    gbuf out = gbuf_new(ob + 1), lse = gbuf_new(lb + 1);
    fw_tensor o = fw_tensor_contiguous(out.p, t->dt, 3, os), l = fw_tensor_contiguous(lse.p, FW_F32, 2, ls);
    unsigned char *first = malloc(ob + 1), *firstl = malloc(lb + 1);
    for (int it = 0; it < 2 * fw_isa_count(); it++) {
        const char *isa = fw_isa_name(it / 2);
        const int prec = it % 2 ? FW_PREC_BF16 : FW_PREC_F32;
        if (!test_table(isa))
            continue;
        p.isa = isa;
        double err[2] = {0, 0}, lerr[2] = {0, 0};
        /* plain, then the kernel on 1 and 3 threads (contiguous), then paged, then paged with
         * vLLM's key layout (other kernels: the error bar, not the bits), then FW_KV_TILES
         * (the bits of the row layout with f32 products, which read the same rows; the bar
         * with bf16 products, whose tile kernels sum in their own order), then FW_KV_TILES
         * plain */
        for (int run = 0; run < 7; run++) {
            p.precision = run == 0 || run == 6 ? FW_PREC_F32 : prec;
            if (run >= 3 && !t->page)
                break;
            if (run >= 5 && !tiled)
                break;
            const cache_buf *src = run >= 5 ? &tiles : run == 4 ? &cols : run == 3 ? &pag : &cont;
            cache_buf work;
            cache_copy(&work, src);
            p.flags = run == 0 || run == 6 ? FW_ATTN_PLAIN : 0;
            p.threads = run == 2 ? 3 : (run == 0 ? 2 : 1);
            memset(out.p, 0xA5, out.bytes);
            memset(lse.p, 0xA5, lse.bytes);
            st = fw_attn_kvcache_fwd(&q, pk, pv, cuq, t->b, &work.c, &o, &l, &p);
            case_check(st == FW_OK, "[%s run %d] %s", isa, run, fw_last_error());
            case_check(gbuf_guards_ok(&out) && gbuf_guards_ok(&lse), "[%s run %d] output guards", isa, run);
            case_check(cache_image_ok(t, src, &work, pk, pv, cuq, run == 3, ds),
                       "[%s run %d] the cache after the call is not the expected image", isa, run);
            if (run <= 1) {
                err[run] = maxdiff(&o, ro, tq * t->hq * t->dv, 0);
                lerr[run] = maxdiff(&l, rl, tq * t->hq, 1);
            }
            if (run == 6) { /* the plain kernel on tiles: the plain kernel's error */
                const double e = maxdiff(&o, ro, tq * t->hq * t->dv, 0);
                case_check(e <= 2 * err[0] + 1e-5, "[%s] plain on FW_KV_TILES: out error %.3g > 2 x %.3g + 1e-5",
                           isa, e, err[0]);
            } else if (run == 5 && prec == FW_PREC_F32) {
                case_check(memcmp(first, out.p, ob) == 0 && memcmp(firstl, lse.p, lb) == 0,
                           "[%s prec %d] FW_KV_TILES differs bitwise from the row layout", isa, prec);
            } else if (run == 4 || run == 5) { /* within the kernel's bar, as run 1 */
                const double e = maxdiff(&o, ro, tq * t->hq * t->dv, 0);
                const double bar = prec == FW_PREC_BF16 ? 2 * sre + 1e-5 : 2 * err[0] + 1e-5;
                case_check(e <= bar, "[%s prec %d] %s: out error %.3g > %.3g", isa, prec,
                           run == 5 ? "FW_KV_TILES" : "vLLM's key layout", e, bar);
            } else if (run == 1) {
                memcpy(first, out.p, ob);
                memcpy(firstl, lse.p, lb);
            } else if (run >= 2) {
                case_check(memcmp(first, out.p, ob) == 0 && memcmp(firstl, lse.p, lb) == 0,
                           "[%s] %s differs bitwise", isa, run == 2 ? "3 threads vs 1" : "paged vs contiguous");
            }
            cache_copy_free(&work);
        }
        if (prec == FW_PREC_BF16) {
            case_check(err[1] <= 2 * sre + 1e-5, "[%s bf16 products] out error %.3g > 2 x same-roundings "
                       "%.3g + 1e-5", isa, err[1], sre);
            case_check(lerr[1] <= 2 * (srl + lerr[0]) + 1e-4, "[%s bf16 products] lse error %.3g > 2 x "
                       "(same-roundings %.3g + plain %.3g) + 1e-4", isa, lerr[1], srl, lerr[0]);
        } else {
            case_check(err[1] <= 2 * err[0] + 1e-5, "[%s] out error %.3g > 2 x plain %.3g + 1e-5", isa,
                       err[1], err[0]);
            case_check(lerr[1] <= 2 * lerr[0] + 1e-4, "[%s] lse error %.3g > 2 x plain %.3g + 1e-4", isa,
                       lerr[1], lerr[0]);
        }
    }
    free(first); free(firstl); free(ro); free(rl);
    gbuf_free(&out); gbuf_free(&lse); gbuf_free(&bq); gbuf_free(&bkn); gbuf_free(&bvn);
    cache_free(&cont);
    if (t->page) {
        cache_free(&pag);
        cache_free(&cols);
    }
    if (tiled)
        cache_free(&tiles);
    case_end();
}

static void sweep_kvcache(void)
{
    /* a ragged mix: decode, multi-token decode, chunked prefill, prefill after a prefix,
     * a sequence with no new token, and an empty one */
    static const int32_t old_mix[] = {700, 37, 1500, 0, 64, 0, 250};
    static const int32_t new_mix[] = {1, 4, 150, 90, 0, 0, 8};
    static const int64_t pages[] = {8, 24, 64, 1152, 1024, 3, 256}; /* 24, 1152, 3: not powers of two */
    static const int64_t R[][2] = {{8, 2}, {4, 1}, {6, 2}, {7, 7}, {16, 1}, {32, 8}, {1, 1}};
    for (int i = 0; i < 7; i++) {
        if (quick_mode() && i >= 5)
            break;
        kv_case t = {7, R[i][0], R[i][1], 64, i == 2 ? 48 : 64, pages[i], (fw_dtype)(i % 3), 1, 1, -1,
                     0.0f, old_mix, new_mix, 0, FW_F32, 0};
        if (i == 3) { t.wl = 100; t.softcap = 20.0f; }
        t.sinks = i % 2;
        run_kv_case(&t, 10 + i);
    }
    /* no append: attend to what is cached (non-causal too) */
    kv_case t = {7, 8, 2, 32, 32, 32, FW_BF16, 0, 0, -1, 0.0f, old_mix, new_mix, 0, FW_F32, 0};
    run_kv_case(&t, 20);
    /* FW_KV_TILES (vLLM's AMX cache): d 128 with 64-token pages, and 32-token pages (two to a
     * decode tile) over long contexts with a softcap and a window */
    kv_case tt = {7, 8, 2, 128, 128, 64, FW_BF16, 1, 1, -1, 0.0f, old_mix, new_mix, 0, FW_F32, 0};
    run_kv_case(&tt, 21);
    static const int32_t old_tl[] = {2999, 1023, 64, 0, 97};
    static const int32_t new_tl[] = {1, 1, 5, 1, 3};
    kv_case tl2 = {5, 8, 1, 64, 96, 32, FW_BF16, 1, 1, 700, 25.0f, old_tl, new_tl, 1, FW_F32, 0};
    run_kv_case(&tl2, 22);
    /* long contexts: decode over up to 5000 keys crosses the split size (512) many times */
    static const int32_t old_long[] = {5000, 4095, 4097, 0, 2000};
    static const int32_t new_long[] = {1, 1, 3, 1, 8};
    for (int i = 0; i < 3; i++) {
        if (quick_mode() && i)
            break;
        kv_case tl = {5, 8, 2, 64, 64, i == 0 ? 256 : 16, (fw_dtype)i, 1, 1, i == 2 ? 3000 : -1,
                      i == 1 ? 30.0f : 0.0f, old_long, new_long, i != 1, FW_F32, 0};
        run_kv_case(&tl, 30 + i);
    }
    /* more than FW_DEC_ROWS rows on one K/V head (MLA's shape: 32 heads on one): the tiled
     * path in key ranges (fw_attn_tile_splits), merged as a split decode's; with a window and
     * a softcap, and an fp8 cache */
    static const int32_t old_one[] = {5000, 1500, 4095, 0};
    static const int32_t new_one[] = {1, 2, 3, 1};
    kv_case t1 = {4, 32, 1, 96, 64, 64, FW_BF16, 1, 1, -1, 0.0f, old_one, new_one, 1, FW_F32, 0};
    run_kv_case(&t1, 33);
    if (!quick_mode()) {
        t1.wl = 2500;
        t1.softcap = 25.0f;
        t1.dt = FW_F32;
        t1.f8 = FW_F8E4M3;
        run_kv_case(&t1, 34);
    }
}

/* fp8 caches (e4m3, e5m2) with scalar and per-(sequence, head) descales: the ragged mix
 * (decode, chunked prefill, appends quantised), paged with odd page sizes, vLLM's key layout;
 * long contexts that split; q in each float dtype. */
static void sweep_kvcache_fp8(void)
{
    static const int32_t old_mix[] = {700, 37, 1500, 0, 64, 0, 250};
    static const int32_t new_mix[] = {1, 4, 150, 90, 0, 0, 8};
    static const int32_t old_long[] = {5000, 4095, 4097, 0, 2000};
    static const int32_t new_long[] = {1, 1, 3, 1, 8};
    for (int i = 0; i < 4; i++) {
        if (quick_mode() && i == 3)
            break;
        const fw_dtype f8 = i % 2 ? FW_F8E5M2 : FW_F8E4M3;
        kv_case t = {7, 8, 2, 64, 48, i == 1 ? 24 : 16, (fw_dtype)(i % 3), 1, 1, i == 2 ? 100 : -1,
                     i == 2 ? 20.0f : 0.0f, old_mix, new_mix, i == 3, f8, i % 2};
        run_kv_case(&t, 40 + i);
    }
    kv_case tl = {5, 8, 2, 128, 128, 64, FW_BF16, 1, 1, -1, 0.0f, old_long, new_long, 0, FW_F8E4M3, 1};
    run_kv_case(&tl, 45);
    tl.f8 = FW_F8E5M2;
    tl.dt = FW_F32;
    tl.desc_heads = 0;
    run_kv_case(&tl, 46);
}

/* The 8-bit floats: every byte of both types to f32 and back (e5m2's inf saturating to its
 * largest finite value), ties to even between neighbours, saturation, NaN; and every kernel
 * table's vector conversion (to_f32) of all 256 bytes equal to the scalar one. */
static void test_fp8_conversions(void)
{
    static const fw_dtype T[2] = {FW_F8E4M3, FW_F8E5M2};
    for (int t = 0; t < 2; t++) {
        const fw_dtype dt = T[t];
        const float top = dt == FW_F8E4M3 ? 448.0f : 57344.0f;
        const uint8_t topb = dt == FW_F8E4M3 ? 0x7e : 0x7b;
        case_begin("fp8 %s: round trips, ties to even, saturation, NaN", fw_dtype_name(dt));
        for (int b = 0; b < 256; b++) {
            const float x = fw_f8_to_f32((uint8_t)b, dt);
            if (isnan(x)) {
                case_check(isnan(fw_f8_to_f32(fw_f32_to_f8(x, dt), dt)), "byte 0x%02x: NaN lost", b);
                continue;
            }
            const uint8_t want = isinf(x) ? (uint8_t)((b & 0x80) | topb) : (uint8_t)b;
            case_check(fw_f32_to_f8(x, dt) == want, "byte 0x%02x (%g) back to 0x%02x", b, (double)x,
                       fw_f32_to_f8(x, dt));
            /* the midpoint to the next larger magnitude rounds to the even code of the two */
            const float y = fw_f8_to_f32((uint8_t)(b + 1), dt);
            if ((b & 0x7f) < topb && isfinite(y)) {
                const float mid = (x + y) / 2, e = fabsf(y - x) / 8;
                const uint8_t even = (uint8_t)(b % 2 ? b + 1 : b);
                case_check(fw_f32_to_f8(mid, dt) == even && fw_f32_to_f8(b & 0x80 ? mid + e : mid - e, dt) == b &&
                           fw_f32_to_f8(b & 0x80 ? mid - e : mid + e, dt) == b + 1,
                           "between 0x%02x and 0x%02x: mid %g -> 0x%02x", b, b + 1, (double)mid,
                           fw_f32_to_f8(mid, dt));
            }
        }
        case_check(fw_f8_to_f32(fw_f32_to_f8(1e30f, dt), dt) == top &&
                   fw_f8_to_f32(fw_f32_to_f8(-INFINITY, dt), dt) == -top &&
                   fw_f8_to_f32(fw_f32_to_f8(top * 1.0625f, dt), dt) == top,
                   "saturation: 1e30 -> %g", (double)fw_f8_to_f32(fw_f32_to_f8(1e30f, dt), dt));
        case_check(isnan(fw_f8_to_f32(0x7f, FW_F8E4M3)) && fw_f8_to_f32(0x01, FW_F8E4M3) == 0x1p-9f &&
                   fw_f8_to_f32(0x01, FW_F8E5M2) == 0x1p-16f && isinf(fw_f8_to_f32(0x7c, FW_F8E5M2)),
                   "e4m3 NaN, the smallest subnormals, e5m2 inf");
        case_check(isnan(fw_f8_to_f32(1, FW_BF16)) && fw_f32_to_f8(1.0f, FW_F16) == 0,
                   "a dtype that is not 8-bit: NaN and 0");
        case_end();
        uint8_t all[256];
        float ref[256], got[256];
        for (int b = 0; b < 256; b++) {
            all[b] = (uint8_t)b;
            ref[b] = fw_f8_to_f32((uint8_t)b, dt);
        }
        for (int i = 0; i < fw_isa_count(); i++) {
            const char *isa = fw_isa_name(i);
            if (!test_table(isa))
                continue;
            case_begin("fp8 %s: table %s converts all 256 bytes as the scalar code does", fw_dtype_name(dt), isa);
            const fw_kernels *kt = fw_kernels_get(isa);
            for (int64_t stride = 1; stride <= 2; stride++) {
                kt->cvt.to_f32(all, dt, stride, 256 / stride, 1.0f, got);
                for (int b = 0; b < 256 / stride; b++)
                    case_check(memcmp(&got[b], &ref[b * stride], 4) == 0 ||
                               (isnan(got[b]) && isnan(ref[b * stride])),
                               "stride %lld, byte 0x%02x: %g, scalar %g", (long long)stride,
                               (int)(b * stride), (double)got[b], (double)ref[b * stride]);
            }
            case_end();
        }
    }
}

/* Whether every byte of an output still holds the 0xA5 it was filled with. */
static int untouched(const gbuf *b)
{
    for (size_t i = 0; i < b->bytes; i++)
        if (((unsigned char *)b->p)[i] != 0xA5)
            return 0;
    return 1;
}

/* Bad input: a status with a message, and neither the cache nor the outputs touched. */
static void test_kvcache_bad_input(void)
{
    static const int32_t old[] = {20, 5}, nnew[] = {2, 3};
    kv_case t = {2, 4, 2, 16, 16, 8, FW_F32, 1, 1, -1, 0.0f, old, nnew, 0, FW_F32, 0};
    int32_t cuq[3] = {0, 2, 5}, seqlens[2] = {20, 5};
    cache_buf pag;
    cache_make(&pag, &t, 1, 32, seqlens, 5, 0);
    int64_t qs[3] = {5, 4, 16}, kns[3] = {5, 2, 16}, os[3] = {5, 4, 16}, ls[2] = {4, 5};
    float qd[5 * 4 * 16], kd[5 * 2 * 16], vd[5 * 2 * 16];
    for (int i = 0; i < 5 * 4 * 16; i++) qd[i] = (float)i / 100;
    for (int i = 0; i < 5 * 2 * 16; i++) kd[i] = vd[i] = (float)i / 50;
    fw_tensor q = fw_tensor_contiguous(qd, FW_F32, 3, qs), kn = fw_tensor_contiguous(kd, FW_F32, 3, kns),
              vn = fw_tensor_contiguous(vd, FW_F32, 3, kns);
    gbuf out = gbuf_new(5 * 4 * 16 * 4), lse = gbuf_new(4 * 5 * 4);
    fw_tensor o = fw_tensor_contiguous(out.p, FW_F32, 3, os), l = fw_tensor_contiguous(lse.p, FW_F32, 2, ls);
    cache_buf img; /* the cache before the calls */
    cache_copy(&img, &pag);
    fw_attn_params p;
    fw_attn_params_init(&p);
    p.causal = 1;
    struct {
        const char *what;
        fw_status want;
        int field;
    } bad[] = {
        {"page index out of range", FW_ERR_INDEX, 0}, {"negative page index", FW_ERR_INDEX, 1},
        {"context overflows its pages", FW_ERR_SEQLENS, 2}, {"negative seqlens", FW_ERR_SEQLENS, 3},
        {"heads mismatch", FW_ERR_SHAPE, 4}, {"page written by two sequences", FW_ERR_INDEX, 5},
        {"page size past 65536", FW_ERR_SHAPE, 6}, {"k_new without v_new", FW_ERR_NULL, 7},
        {"k_new dtype differs from the cache", FW_ERR_DTYPE, 8}, {"null block table row count", FW_ERR_ARG, 9},
        {"null seqlens", FW_ERR_NULL, 10}, {"null cache", FW_ERR_NULL, 11},
        {"cu_seqlens_q does not end at total_q", FW_ERR_SEQLENS, 12}, {"head dim mismatch", FW_ERR_SHAPE, 13},
        {"sinks of 3 values for 4 q heads", FW_ERR_SHAPE, 14},
        {"fp8 cache without descales", FW_ERR_NULL, 15}, {"fp8 cache, k_descale [2, 3] for 2 heads", FW_ERR_SHAPE, 16},
        {"descales on an f32 cache", FW_ERR_ARG, 17}, {"fp8 cache, a descale of 0", FW_ERR_ARG, 18},
        {"fp8 cache, k_new f32 and v_new bf16", FW_ERR_DTYPE, 19}, {"fp8 cache, descales f64", FW_ERR_DTYPE, 20},
        {"fp8 cache, a NaN descale", FW_ERR_ARG, 21},
    };
    float sv[4] = {0}, dsc[6] = {1, 1, 1, 1, 1, 1}, dzero[4] = {1, 0, 1, 1}, dnan[1] = {NAN};
    const int64_t n3 = 3, d23[2] = {2, 3}, d22[2] = {2, 2};
    fw_tensor ts3 = fw_tensor_contiguous(sv, FW_F32, 1, &n3);
    fw_tensor td23 = fw_tensor_contiguous(dsc, FW_F32, 2, d23), td22 = fw_tensor_contiguous(dsc, FW_F32, 2, d22);
    fw_tensor tdz = fw_tensor_contiguous(dzero, FW_F32, 2, d22), tdn = fw_tensor_contiguous(dnan, FW_F32, 0, &n3); /* rank 0: a scalar */
    fw_tensor td64 = td22;
    td64.dtype = FW_F64;
    for (size_t b = 0; b < sizeof bad / sizeof bad[0]; b++) {
        fw_kv_cache c = pag.c;
        int32_t bt[8], sl[2] = {20, 5}, cu2[3] = {0, 2, 4};
        memcpy(bt, pag.bt, sizeof(int32_t) * (size_t)(c.max_pages * 2));
        c.block_table = bt;
        c.seqlens = sl;
        const fw_tensor *pk = &kn, *pv = &vn;
        fw_tensor q2 = q, kn2 = kn;
        const int32_t *cu = cuq;
        const fw_kv_cache *pc = &c;
        switch (bad[b].field) {
        case 0: bt[1] = (int32_t)c.k.shape[0]; break;
        case 1: bt[0] = -1; break;
        case 2: sl[0] = 31; break;
        case 3: sl[1] = -2; break;
        case 4: q2.shape[1] = 3; break;
        case 5: bt[c.max_pages] = bt[2]; break; /* seq 1's page 0 is seq 0's page 2 (written: tokens 20-21) */
        case 6: /* a consistent [pages, 65537, hkv, d] view: pages past the largest */
            c.k.shape[1] = c.v.shape[1] = 65537;
            c.k.stride[0] = 65537 * c.k.stride[1];
            c.v.stride[0] = 65537 * c.v.stride[1];
            break;
        case 7: pv = NULL; break;
        case 8: kn2.dtype = FW_BF16; pk = &kn2; break;
        case 9: c.max_pages = 0; break;
        case 10: c.seqlens = NULL; break;
        case 11: pc = NULL; break;
        case 12: cu = cu2; break;
        case 13: q2.shape[2] = 8; break;
        case 14: p.sinks = &ts3; break;
        case 15: c.k.dtype = c.v.dtype = FW_F8E4M3; break;
        case 16: c.k.dtype = c.v.dtype = FW_F8E4M3; c.k_descale = &td23; c.v_descale = &td22; break;
        case 17: c.k_descale = c.v_descale = &td22; break;
        case 18: c.k.dtype = c.v.dtype = FW_F8E5M2; c.k_descale = &td22; c.v_descale = &tdz; break;
        case 19: c.k.dtype = c.v.dtype = FW_F8E4M3; c.k_descale = c.v_descale = &td22; kn2.dtype = FW_BF16;
                 pv = &kn2; break;
        case 20: c.k.dtype = c.v.dtype = FW_F8E4M3; c.k_descale = &td22; c.v_descale = &td64; break;
        case 21: c.k.dtype = c.v.dtype = FW_F8E4M3; c.k_descale = &tdn; c.v_descale = &td22; break;
        }
        memset(out.p, 0xA5, out.bytes);
        memset(lse.p, 0xA5, lse.bytes);
        fw_status st = fw_attn_kvcache_fwd(&q2, pk, pv, cu, 2, pc, &o, &l, &p);
        p.sinks = NULL;
        case_begin("kvcache bad input: %s", bad[b].what);
        case_check(st == bad[b].want, "status %s, expected %s (%s)", fw_status_string(st),
                   fw_status_string(bad[b].want), fw_last_error());
        case_check(strlen(fw_last_error()) > 10, "message \"%s\"", fw_last_error());
        case_check(cache_same(&img, &pag), "the cache changed");
        case_check(untouched(&out) && untouched(&lse), "outputs written");
        case_end();
    }
    cache_copy_free(&img);
    gbuf_free(&out);
    gbuf_free(&lse);
    cache_free(&pag);
}

/* FW_KV_TILES refused where it does not apply, with a status, a message and nothing written:
 * a layout value past the enum, a contiguous cache, another dtype, a page size or head dims
 * not multiples of 32, a (page, head) block that is not dense. */
static void test_tiles_bad_input(void)
{
    static const int32_t old[] = {40, 7}, nnew[] = {1, 2};
    kv_case t = {2, 4, 2, 32, 32, 32, FW_BF16, 1, 1, -1, 0.0f, old, nnew, 0, FW_F32, 0};
    int32_t cuq[3] = {0, 1, 3}, seqlens[2] = {40, 7};
    cache_buf tc;
    cache_make(&tc, &t, 1, 64, seqlens, 6, 2);
    int64_t qs[3] = {3, 4, 32}, kns[3] = {3, 2, 32}, ls[2] = {4, 3};
    gbuf bq = gbuf_new(3 * 4 * 32 * 2), bk = gbuf_new(3 * 2 * 32 * 2), bv = gbuf_new(3 * 2 * 32 * 2);
    gbuf out = gbuf_new(3 * 4 * 32 * 2), lse = gbuf_new(4 * 3 * 4);
    fw_tensor q = fw_tensor_contiguous(bq.p, FW_BF16, 3, qs), kn = fw_tensor_contiguous(bk.p, FW_BF16, 3, kns),
              vn = fw_tensor_contiguous(bv.p, FW_BF16, 3, kns), o = fw_tensor_contiguous(out.p, FW_BF16, 3, qs),
              l = fw_tensor_contiguous(lse.p, FW_F32, 2, ls);
    rng_seed(61);
    tfill_normal(&q, 1.0);
    tfill_normal(&kn, 1.0);
    tfill_normal(&vn, 1.0);
    cache_buf img; /* the cache before the calls */
    cache_copy(&img, &tc);
    fw_attn_params p;
    fw_attn_params_init(&p);
    p.causal = 1;
    struct {
        const char *what;
        fw_status want;
    } bad[] = {
        {"layout 2", FW_ERR_ARG}, {"contiguous", FW_ERR_ARG}, {"f16 cache", FW_ERR_DTYPE},
        {"page size 48", FW_ERR_SHAPE}, {"head dims 16", FW_ERR_SHAPE}, {"rows 2 d apart", FW_ERR_STRIDE},
    };
    for (int b = 0; b < (int)(sizeof bad / sizeof bad[0]); b++) {
        fw_kv_cache c = tc.c;
        fw_tensor q2 = q, kn2 = kn, vn2 = vn, o2 = o;
        switch (b) {
        case 0: c.layout = 2; break;
        case 1: c.block_table = NULL; break;
        case 2: c.k.dtype = c.v.dtype = q2.dtype = kn2.dtype = vn2.dtype = o2.dtype = FW_F16; break;
        case 3: /* a consistent view of larger pages (refused before anything is read) */
            c.k.shape[1] = c.v.shape[1] = 48;
            c.k.stride[2] = c.v.stride[2] = 48 * t.d;
            c.k.stride[0] = c.v.stride[0] = 48 * t.d * t.hkv;
            break;
        case 4: c.k.shape[3] = c.v.shape[3] = q2.shape[2] = kn2.shape[2] = vn2.shape[2] = o2.shape[2] = 16; break;
        default: /* rows 2 d apart, heads and pages as far apart again */
            c.k.stride[1] = 2 * t.d;
            c.k.stride[2] = 2 * t.d * t.page;
            c.k.stride[0] = 2 * t.d * t.page * t.hkv;
            break;
        }
        memset(out.p, 0xA5, out.bytes);
        memset(lse.p, 0xA5, lse.bytes);
        fw_status st = fw_attn_kvcache_fwd(&q2, &kn2, &vn2, cuq, 2, &c, &o2, &l, &p);
        case_begin("kvcache FW_KV_TILES bad input: %s", bad[b].what);
        case_check(st == bad[b].want, "status %s, expected %s (%s)", fw_status_string(st),
                   fw_status_string(bad[b].want), fw_last_error());
        case_check(strstr(fw_last_error(), b ? "FW_KV_TILES" : "layout") != NULL, "message \"%s\"",
                   fw_last_error());
        case_check(cache_same(&img, &tc), "the cache changed");
        case_check(untouched(&out) && untouched(&lse), "outputs written");
        case_end();
    }
    cache_copy_free(&img);
    gbuf_free(&bq); gbuf_free(&bk); gbuf_free(&bv); gbuf_free(&out); gbuf_free(&lse);
    cache_free(&tc);
}

/* flash-attn's cache_leftpad and cache_batch_idx (contiguous caches): per sequence, a batch
 * with leftpads, its sequences in cache entries 2, 0 and 3 of 4, gives the bits of a batch-1
 * call on its entry from its leftpad row on (the data pointer moved, seqlens less the leftpad,
 * the rotary tables moved as far), and the caches after both calls are alike (entry 1
 * untouched); the reference likewise, within 1e-12. Decode and 5-row chunks, with and without
 * appends and a rotary embedding, causal, windowed and neither, f32 and bf16, 1 and 3
 * threads; a leftpad of the whole context included. Leftpads out of range, entries out of
 * range or written twice, and either with a block table, are refused with nothing written. */
static void test_leftpad(void)
{
    enum { B = 3, E = 4, S = 48, HKV = 2, HQ = 8, D = 32, RO = 64 };
    static const int32_t old[B] = {30, 7, 41}, lp[B] = {9, 0, 41}, entry[B] = {2, 0, 3};
    float cosb[RO * D / 2], sinb[RO * D / 2];
    for (int t = 0; t < RO; t++)
        for (int i = 0; i < D / 2; i++) {
            cosb[t * D / 2 + i] = (float)cos(0.3 * t / (1 + i));
            sinb[t * D / 2 + i] = (float)sin(0.3 * t / (1 + i));
        }
    for (int cfg = 0; cfg < 2 * 2 * 2 * 3 * 2; cfg++) {
        const fw_dtype dt = cfg % 2 ? FW_BF16 : FW_F32;
        const int n = (cfg / 2) % 2 ? 5 : 1, append = (cfg / 4) % 2, mask = (cfg / 8) % 3;
        const int rot = append && (cfg / 24) % 2, threads = (cfg / 24) % 2 ? 3 : 1;
        const size_t es = fw_dtype_size(dt), cbytes = (size_t)E * S * HKV * D * es;
        const int64_t T = (int64_t)B * n;
        int64_t cs[4] = {E, S, HKV, D}, qs[3] = {T, HQ, D}, ns[3] = {T, HKV, D}, ls[2] = {HQ, T};
        unsigned char *ka = malloc(cbytes), *va = malloc(cbytes), *kb = malloc(cbytes), *vb = malloc(cbytes);
        void *qd = malloc((size_t)T * HQ * D * es), *knd = malloc((size_t)T * HKV * D * es),
             *vnd = malloc((size_t)T * HKV * D * es);
        float *oa = malloc(sizeof(float) * T * HQ * D), *ob = malloc(sizeof(float) * T * HQ * D);
        float *la = malloc(sizeof(float) * HQ * T), *lb = malloc(sizeof(float) * HQ * T);
        double *ra = malloc(sizeof(double) * T * HQ * D), *rb = malloc(sizeof(double) * T * HQ * D);
        fw_tensor tk = fw_tensor_contiguous(ka, dt, 4, cs), tv = fw_tensor_contiguous(va, dt, 4, cs);
        fw_tensor tq = fw_tensor_contiguous(qd, dt, 3, qs), tkn = fw_tensor_contiguous(knd, dt, 3, ns),
                  tvn = fw_tensor_contiguous(vnd, dt, 3, ns);
        rng_seed(91 + (uint64_t)cfg);
        tfill_normal(&tk, 1.0);
        tfill_normal(&tv, 1.0);
        tfill_normal(&tq, 1.0);
        tfill_normal(&tkn, 1.0);
        tfill_normal(&tvn, 1.0);
        memcpy(kb, ka, cbytes);
        memcpy(vb, va, cbytes);
        int32_t cu[B + 1], sl[B];
        for (int i = 0; i <= B; i++)
            cu[i] = i * n;
        memcpy(sl, old, sizeof sl);
        int64_t rs[2] = {RO, D / 2};
        fw_tensor tc = fw_tensor_contiguous(cosb, FW_F32, 2, rs), ts = fw_tensor_contiguous(sinb, FW_F32, 2, rs);
        fw_attn_params p;
        fw_attn_params_init(&p);
        p.causal = mask == 0;
        p.window_left = mask == 1 ? 4 : -1;
        p.window_right = mask == 1 ? 2 : -1;
        p.threads = threads;
        if (rot) {
            p.rotary_cos = &tc;
            p.rotary_sin = &ts;
        }
        fw_kv_cache c;
        memset(&c, 0, sizeof c);
        c.k = tk;
        c.v = tv;
        c.seqlens = sl;
        c.leftpad = lp;
        c.batch_idx = entry;
        int64_t os[3] = {T, HQ, D};
        fw_tensor to = fw_tensor_contiguous(oa, FW_F32, 3, os), tl = fw_tensor_contiguous(la, FW_F32, 2, ls);
        fw_tensor tr = fw_tensor_contiguous(ra, FW_F64, 3, os);
        const fw_tensor *pkn = append ? &tkn : NULL, *pvn = append ? &tvn : NULL;
        case_begin("kvcache leftpad and batch_idx: %s, %d rows, append %d, %s, rotary %d, %d threads",
                   dt == FW_F32 ? "f32" : "bf16", n, append, mask == 0 ? "causal" : mask == 1 ? "window" : "no mask",
                   rot, threads);
        fw_status st = fw_attn_kvcache_ref(&tq, pkn, pvn, cu, B, &c, &tr, NULL, &p);
        case_check(st == FW_OK, "reference: %s", fw_last_error());
        st = fw_attn_kvcache_fwd(&tq, pkn, pvn, cu, B, &c, &to, &tl, &p);
        case_check(st == FW_OK, "batch: %s", fw_last_error());
        for (int i = 0; i < B; i++) {
            int64_t cs1[4] = {1, S - lp[i], HKV, D}, qs1[3] = {n, HQ, D}, ns1[3] = {n, HKV, D}, os1[3] = {n, HQ, D},
                    ls1[2] = {HQ, n}, rs1[2] = {RO - lp[i], D / 2};
            const size_t row = ((size_t)entry[i] * S + (size_t)lp[i]) * HKV * D * es;
            fw_kv_cache c1;
            memset(&c1, 0, sizeof c1);
            c1.k = fw_tensor_contiguous(kb + row, dt, 4, cs1);
            c1.v = fw_tensor_contiguous(vb + row, dt, 4, cs1);
            int32_t sl1[1] = {old[i] - lp[i]}, cu1[2] = {0, n};
            c1.seqlens = sl1;
            fw_tensor q1 = fw_tensor_contiguous((char *)qd + (size_t)i * n * HQ * D * es, dt, 3, qs1);
            fw_tensor kn1 = fw_tensor_contiguous((char *)knd + (size_t)i * n * HKV * D * es, dt, 3, ns1);
            fw_tensor vn1 = fw_tensor_contiguous((char *)vnd + (size_t)i * n * HKV * D * es, dt, 3, ns1);
            fw_tensor o1 = fw_tensor_contiguous(ob + (size_t)i * n * HQ * D, FW_F32, 3, os1);
            fw_tensor r1 = fw_tensor_contiguous(rb + (size_t)i * n * HQ * D, FW_F64, 3, os1);
            float l1[HQ * 5];
            fw_tensor tl1 = fw_tensor_contiguous(l1, FW_F32, 2, ls1);
            fw_tensor c1c = fw_tensor_contiguous(cosb + (size_t)lp[i] * D / 2, FW_F32, 2, rs1),
                      c1s = fw_tensor_contiguous(sinb + (size_t)lp[i] * D / 2, FW_F32, 2, rs1);
            fw_attn_params p1 = p;
            if (rot) {
                p1.rotary_cos = &c1c;
                p1.rotary_sin = &c1s;
            }
            st = fw_attn_kvcache_ref(&q1, append ? &kn1 : NULL, append ? &vn1 : NULL, cu1, 1, &c1, &r1, NULL, &p1);
            case_check(st == FW_OK, "reference, sequence %d: %s", i, fw_last_error());
            st = fw_attn_kvcache_fwd(&q1, append ? &kn1 : NULL, append ? &vn1 : NULL, cu1, 1, &c1, &o1, &tl1, &p1);
            case_check(st == FW_OK, "sequence %d: %s", i, fw_last_error());
            for (int h = 0; h < HQ; h++)
                for (int r = 0; r < n; r++)
                    lb[h * T + i * n + r] = l1[h * n + r];
        }
        double rd = 0.0;
        for (int64_t x = 0; x < T * HQ * D; x++)
            rd = fmax(rd, fabs(ra[x] - rb[x]));
        case_check(rd <= 1e-12, "reference differs from the shifted calls' by %g", rd);
        case_check(!memcmp(oa, ob, sizeof(float) * T * HQ * D) && !memcmp(la, lb, sizeof(float) * HQ * T),
                   "out or lse differ from the shifted calls'");
        case_check(!memcmp(ka, kb, cbytes) && !memcmp(va, vb, cbytes), "caches differ after the calls");
        double err = 0.0;
        for (int64_t x = 0; x < T * HQ * D; x++)
            err = fmax(err, fabs(oa[x] - ra[x]));
        case_check(err <= (dt == FW_F32 ? 1e-5 : 3e-2), "error %g against the reference", err);
        /* leftpads and entries out of range, an entry written twice, and a block table with
         * either: refused, nothing written */
        int32_t badlp[B], bad_entry[B], bt[B] = {0, 1, 2};
        for (int k2 = 0; k2 < 7 && cfg == 0; k2++) {
            memcpy(badlp, lp, sizeof badlp);
            memcpy(bad_entry, entry, sizeof bad_entry);
            fw_kv_cache cb2 = c;
            cb2.leftpad = badlp;
            cb2.batch_idx = bad_entry;
            if (k2 == 0)
                badlp[1] = old[1] + 1;
            else if (k2 == 1)
                badlp[2] = -1;
            else if (k2 == 2 || k2 == 6) {
                cb2.block_table = bt;
                cb2.max_pages = 1;
                if (k2 == 6)
                    cb2.leftpad = NULL;
            } else if (k2 == 3)
                bad_entry[0] = E;
            else if (k2 == 4)
                bad_entry[2] = -1;
            else
                bad_entry[1] = entry[0]; /* both append */
            memset(oa, 0xA5, sizeof(float) * T * HQ * D);
            unsigned char *kimg = malloc(cbytes);
            memcpy(kimg, ka, cbytes);
            st = fw_attn_kvcache_fwd(&tq, &tkn, &tvn, cu, B, &cb2, &to, NULL, &p);
            const fw_status want = k2 == 2 || k2 == 6 ? FW_ERR_ARG : k2 < 2 ? FW_ERR_SEQLENS : FW_ERR_INDEX;
            case_check(st == want, "bad leftpad %d: status %s (%s)", k2, fw_status_string(st), fw_last_error());
            case_check(strstr(fw_last_error(), k2 < 3 ? "leftpad" : "batch_idx") != NULL, "message \"%s\"",
                       fw_last_error());
            int clean = !memcmp(kimg, ka, cbytes);
            for (size_t x = 0; x < sizeof(float) * T * HQ * D; x++)
                clean &= ((unsigned char *)oa)[x] == 0xA5;
            case_check(clean, "bad leftpad %d: something was written", k2);
            free(kimg);
        }
        case_end();
        free(ka); free(va); free(kb); free(vb); free(qd); free(knd); free(vnd);
        free(oa); free(ob); free(la); free(lb); free(ra); free(rb);
    }
}

static void test_split_heuristic(void)
{
    case_begin("split-KV heuristic");
    /* one K/V group: ranges of 256 keys up to 512, 512 past it */
    case_check(fw_attn_kv_splits(32768, 1) == 64, "32K keys");
    case_check(fw_attn_kv_splits(2048, 1) == 4, "2K keys");
    case_check(fw_attn_kv_splits(512, 1) == 2 && fw_attn_kv_split_keys(512, 1) == 256, "512 keys: two of 256");
    case_check(fw_attn_kv_splits(257, 1) == 2, "256 + 1 keys");
    case_check(fw_attn_kv_splits(256, 1) == 1, "256 keys");
    case_check(fw_attn_kv_splits(513, 1) == 2 && fw_attn_kv_split_keys(513, 1) == 512, "512 + 1 keys: two of 512");
    case_check(fw_attn_kv_splits(1024, 1) == 2, "1K keys");
    case_check(fw_attn_kv_splits(0, 1) == 1, "no keys");
    /* two groups or more: one range up to 1K keys (the heads spread instead), as above past it */
    case_check(fw_attn_kv_splits(1024, 8) == 1 && fw_attn_kv_split_keys(1024, 8) == 1024, "1K keys, 8 heads");
    case_check(fw_attn_kv_splits(700, 2) == 1 && fw_attn_kv_splits(1, 2) == 1, "700 and 1 keys, 2 heads");
    case_check(fw_attn_kv_splits(1025, 8) == 3 && fw_attn_kv_split_keys(1025, 8) == 512, "1K + 1 keys, 8 heads");
    case_check(fw_attn_kv_splits(32768, 8) == 64, "32K keys, 8 heads");
    case_check(fw_attn_kv_splits(0, 8) == 1 && fw_attn_kv_split_keys(0, 8) == 1, "no keys, 8 heads");
    case_end();
    case_begin("tiled split heuristic");
    case_check(fw_attn_tile_splits(32768, 1) == 16 && fw_attn_tile_split_keys(32768, 1) == 2048,
               "MLA's one q tile at 32K keys: 16 ranges of 2048");
    case_check(fw_attn_tile_splits(4096, 1) == 4 && fw_attn_tile_split_keys(4096, 1) == 1024, "4K keys: 4 of 1024");
    case_check(fw_attn_tile_splits(32768, 8) == 2 && fw_attn_tile_split_keys(32768, 8) == 16384, "8 items: 2 ranges");
    case_check(fw_attn_tile_splits(32768, 3) == 6 && fw_attn_tile_split_keys(32768, 3) == 5632, "3 items: 6 ranges of 5632");
    case_check(fw_attn_tile_splits(5000, 2) == 5 && fw_attn_tile_split_keys(5000, 2) == 1024, "5000 keys, 2 items");
    case_check(fw_attn_tile_splits(1024, 1) == 1 && fw_attn_tile_split_keys(1024, 1) == 1024, "up to 1K keys: one");
    case_check(fw_attn_tile_splits(1025, 1) == 2, "1K + 1 keys: two");
    case_check(fw_attn_tile_splits(1 << 20, 16) == 1 && fw_attn_tile_splits(1 << 20, 100) == 1, "16 items: one");
    case_check(fw_attn_tile_splits(0, 1) == 1 && fw_attn_tile_split_keys(0, 1) == 1, "no keys");
    case_check(fw_attn_tile_splits(32768, 0) == 1 && fw_attn_tile_split_keys(32768, 0) == 32768,
               "no items (no queries): one range");
    int whole = 1;
    for (int64_t sk = 1; sk <= 40000; sk += 37)
        for (int64_t n = 1; n <= 17; n++) {
            const int64_t keys = fw_attn_tile_split_keys(sk, n), ns = fw_attn_tile_splits(sk, n);
            whole &= (ns == 1 || keys % FW_KV_SPLIT == 0) && (ns - 1) * keys < sk && ns * keys >= sk;
        }
    case_check(whole, "ranges are whole multiples of FW_KV_SPLIT keys, none empty, covering every key");
    case_end();
    case_begin("decode head-group heuristic");
    case_check(fw_attn_dec_groups(8, 1, 2) == 2, "8 heads, 1 item, 2 threads: 2 groups");
    case_check(fw_attn_dec_groups(8, 1, 3) == 3, "3 threads: 3 groups (3, 3, 2)");
    case_check(fw_attn_dec_groups(8, 1, 7) == 4, "7 threads: 4 groups of 2");
    case_check(fw_attn_dec_groups(8, 1, 64) == 8, "64 threads: one head a group");
    case_check(fw_attn_dec_groups(8, 3, 8) == 3, "3 items, 8 threads: 3 groups");
    case_check(fw_attn_dec_groups(8, 2, 2) == 1 && fw_attn_dec_groups(8, 16, 2) == 1, "items enough");
    case_check(fw_attn_dec_groups(1, 1, 8) == 1 && fw_attn_dec_groups(0, 0, 8) == 1, "one or no unit");
    case_check(fw_attn_dec_groups(8, 1, 1) == 1, "one thread");
    /* every group non-empty: ceil(units / groups) x (groups - 1) < units */
    int ok = 1;
    for (int64_t u = 1; u <= 40; u++)
        for (int t = 1; t <= 70; t++) {
            const int64_t g = fw_attn_dec_groups(u, 1, t), per = (u + g - 1) / g;
            ok &= g >= 1 && g <= u && per * (g - 1) < u && (t <= 1 || u < 2 || g >= 2);
        }
    case_check(ok, "every group non-empty for 1-40 heads and 1-70 threads");
    case_end();
}

const test_suite kvcache_suites[] = {
    {"kvcache.split_heuristic", test_split_heuristic},
    {"kvcache.leftpad", test_leftpad},
    {"kvcache.bad_input", test_kvcache_bad_input},
    {"kvcache.tiles_bad_input", test_tiles_bad_input},
    {"kvcache.sweep", sweep_kvcache},
    {"kvcache.sweep_fp8", sweep_kvcache_fp8},
    {"kvcache.fp8_conversions", test_fp8_conversions},
    {NULL, NULL}};
