/*
 * fuzz_util.h: what the libFuzzer harnesses share. Each harness decodes a structured problem
 * from the fuzzer's bytes (sizes, layouts, dtypes, indices, value classes), calls the library
 * and checks its contract:
 *   - never a crash, hang or sanitizer report (the sanitizers and libFuzzer catch those);
 *   - a problem the harness broke on purpose (a negative or overflowing stride, a bad dtype,
 *     rank or size, a NULL pointer, an index out of range, ...) is refused;
 *   - on any error, every output and cache byte is untouched;
 *   - on FW_OK, the result agrees with the float64 reference (fz_close) when the inputs are
 *     moderate and finite, and NaN reaches at least the rows the reference says it reaches.
 * A failed check prints what differed and aborts, which libFuzzer reports as a crash and saves
 * as an input to replay.
 * Inputs past the end of the bytes read as zeros, so a short input is a small, valid problem.
 */
#ifndef FW_FUZZ_UTIL_H
#define FW_FUZZ_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include "flywheel.h"

typedef struct {
    const uint8_t *p;
    size_t n;
    int broken; /* a tensor was broken: at most one per problem, else two tensors broken the
                   same way (one dimension off by one in both) could make a valid problem */
} fz_in;

unsigned fz_byte(fz_in *in);
/* A value in [lo, hi] (two bytes when the range needs them); lo when hi <= lo. */
int64_t fz_range(fz_in *in, int64_t lo, int64_t hi);
/* 1 with probability num/256. */
int fz_chance(fz_in *in, unsigned num);
/* A size: mostly small (0..small), one time in 32 up to big. */
int64_t fz_size(fz_in *in, int64_t small, int64_t big);

/* How the values of an input are drawn. */
enum {
    FZ_MODERATE = 0, /* uniform, mean 0 and std `scale` <= 3: the result is checked against the reference */
    FZ_SPECIAL = 1,  /* moderate plus a few NaN / +inf / -inf: checked for NaN reach */
    FZ_HUGE = 2      /* moderate plus a few values near the dtype's largest: checked for safety
                        and for untouched outputs on errors only */
};

/* A tensor the harness made: the descriptor the library sees, the exact allocation behind it
 * (so AddressSanitizer catches any byte read or written outside its span), and whether the
 * harness broke the descriptor on purpose. */
typedef struct {
    fw_tensor t;
    unsigned char *buf;
    size_t bytes;
    int bad;
} fz_tensor;

/* Lay out a tensor: contiguous, padded, permuted or (inputs only) broadcast along a dimension.
 * `corrupt` is a mask of the dimensions whose size another operand fixes (FZ_NONE: never
 * break this tensor); when it is not FZ_NONE the tensor is rarely broken (bad = 1): a negative
 * size or stride, a stride whose offsets overflow, an invalid dtype, NULL data, a wrong rank,
 * or a fixed dimension off by one. Inputs get values of class `vclass` (std `scale` for the
 * moderate ones) and the byte 0x7F in the padding between them; outputs the byte 0xA5
 * everywhere. */
#define FZ_NONE (-1)
#define FZ_ALL 0xF
void fz_tensor_new(fz_in *in, fz_tensor *ft, fw_dtype dt, int ndim, const int64_t *shape,
                   int output, int corrupt, int vclass, double scale);
void fz_tensor_free(fz_tensor *ft);
/* The same elements in a new buffer laid out with `stride` (a layout the kernel insists on):
 * every element keeps its value and the padding is set as fz_tensor_new sets it, where
 * restriding the old buffer would expose padding the fill never wrote. */
void fz_tensor_relayout(fz_tensor *ft, const int64_t *stride);
/* A copy of the buffer, and whether it is unchanged since. */
unsigned char *fz_snapshot(const fz_tensor *ft);
int fz_unchanged(const fz_tensor *ft, const unsigned char *snap);

/* Attention sinks for a problem with hq query heads: none (returns 0, ft zeroed; most
 * inputs, and every input that ends here), or (returns 1) [hq] in f32, bf16 or f16, laid out
 * as fz_tensor_new lays out an input (contiguous, padded, broadcast) and now and then broken
 * as it breaks one (the head count off by one, a negative stride, another dtype, NULL data,
 * the wrong rank); values of the class *vclass (fz_vclass: its NaN, +-inf and near-largest
 * values included), with std 1 to 3, or 8 to 40 (sinks far above or below the scores). */
int fz_sinks(fz_in *in, fz_tensor *ft, int64_t hq, int *vclass);
/* A value class for an input: mostly moderate. */
int fz_vclass(fz_in *in);
/* Elements of t (0 if a size is 0 or negative). */
int64_t fz_numel(const fw_tensor *t);
/* Machine epsilon of a dtype (2^-23, 2^-7, 2^-10; 2^-52 for f64). */
double fz_eps(fw_dtype dt);
/* The largest |x| over the finite elements of t. */
double fz_absmax(const fw_tensor *t);
/* The largest |x| over the finite x[0 .. n). */
double fz_absmax_d(const double *x, int64_t n);
/* The slack of lse against the float64 reference: its f32 scores carry rounding errors of
 * the order of a few ulps of the largest lse and score (max|lse| and smax, a bound on
 * |score|); the float64 reference has none, and a wrong mask or scale is off by O(1). */
double fz_lse_slack(const double *ex_lse, int64_t n, double smax);
/* Seed of the value generator, from 4 bytes of input. */
void fz_seed(fz_in *in);

/*
 * The kernel's tensor `got` against two float64 references in its row-major order: `sr`, the
 * same-roundings reference, and `ex`, the exact one, unless `values` is 0 (huge inputs, where
 * f32 overflows what float64 holds): where sr is NaN, got must be NaN; where sr is +-inf, got
 * must equal it; where sr is finite, got must be too, and |got - sr| <= 2 max|sr - ex| + slack. `rules` relaxes this where docs/design.md allows:
 *   FZ_WIDER: got may be NaN where sr is finite (a NaN that reaches more rows than the
 *     reference's: a value row through its 64-key tile, a key from its chunk's start);
 *   FZ_ANY_NONFINITE: NaN and +-inf stand for each other (a kernel that evaluates an
 *     algebraically equal formula may keep an inf that the reference's order makes NaN; an inf
 *     value whose probability underflows to 0 in the reference, exp(s - max) in float64, but
 *     not in the kernel, 2^(s - anchor) in f32, is NaN in one and +-inf in the other).
 */
enum { FZ_WIDER = 1, FZ_ANY_NONFINITE = 2 };
void fz_compare(const char *what, const fw_tensor *got, const double *sr, const double *ex,
                int64_t n, int values, int rules, double slack);

/* What the harness decoded, in words; fz_fail prints it. */
extern char fz_desc[1024];
void fz_describe(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* One line per tensor appended to fz_desc: its shape, strides, dtype and value class. */
void fz_describe_tensor(const char *name, const fz_tensor *ft, int vclass);

/* Print a message and abort (a finding). */
void fz_fail(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
#define FZ_CHECK(cond, ...)                                                                      \
    do {                                                                                         \
        if (!(cond))                                                                             \
            fz_fail(__VA_ARGS__);                                                                \
    } while (0)

/* The kernel table a call uses: NULL (the default) or one this CPU runs. */
const char *fz_isa(fz_in *in);
/* The decode prefetch flags of a call: none (the CPU's default), forced on, or forced off. */
uint32_t fz_dec_prefetch(fz_in *in);

#endif
