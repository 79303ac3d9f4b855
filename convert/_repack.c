/* The Marlin FP8 weight repack on the host, in one pass (Note [host repack] in
 * convert/host_repack.py, which owns this module and its tests).
 *
 * Input: the checkpoint's fp8 bytes as N row pointers (fused and sliced rows need no copy);
 * output: the Marlin tiles, int32 [Kp/16][4*Np], little-endian words (SPEC section 5). Rows
 * n >= N and bytes k >= K are the zero padding of SPEC section 3.3.
 *
 * Word p of tile (kt, nt) holds four bytes of row n = 64*nt + 16*w + 8*h + t8, where
 * p = 32*t8 + 8*kmid + 2*w + h, at k = 16*kt + 2*kmid + {0, 8, 1, 9} (least significant byte
 * first). So the 16 bytes of one row in one k-tile, split into halves lo (k 0..7) and hi
 * (k 8..15) and interleaved byte by byte (lo0 hi0 lo1 hi1 ...), are the four words of
 * kmid = 0..3 in order: one 16-byte load and four 4-byte stores, 8 words apart.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Bytes 0..3 of x at the even bytes of a 64-bit word. */
static inline uint64_t spread4(uint32_t x)
{
    uint64_t v = x;
    v = (v | (v << 16)) & 0x0000FFFF0000FFFFull;
    v = (v | (v << 8)) & 0x00FF00FF00FF00FFull;
    return v;
}

/* One row's 16 bytes of a k-tile -> its four words (kmid 0..3), at tile + p, p + 8, ... */
static inline void put_row(uint32_t *tile, int p, const uint8_t *src)
{
    uint64_t lo, hi;
    memcpy(&lo, src, 8);
    memcpy(&hi, src + 8, 8);
    uint64_t w01 = spread4((uint32_t)lo) | (spread4((uint32_t)hi) << 8);
    uint64_t w23 = spread4((uint32_t)(lo >> 32)) | (spread4((uint32_t)(hi >> 32)) << 8);
    tile[p] = (uint32_t)w01;
    tile[p + 8] = (uint32_t)(w01 >> 32);
    tile[p + 16] = (uint32_t)w23;
    tile[p + 24] = (uint32_t)(w23 >> 32);
}

static void repack_tiles(const uint8_t *const *rows, int64_t n, int64_t k, int64_t np_,
                         int64_t kp, uint32_t *out, int64_t nt0, int64_t nt1)
{
    static const uint8_t zeros[16];
    const int64_t row_words = 4 * np_; /* words in one packed row: one k-tile of every n */
    const int64_t kts = kp / 16, full = k / 16; /* k-tiles in all; those wholly inside K */
    for (int64_t nt = nt0; nt < nt1; nt++) {
        for (int i = 0; i < 64; i++) { /* a whole row at a time: 2.4 GB/s of input on one */
            const int64_t row = 64 * nt + i; /* core here, 1.7-1.8 in runs of 8 or 32 k-tiles */
            const uint8_t *r = row < n ? rows[row] : NULL;
            const int p = 32 * (i & 7) + 2 * (i >> 4) + ((i >> 3) & 1);
            for (int64_t kt = 0; kt < kts; kt++) {
                uint32_t *tile = out + kt * row_words + 256 * nt;
                if (r == NULL) {
                    put_row(tile, p, zeros);
                } else if (kt < full) {
                    put_row(tile, p, r + 16 * kt);
                } else { /* the k-tile that K ends in, then padding */
                    uint8_t buf[16] = {0};
                    const int64_t have = k - 16 * kt;
                    if (have > 0)
                        memcpy(buf, r + 16 * kt, (size_t)have);
                    put_row(tile, p, buf);
                }
            }
        }
    }
}

static PyObject *py_repack_tiles(PyObject *self, PyObject *args)
{
    unsigned long long rows, out;
    long long n, k, np_, kp, nt0, nt1;
    (void)self;
    if (!PyArg_ParseTuple(args, "KLLLLKLL", &rows, &n, &k, &np_, &kp, &out, &nt0, &nt1))
        return NULL;
    if (n < 0 || k < 0 || np_ % 64 || kp % 16 || n > np_ || k > kp || nt0 < 0 || nt0 > nt1 ||
        nt1 > np_ / 64) {
        PyErr_Format(PyExc_ValueError,
                     "repack_tiles: bad shape n=%lld k=%lld np=%lld kp=%lld tiles [%lld, %lld)",
                     n, k, np_, kp, nt0, nt1);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    repack_tiles((const uint8_t *const *)(uintptr_t)rows, n, k, np_, kp,
                 (uint32_t *)(uintptr_t)out, nt0, nt1);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"repack_tiles", py_repack_tiles, METH_VARARGS,
     "repack_tiles(rows, n, k, np, kp, out, nt0, nt1): n-tiles [nt0, nt1) of the Marlin FP8 "
     "repack. rows: address of N row addresses (uint64); out: address of int32 [kp/16, 4*np]. "
     "Releases the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_repack", "The Marlin FP8 weight repack on the host.", -1, methods,
};

PyMODINIT_FUNC PyInit__repack(void)
{
    const uint32_t one = 1;
    if (*(const uint8_t *)&one != 1) { /* the words are stored little-endian */
        PyErr_SetString(PyExc_ImportError, "mpack's host repack needs a little-endian machine");
        return NULL;
    }
    return PyModule_Create(&module);
}
