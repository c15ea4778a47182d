/* The few-row kernel (workers/kernels/few_rows.py): y [M, N] = x [M, K] @ W.T (+ bias) in float32
   for passes of a few rows, W copied into blocks of 16 output columns ([K, 16] each) that stream
   contiguously, each block multiplied by up to 4 rows held in AVX2 registers. Every output is the
   same sequential fused multiply-add over k whatever the number of rows: a row's product does not
   depend on the rows beside it, bit for bit.

   Built with the package as an optional extension (setup.py: -O3 -mavx2 -mfma); Python loads the
   built file with ctypes and calls few_rows(). The module init below only makes the file a valid
   CPython extension, so that it is found and imported like one. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#define BLOCK 16
/* MM rows of x [rows, K] times NBB consecutive blocks of the blocked weight ([K, 16] each):
   out[(b * MM + m) * 16 + j]. Every output is the same sequential fused multiply-add over k,
   from zero, whatever MM and NBB. */
#define TILE(MM, NBB) \
static void tile_##MM##_##NBB(const float* restrict x, long K, const float* restrict w, \
                              float* restrict out) { \
  __m256 a[NBB][MM][2]; \
  _Pragma("GCC unroll 16") for (int b = 0; b < NBB; b++) \
  _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) { \
    a[b][m][0] = _mm256_setzero_ps(); a[b][m][1] = _mm256_setzero_ps(); } \
  for (long k = 0; k < K; k++) { \
    _Pragma("GCC unroll 16") for (int b = 0; b < NBB; b++) { \
      const float* wk = w + (b * K + k) * BLOCK; \
      __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8); \
      _Pragma("GCC unroll 16") for (int m = 0; m < MM; m++) { \
        __m256 s = _mm256_broadcast_ss(x + m * K + k); \
        a[b][m][0] = _mm256_fmadd_ps(s, w0, a[b][m][0]); \
        a[b][m][1] = _mm256_fmadd_ps(s, w1, a[b][m][1]); } } } \
  for (int b = 0; b < NBB; b++) for (int m = 0; m < MM; m++) { \
    _mm256_storeu_ps(out + (b * MM + m) * BLOCK, a[b][m][0]); \
    _mm256_storeu_ps(out + (b * MM + m) * BLOCK + 8, a[b][m][1]); } }
TILE(1, 2) TILE(1, 1) TILE(2, 2) TILE(2, 1) TILE(3, 1) TILE(4, 1)

static void put(const float* out, int mm, int nbb, const float* bias, float* y, long N, long nb,
                long m0) {
  for (int b = 0; b < nbb; b++) {
    long c0 = (nb + b) * BLOCK;
    int cols = (int)(N - c0 < BLOCK ? N - c0 : BLOCK);
    for (int m = 0; m < mm; m++)
      for (int j = 0; j < cols; j++)
        y[(m0 + m) * N + c0 + j] = out[(b * mm + m) * BLOCK + j] + (bias ? bias[c0 + j] : 0.f);
  }
}

/* y [M, N] = x [M, K] @ W.T (+ bias), W given blocked: [ceil(N / 16), K, 16], zero-padded. */
__attribute__((visibility("default")))
void few_rows(const float* x, const float* wb, const float* bias, float* y, long M, long K, long N) {
  long NB = (N + BLOCK - 1) / BLOCK;
  float out[2 * 4 * BLOCK];
  for (long nb = 0; nb < NB;) {
    int nbb = (M <= 2 && nb + 1 < NB) ? 2 : 1; /* one or two rows: two blocks at once */
    const float* w = wb + nb * K * BLOCK;
    for (long m0 = 0; m0 < M;) {
      const float* xm = x + m0 * K;
      int mm = M - m0 >= 4 ? 4 : (int)(M - m0);
      if (mm == 4) tile_4_1(xm, K, w, out);
      else if (mm == 3) tile_3_1(xm, K, w, out);
      else if (mm == 2) { if (nbb == 2) tile_2_2(xm, K, w, out); else tile_2_1(xm, K, w, out); }
      else { if (nbb == 2) tile_1_2(xm, K, w, out); else tile_1_1(xm, K, w, out); }
      put(out, mm, nbb, bias, y, N, nb, m0);
      m0 += mm;
    }
    nb += nbb;
  }
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_few_rows",
                                    "The few-row kernel's shared library (loaded with ctypes).", -1, NULL};

PyMODINIT_FUNC PyInit__few_rows(void) { return PyModule_Create(&module); }
