/* ref/gdn_ref.c: the float64 references of Gated DeltaNet and KDA (fw_gdn_ref): the plain
 * recurrence token by token, and with bf16 products the chunked pass in double with the
 * kernel's roundings and no others. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "../gdn/gdn.h"

/* Element (i, j, x) of a 3-D tensor, in double, and the store back. */
static int64_t off3(const fw_tensor *t, int64_t i, int64_t j, int64_t x)
{
    return i * t->stride[0] + j * t->stride[1] + x * t->stride[2];
}

/* x rounded to bf16 (nearest even). */
static double rb(double x) { return (double)fw_cvt_bf16_f32(fw_cvt_f32_bf16((float)x)); }

/* The normalised row (l2: x / sqrt(|x|^2 + eps)) of token t, head hh of x, in double. */
static void ref_row(const gdn_prob *p, const fw_tensor *x, int64_t t, int64_t hh, double *dst)
{
    double n = 0;
    for (int64_t i = 0; i < p->dk; i++) {
        dst[i] = fw_load_f64(x, off3(x, t, hh, i));
        n += dst[i] * dst[i];
    }
    const double s = p->l2 ? 1.0 / sqrt(n + p->eps) : 1.0;
    for (int64_t i = 0; i < p->dk; i++)
        dst[i] *= s;
}

/* The scratch of gdn_ref_bf16: the state h and its bf16 hb [dk][dv]; per row i of a chunk
 * the normalised K^ and Q^ (Kh, Qh), their bf16 (Kb, Qb), Wb and the cumulative log decays
 * Gc [C][dk]; U and Deltab (Db) [C][dv]; T and Gb [C][C]; one row; the rows' beta. */
typedef struct {
    double *h, *hb, *Kh, *Kb, *Qh, *Qb, *Wb, *Gc, *U, *Db, *T, *Gb, *row;
    double bet[GDN_C];
} ref_chunk;

static void ref_chunk_free(ref_chunk *w)
{
    free(w->h); free(w->hb); free(w->Kh); free(w->Kb); free(w->Qh); free(w->Qb); free(w->Wb); free(w->Gc);
    free(w->U); free(w->Db); free(w->T); free(w->Gb); free(w->row);
}

/* 0, or 1 with nothing left allocated. */
static int ref_chunk_alloc(const gdn_prob *p, ref_chunk *w)
{
    const int64_t C = GDN_C, dk = p->dk, dv = p->dv;
    w->h = malloc(sizeof(double) * (size_t)(dk * dv)); w->hb = malloc(sizeof(double) * (size_t)(dk * dv));
    w->Kh = malloc(sizeof(double) * (size_t)(C * dk)); w->Kb = malloc(sizeof(double) * (size_t)(C * dk));
    w->Qh = malloc(sizeof(double) * (size_t)(C * dk)); w->Qb = malloc(sizeof(double) * (size_t)(C * dk));
    w->Wb = malloc(sizeof(double) * (size_t)(C * dk)); w->Gc = malloc(sizeof(double) * (size_t)(C * dk));
    w->U = malloc(sizeof(double) * (size_t)(C * dv)); w->Db = malloc(sizeof(double) * (size_t)(C * dv));
    w->T = malloc(sizeof(double) * (size_t)(C * C)); w->Gb = malloc(sizeof(double) * (size_t)(C * C));
    w->row = malloc(sizeof(double) * (size_t)(dk > dv ? dk : dv));
    if (w->h && w->hb && w->Kh && w->Kb && w->Qh && w->Qb && w->Wb && w->Gc && w->U && w->Db && w->T && w->Gb &&
        w->row)
        return 0;
    ref_chunk_free(w);
    return 1;
}

/* Rows t0 .. t0 + L - 1 of value head vh (q/k head hh): K^, Q^ and their bf16, the log
 * decays cumulative from the chunk's start, beta. */
static void ref_chunk_load(const gdn_prob *p, ref_chunk *w, int64_t t0, int64_t L, int64_t vh, int64_t hh)
{
    const int64_t dk = p->dk;
    for (int64_t i = 0; i < L; i++) {
        ref_row(p, p->k, t0 + i, hh, w->Kh + i * dk);
        ref_row(p, p->q, t0 + i, hh, w->Qh + i * dk);
        for (int64_t x = 0; x < dk; x++) {
            w->Kb[i * dk + x] = rb(w->Kh[i * dk + x]);
            w->Qb[i * dk + x] = rb(w->Qh[i * dk + x]);
            w->Gc[i * dk + x] = (i ? w->Gc[(i - 1) * dk + x] : 0.0) + gate_g_at(p, t0 + i, vh, p->kda ? x : 0);
        }
        w->bet[i] = gate_beta(p, t0 + i, vh);
    }
}

/* T = (I + A)^-1 by rows, rounded to bf16 (only the L x L block is set), and Gb. */
static void ref_chunk_inverse(const gdn_prob *p, ref_chunk *w, int64_t L)
{
    const int64_t C = GDN_C, dk = p->dk;
    const double *Ka = p->kda ? w->Kh : w->Kb, *Qa = p->kda ? w->Qh : w->Qb, *Gc = w->Gc;
    double *T = w->T, *Gb = w->Gb;
    for (int64_t i = 0; i < L; i++) {
        double a[GDN_C];
        for (int64_t j = 0; j <= i; j++) {
            double kk = 0, qk = 0;
            for (int64_t x = 0; x < dk; x++) {
                const double d = p->kda ? exp(Gc[i * dk + x] - Gc[j * dk + x]) : 1.0;
                kk += Ka[i * dk + x] * Ka[j * dk + x] * d;
                qk += Qa[i * dk + x] * Ka[j * dk + x] * d;
            }
            const double d = p->kda ? 1.0 : exp(Gc[i * dk] - Gc[j * dk]);
            a[j] = w->bet[i] * d * kk;
            Gb[i * C + j] = rb(d * qk);
        }
        for (int64_t j = i + 1; j < L; j++)
            Gb[i * C + j] = 0.0;
        for (int64_t j = 0; j < L; j++) {
            double v = i == j;
            for (int64_t m = j; m < i; m++)
                v -= a[m] * T[m * C + j];
            T[i * C + j] = j <= i ? v : 0.0;
        }
    }
    for (int64_t i = 0; i < L; i++)
        for (int64_t j = 0; j < L; j++)
            T[i * C + j] = rb(T[i * C + j]);
}

/* [W | U] = Tb [beta e^G o K^ | beta V]b of rows t0 .. t0 + L - 1 of value head vh; Wb. */
static void ref_chunk_wu(const gdn_prob *p, ref_chunk *w, int64_t t0, int64_t L, int64_t vh)
{
    const int64_t C = GDN_C, dk = p->dk, dv = p->dv;
    double *Wb = w->Wb, *U = w->U, *row = w->row;
    for (int64_t i = 0; i < L; i++) {
        for (int64_t x = 0; x < dk; x++)
            Wb[i * dk + x] = 0;
        for (int64_t y = 0; y < dv; y++)
            U[i * dv + y] = 0;
    }
    for (int64_t j = 0; j < L; j++) {
        for (int64_t x = 0; x < dk; x++)
            row[x] = rb(w->bet[j] * exp(w->Gc[j * dk + x]) * w->Kh[j * dk + x]);
        for (int64_t i = j; i < L; i++)
            for (int64_t x = 0; x < dk; x++)
                Wb[i * dk + x] += w->T[i * C + j] * row[x];
        for (int64_t y = 0; y < dv; y++)
            row[y] = rb(w->bet[j] * fw_load_f64(p->v, off3(p->v, t0 + j, vh, y)));
        for (int64_t i = j; i < L; i++)
            for (int64_t y = 0; y < dv; y++)
                U[i * dv + y] += w->T[i * C + j] * row[y];
    }
    for (int64_t i = 0; i < L * dk; i++)
        Wb[i] = rb(Wb[i]);
}

/* hb = (h)b; Deltab = (U - Wb hb)b; out rows t0 .. t0 + L - 1 of value head vh:
 * O = scale (qh + Gb Deltab). */
static void ref_chunk_out(const gdn_prob *p, ref_chunk *w, int64_t t0, int64_t L, int64_t vh)
{
    const int64_t C = GDN_C, dk = p->dk, dv = p->dv;
    double *hb = w->hb, *Db = w->Db, *row = w->row;
    for (int64_t x = 0; x < dk * dv; x++)
        hb[x] = rb(w->h[x]);
    for (int64_t i = 0; i < L; i++)
        for (int64_t y = 0; y < dv; y++) {
            double wh = 0;
            for (int64_t x = 0; x < dk; x++)
                wh += w->Wb[i * dk + x] * hb[x * dv + y];
            Db[i * dv + y] = rb(w->U[i * dv + y] - wh);
        }
    for (int64_t i = 0; i < L; i++) {
        if (p->kda) /* (e^G o Q^)b */
            for (int64_t x = 0; x < dk; x++)
                row[x] = rb(exp(w->Gc[i * dk + x]) * w->Qh[i * dk + x]);
        for (int64_t y = 0; y < dv; y++) {
            double qh = 0, gd = 0;
            for (int64_t x = 0; x < dk; x++)
                qh += (p->kda ? row[x] : w->Qb[i * dk + x]) * hb[x * dv + y];
            if (!p->kda)
                qh *= exp(w->Gc[i * dk]);
            for (int64_t j = 0; j <= i; j++)
                gd += w->Gb[i * C + j] * Db[j * dv + y];
            fw_store_f64(p->out, off3(p->out, t0 + i, vh, y), p->scale * (qh + gd));
        }
    }
}

/* h <- e^G_last o h + sum_i (e^(G_last - G_i) o K^_i)b^T Deltab_i over the chunk's L rows. */
static void ref_chunk_state(const gdn_prob *p, ref_chunk *w, int64_t L)
{
    const int64_t dk = p->dk, dv = p->dv;
    const double *Gl = w->Gc + (L - 1) * dk;
    double *h = w->h;
    for (int64_t x = 0; x < dk; x++) {
        const double al = exp(Gl[x]);
        for (int64_t y = 0; y < dv; y++)
            h[x * dv + y] *= al;
    }
    for (int64_t i = 0; i < L; i++)
        for (int64_t x = 0; x < dk; x++) {
            const double kx = rb(exp(Gl[x] - w->Gc[i * dk + x]) * w->Kh[i * dk + x]);
            for (int64_t y = 0; y < dv; y++)
                h[x * dv + y] += kx * w->Db[i * dv + y];
        }
}

/* Same-roundings reference of the chunked pass on bf16 products: chunks of 64 tokens from each
 * sequence's start, every product in double, and the roundings of gdn_chunk_bf16 (gdn/chunk.c,
 * its comment) and no others. One (sequence, value head) at a time. With G the cumulative log
 * decay of a row per key channel (GDN: the same in every channel) and Ka, Qa the operands of
 * A and of the gated QK (GDN: Kb, Qb; KDA: K^, Q^ unrounded, its f32 products):
 *   A_ij = beta_i sum_x Ka_ix Ka_jx e^(G_ix - G_jx) (j < i),  Gb = (sum_x Qa_ix Ka_jx e^(G_ix - G_jx))b
 *   O = scale (qh + Gb Deltab), qh = e^G_i Qb hb (GDN) or (e^G o Q^)b hb (KDA). */
static fw_status gdn_ref_bf16(const gdn_prob *p, const float *init, double *final)
{
    const int64_t C = GDN_C, dk = p->dk, dv = p->dv;
    ref_chunk w;
    if (ref_chunk_alloc(p, &w))
        return fw_fail(FW_ERR_NOMEM, "cannot allocate the reference state");
    for (int64_t s = 0; s < p->n; s++)
        for (int64_t vh = 0; vh < p->HV; vh++) {
            for (int64_t x = 0; x < dk * dv; x++)
                w.h[x] = init ? init[state_off(p, s, vh) + x] : 0.0;
            for (int64_t t0 = p->cu[s]; t0 < p->cu[s + 1]; t0 += C) {
                const int64_t L = fw_min64(C, p->cu[s + 1] - t0);
                ref_chunk_load(p, &w, t0, L, vh, vh / p->r);
                ref_chunk_inverse(p, &w, L);
                ref_chunk_wu(p, &w, t0, L, vh);
                ref_chunk_out(p, &w, t0, L, vh);
                ref_chunk_state(p, &w, L);
            }
            if (final)
                memcpy(final + state_off(p, s, vh), w.h, sizeof(double) * (size_t)(dk * dv));
        }
    ref_chunk_free(&w);
    return FW_OK;
}

fw_status fw_gdn_ref(const fw_tensor *q, const fw_tensor *k, const fw_tensor *v, const fw_tensor *g,
                     const fw_tensor *beta, const int32_t *cu_seqlens, int64_t n_seqs,
                     const float *initial_state, double *final_state, const fw_tensor *out,
                     const fw_gdn_params *params)
{
    fw_clear_error();
    gdn_prob p;
    fw_status s = fw_gdn_check(&p, q, k, v, g, beta, cu_seqlens, n_seqs, 1, out, params, 1);
    if (s)
        return s;
    if (p.bf16 && !(params && params->flags & (FW_GDN_RECURRENT | FW_GDN_FUSED_RECURRENT)))
        return gdn_ref_bf16(&p, initial_state, final_state);
    const int64_t dk = p.dk, dv = p.dv;
    double *h = malloc(sizeof(double) * (size_t)(dk * dv)), *qq = malloc(sizeof(double) * (size_t)dk),
           *kk = malloc(sizeof(double) * (size_t)dk), *a = malloc(sizeof(double) * (size_t)dv),
           *al = malloc(sizeof(double) * (size_t)dk);
    if (!h || !qq || !kk || !a || !al) {
        free(h); free(qq); free(kk); free(a); free(al);
        return fw_fail(FW_ERR_NOMEM, "cannot allocate the reference state");
    }
    for (int64_t i = 0; i < n_seqs; i++)
        for (int64_t vh = 0; vh < p.HV; vh++) {
            const int64_t hh = vh / p.r;
            for (int64_t x = 0; x < dk * dv; x++)
                h[x] = initial_state ? initial_state[state_off(&p, i, vh) + x] : 0.0;
            for (int64_t t = cu_seqlens[i]; t < cu_seqlens[i + 1]; t++) {
                double nq = 0, nk = 0;
                for (int64_t x = 0; x < dk; x++) {
                    qq[x] = fw_load_f64(q, off3(q, t, hh, x));
                    kk[x] = fw_load_f64(k, off3(k, t, hh, x));
                    nq += qq[x] * qq[x];
                    nk += kk[x] * kk[x];
                }
                const double sq = p.scale / (p.l2 ? sqrt(nq + p.eps) : 1.0), sk = p.l2 ? 1.0 / sqrt(nk + p.eps) : 1.0;
                for (int64_t x = 0; x < dk; x++) {
                    qq[x] *= sq;
                    kk[x] *= sk;
                }
                /* the decay of each state row: one per key channel (KDA) or one for all */
                for (int64_t x = 0; x < dk; x++)
                    al[x] = p.kda || x == 0 ? exp((double)gate_g_at(&p, t, vh, x)) : al[0];
                const double be = gate_beta(&p, t, vh);
                for (int64_t y = 0; y < dv; y++) {
                    double acc = 0;
                    for (int64_t x = 0; x < dk; x++)
                        acc += al[x] * h[x * dv + y] * kk[x];
                    a[y] = be * (fw_load_f64(v, off3(v, t, vh, y)) - acc); /* delta */
                }
                for (int64_t x = 0; x < dk; x++)
                    for (int64_t y = 0; y < dv; y++)
                        h[x * dv + y] = al[x] * h[x * dv + y] + kk[x] * a[y];
                for (int64_t y = 0; y < dv; y++) {
                    double o = 0;
                    for (int64_t x = 0; x < dk; x++)
                        o += h[x * dv + y] * qq[x];
                    fw_store_f64(out, off3(out, t, vh, y), o);
                }
            }
            if (final_state)
                memcpy(final_state + state_off(&p, i, vh), h, sizeof(double) * (size_t)(dk * dv));
        }
    free(h); free(qq); free(kk); free(a); free(al);
    return FW_OK;
}
