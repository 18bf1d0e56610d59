/* test_util.h: the harness's shared pieces: a tally of cases, guarded buffers, random data. */
#ifndef FW_TEST_UTIL_H
#define FW_TEST_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include "flywheel.h"

/* A case passes when every check inside it passes. */
void case_begin(const char *fmt, ...);
void case_check(int ok, const char *fmt, ...);
int case_end(void); /* returns 1 if the case passed */
void tally_print(void);
int tally_failed(void);
int quick_mode(void); /* FW_TEST_QUICK=1: the smaller sweep for sanitizer builds */
/* FW_TEST_TABLES=NAMES: the kernel tables the tests run calls on, comma-separated table names
 * or "default" (the default table); unset or empty: every table this CPU runs. tables_check
 * returns 0 (having said why) for a name that is no table or a list this CPU runs none of;
 * test_table says whether the tests run name (this CPU runs it, and the list names it). */
int tables_check(void);
int test_table(const char *name);

/* A named suite of cases, "group.name" (test_flywheel --list prints them, --filter picks
 * some). Each test file has one NULL-terminated array per group; suites do not depend on
 * each other, so any subset runs in any order. */
typedef struct {
    const char *name;
    void (*run)(void);
} test_suite;
extern const test_suite attn_suites[], attn_bwd_suites[], rotary_suites[], kvcache_suites[],
    gdn_suites[], layer_suites[], nan_suites[],
    conv_suites[];

/* A buffer with GUARD sentinel bytes on both sides; the body is filled with a sentinel too,
 * so a test can tell which bytes a call wrote. */
#define GUARD 64
typedef struct {
    unsigned char *base;
    void *p;
    size_t bytes;
} gbuf;
gbuf gbuf_new(size_t bytes);
void gbuf_free(gbuf *b);
int gbuf_guards_ok(const gbuf *b);

/* max(worst, e) where a NaN e counts as infinitely wrong: fmax(worst, NaN) is worst, so a
 * check on fmax's result passed a NaN output. */
double worse(double worst, double e);

/* Deterministic random numbers. */
void rng_seed(uint64_t s);
double rng_uniform(void);  /* [0, 1) */
double rng_normal(void);

/* Element get/set of any dtype. */
double tget(const fw_tensor *t, const int64_t *idx);
void tset(const fw_tensor *t, const int64_t *idx, double x);
int64_t toffset(const fw_tensor *t, const int64_t *idx);
/* Iterate over every index of t: returns 0 when done. */
int tnext(const fw_tensor *t, int64_t *idx);
/* x rounded to dt (f32, bf16 or f16; f64 unchanged), nearest even. */
double round_to(fw_dtype dt, double x);
/* The error of the same-roundings reference of bf16 products (so, sl: its out rounded here to
 * dt, and its lse) against the exact one (ro, rl): max |difference| over no outputs and nl
 * lse values, equal infinities counting as 0. */
void sr_errors(const double *so, const double *sl, const double *ro, const double *rl, int64_t no,
               int64_t nl, fw_dtype dt, double *eo, double *el);
/* Store x rounded to t's dtype (values are rounded to the dtype first, so every table sees
 * exactly the same inputs). */
void tfill_normal(const fw_tensor *t, double scale);

/* A 4-D view [a, b, c, e] whose memory order is given by `perm` (perm[0] outermost) with
 * `pad` extra elements after each innermost run and a last-dim stride of `es`; *extent: the
 * elements it spans. */
fw_tensor tview4(void *data, fw_dtype dt, const int64_t *shape, const int *perm, int64_t pad,
                 int64_t es, int64_t *extent);
/* Every byte of b that is not an element of t still holds the sentinel 0xA5, guards too. */
int tuntouched(const gbuf *b, const fw_tensor *t);

#endif
