/* What jemalloc's archive imports from beyond libc, under the names private_jemalloc.py gives
 * those imports, so that no library is loaded into a program because of the jemalloc inside
 * libheapdump.so. Only jemalloc's own heap profiling (MALLOC_CONF=prof:true, which profiles the
 * library's backend, not the program) calls any of them:
 * - libm's log, exp and round (its sampling and unbiasing): accurate to a few units in the last
 *   place, more than sampling intervals need; checked against libm by
 *   tests/instrumentation/tables_test.cc;
 * - libgcc's _Unwind_Backtrace (its stack traces): every trace is empty. */
#include "jemalloc_imports.h"

#include <stdint.h>
#include <string.h>

static uint64_t bits_of(double x) {
  uint64_t b;
  memcpy(&b, &x, sizeof b);
  return b;
}

static double from_bits(uint64_t b) {
  double x;
  memcpy(&x, &b, sizeof x);
  return x;
}

/* ln 2 split so that k * LN2_HI is exact for the |k| < 2^11 used here. */
static const double LN2_HI = 6.93147180369123816490e-01;
static const double LN2_LO = 1.90821492927058770002e-10;
static const double LOG2_E = 1.44269504088896338700e+00;
static const double TWO_54 = 18014398509481984.0;

double hd_je_log(double x) {
  if (x != x) return x;
  if (x < 0) return (x - x) / (x - x); /* NaN */
  if (x == 0) return -1.0 / 0.0;
  if (x == 1.0 / 0.0) return x;
  int scale = 0;
  if (x < 0x1p-1022) { /* subnormal: make it normal */
    x *= TWO_54;
    scale = -54;
  }
  const uint64_t b = bits_of(x);
  int e = (int)((b >> 52) & 0x7ff) - 1023 + scale;
  double m = from_bits((b & ((UINT64_C(1) << 52) - 1)) | (UINT64_C(1023) << 52)); /* [1, 2) */
  if (m > 1.41421356237309504880) { /* keep m in [sqrt(1/2), sqrt(2)): a short series */
    m *= 0.5;
    e++;
  }
  /* log(m) = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172: 10 odd terms reach 1e-17. */
  const double s = (m - 1) / (m + 1), s2 = s * s;
  double series = 1.0 / 21;
  for (int k = 19; k >= 1; k -= 2) series = 1.0 / k + s2 * series;
  const double log_m = 2 * s * series;
  return e * LN2_HI + (log_m + e * LN2_LO);
}

/* 2^k for k in [-1022, 1023]. */
static double pow2(int k) { return from_bits((uint64_t)(k + 1023) << 52); }

double hd_je_exp(double x) {
  if (x != x) return x;
  if (x > 709.782712893383973096) return 1.0 / 0.0;
  if (x < -745.133219101941108420) return 0;
  /* x = k ln 2 + r, |r| <= ln 2 / 2; e^r by its Taylor series (15 terms reach 1e-17). */
  const double kd = x * LOG2_E;
  const int k = (int)(kd < 0 ? kd - 0.5 : kd + 0.5);
  const double r = (x - k * LN2_HI) - k * LN2_LO;
  double series = 1.0;
  for (int n = 15; n >= 1; n--) series = 1.0 + r * series / n;
  /* 2^k in two halves: each is normal even where 2^k alone is not (k near -1074 or 1024). */
  const int half = k / 2;
  return series * pow2(half) * pow2(k - half);
}

double hd_je_round(double x) {
  if (!(__builtin_fabs(x) < 0x1p52)) return x; /* integral already, or NaN or infinite */
  double t = (double)(int64_t)x;               /* truncated towards zero */
  if (__builtin_fabs(x - t) >= 0.5) t += __builtin_copysign(1.0, x);
  return __builtin_copysign(t, x); /* round(-0.4) is -0.0 */
}

/* _Unwind_Reason_Code's _URC_END_OF_STACK, before the first frame. */
int hd_je__Unwind_Backtrace(void *trace, void *arg) {
  (void)trace;
  (void)arg;
  return 5;
}

uintptr_t hd_je__Unwind_GetIP(void *context) {
  (void)context;
  return 0;
}
