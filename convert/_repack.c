/* The Marlin FP8 weight repack on the host, in one pass (Note [host repack] in
 * convert/host_repack.py, which owns this module and its tests).
 *
 * Input: the checkpoint's fp8 bytes as N row pointers (fused and sliced rows need no copy);
 * output: the Marlin tiles, int32 [Kp/16][4*Np], little-endian words (SPEC section 5). Rows
 * n >= N and bytes k >= K are the zero padding of SPEC section 3.3.
 *
 * Which byte goes to which word, and the names below (nt, kt, t8, w, h, kmid, p): docs/LAYOUT.md,
 * "The tile formula", its reading "by row". In short, a row's 16 bytes of one k-tile, halves
 * interleaved byte by byte, are its four words: one 16-byte load and four 4-byte stores, 8 words
 * apart.
 *
 * Two kernels give the same words. The scalar one does the above row by row. The SSE2 one
 * (x86-64; Note [tile kernel] in convert/host_repack.py) writes a whole tile front to back: for
 * each t8, the eight rows that own the tile's words 32*t8 .. 32*t8 + 31 are loaded and
 * interleaved, and their words, transposed as a 4x4 matrix of words per four rows, are those
 * 32 words in order.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#define HAVE_TILE_KERNEL 1
#else
#define HAVE_TILE_KERNEL 0
#endif

/* Bytes 0..3 of x at the even bytes of a 64-bit word. */
static inline uint64_t spread4(uint32_t x)
{
    uint64_t v = x;
    v = (v | (v << 16)) & 0x0000FFFF0000FFFFull;
    v = (v | (v << 8)) & 0x00FF00FF00FF00FFull;
    return v;
}

/* Bytes 16*kt .. 16*kt + 15 of row r (NULL: a padding row), zero past byte K: r's own bytes
 * where the k-tile lies inside K, else a copy in buf (or zeros). Both kernels load through it. */
static inline const uint8_t *row_at(const uint8_t *r, int64_t kt, int64_t k, uint8_t buf[16])
{
    static const uint8_t zeros[16];
    const int64_t have = k - 16 * kt;
    if (r != NULL && have >= 16)
        return r + 16 * kt;
    if (r == NULL || have <= 0)
        return zeros;
    memset(buf, 0, 16); /* the k-tile that K ends in */
    memcpy(buf, r + 16 * kt, (size_t)have);
    return buf;
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
                         int64_t kp, uint32_t *out, int64_t nt0, int64_t nt1, int64_t kb)
{
    const int64_t row_words = 4 * np_; /* words in one packed row: one k-tile of every n */
    const int64_t kts = kp / 16;
    /* k-tiles per pass over an n-tile's 64 rows: a row's stores go to every k-tile of the
     * pass, each 16*np bytes from the next, so a block keeps them in the first-level cache
     * (Note [host repack]); kb <= 0: the whole row at once */
    if (kb <= 0 || kb > kts)
        kb = kts;
    for (int64_t nt = nt0; nt < nt1; nt++) {
        for (int64_t kt0 = 0; kt0 < kts; kt0 += kb) {
            const int64_t kt1 = kt0 + kb < kts ? kt0 + kb : kts;
            for (int i = 0; i < 64; i++) {
                const int64_t row = 64 * nt + i;
                const uint8_t *r = row < n ? rows[row] : NULL;
                const int p = 32 * (i & 7) + 2 * (i >> 4) + ((i >> 3) & 1);
                for (int64_t kt = kt0; kt < kt1; kt++) {
                    uint8_t buf[16];
                    put_row(out + kt * row_words + 256 * nt, p, row_at(r, kt, k, buf));
                }
            }
        }
    }
}

/* Bytes 0..3 at the even bytes of a 64-bit word -> a 32-bit word (the inverse of spread4). */
static inline uint32_t gather4(uint64_t v)
{
    v &= 0x00FF00FF00FF00FFull;
    v = (v | (v >> 8)) & 0x0000FFFF0000FFFFull;
    v = (v | (v >> 16)) & 0x00000000FFFFFFFFull;
    return (uint32_t)v;
}

/* The inverse of put_row: one row's 16 bytes of a k-tile from its four words. */
static inline void get_row(const uint32_t *tile, int p, uint8_t *dst)
{
    const uint64_t w01 = tile[p] | ((uint64_t)tile[p + 8] << 32);
    const uint64_t w23 = tile[p + 16] | ((uint64_t)tile[p + 24] << 32);
    const uint64_t lo = gather4(w01) | ((uint64_t)gather4(w23) << 32);
    const uint64_t hi = gather4(w01 >> 8) | ((uint64_t)gather4(w23 >> 8) << 32);
    memcpy(dst, &lo, 8);
    memcpy(dst + 8, &hi, 8);
}

/* Whether n-tiles [nt0, nt1) of the tiles at out unpack to other bytes than the rows (rows
 * n < N, bytes k < K: the layout read backwards; padding is not looked at). */
static int unpack_differs(const uint8_t *const *rows, int64_t n, int64_t k, int64_t np_,
                          const uint32_t *out, int64_t nt0, int64_t nt1, int64_t kb)
{
    const int64_t row_words = 4 * np_;
    const int64_t kts = (k + 15) / 16; /* the k-tiles holding real bytes */
    if (kb <= 0 || kb > kts)
        kb = kts; /* as in repack_tiles: k-tiles per pass over the rows */
    for (int64_t nt = nt0; nt < nt1; nt++) {
        for (int64_t kt0 = 0; kt0 < kts; kt0 += kb) {
            const int64_t kt1 = kt0 + kb < kts ? kt0 + kb : kts;
            for (int i = 0; i < 64 && 64 * nt + i < n; i++) {
                const uint8_t *r = rows[64 * nt + i];
                const int p = 32 * (i & 7) + 2 * (i >> 4) + ((i >> 3) & 1);
                for (int64_t kt = kt0; kt < kt1; kt++) {
                    uint8_t got[16];
                    get_row(out + kt * row_words + 256 * nt, p, got);
                    const int64_t have = k - 16 * kt < 16 ? k - 16 * kt : 16;
                    if (memcmp(got, r + 16 * kt, (size_t)have) != 0)
                        return 1;
                }
            }
        }
    }
    return 0;
}


#if HAVE_TILE_KERNEL
/* The 64 row addresses of n-tile nt (NULL past row N: padding). */
static inline void tile_rows(const uint8_t *const *rows, int64_t n, int64_t nt,
                             const uint8_t *rp[64])
{
    for (int i = 0; i < 64; i++)
        rp[i] = 64 * nt + i < n ? rows[64 * nt + i] : NULL;
}

/* Words 0..3 of a, b, c, d -> word i of each, in order, at q[i] (a 4x4 transpose of words;
 * its own inverse). */
static inline void transpose4(__m128i a, __m128i b, __m128i c, __m128i d, __m128i q[4])
{
    const __m128i ab0 = _mm_unpacklo_epi32(a, b), cd0 = _mm_unpacklo_epi32(c, d);
    const __m128i ab1 = _mm_unpackhi_epi32(a, b), cd1 = _mm_unpackhi_epi32(c, d);
    q[0] = _mm_unpacklo_epi64(ab0, cd0);
    q[1] = _mm_unpackhi_epi64(ab0, cd0);
    q[2] = _mm_unpacklo_epi64(ab1, cd1);
    q[3] = _mm_unpackhi_epi64(ab1, cd1);
}

/* Tile (kt, nt) from the 64 row addresses rp (NULL: padding), written front to back. */
static inline void put_tile(uint32_t *tile, const uint8_t *const *rp, int64_t kt, int64_t k)
{
    for (int t8 = 0; t8 < 8; t8++) {
        __m128i x[8], q0[4], q1[4];
        for (int j = 0; j < 8; j++) {
            uint8_t buf[16];
            const uint8_t *src = row_at(rp[8 * j + t8], kt, k, buf);
            const __m128i v = _mm_loadu_si128((const __m128i *)src);
            x[j] = _mm_unpacklo_epi8(v, _mm_unpackhi_epi64(v, v)); /* lo0 hi0 lo1 hi1 ... */
        }
        transpose4(x[0], x[1], x[2], x[3], q0);
        transpose4(x[4], x[5], x[6], x[7], q1);
        __m128i *o = (__m128i *)(tile + 32 * t8);
        for (int kmid = 0; kmid < 4; kmid++) {
            _mm_storeu_si128(o + 2 * kmid, q0[kmid]);
            _mm_storeu_si128(o + 2 * kmid + 1, q1[kmid]);
        }
    }
}

static void repack_tiles_simd(const uint8_t *const *rows, int64_t n, int64_t k, int64_t np_,
                              int64_t kp, uint32_t *out, int64_t nt0, int64_t nt1)
{
    const int64_t row_words = 4 * np_, kts = kp / 16;
    const uint8_t *rp[64];
    for (int64_t nt = nt0; nt < nt1; nt++) {
        tile_rows(rows, n, nt, rp);
        for (int64_t kt = 0; kt < kts; kt++)
            put_tile(out + kt * row_words + 256 * nt, rp, kt, k);
    }
}

/* Whether tile (kt, nt) unpacks to other bytes than rows rp (NULL: padding, not looked at). */
static inline int tile_differs(const uint32_t *tile, const uint8_t *const *rp, int64_t kt,
                               int64_t k)
{
    const __m128i low = _mm_set1_epi16(0x00FF);
    const int64_t have = k - 16 * kt < 16 ? k - 16 * kt : 16;
    for (int t8 = 0; t8 < 8; t8++) {
        const __m128i *o = (const __m128i *)(tile + 32 * t8);
        __m128i x[8];
        transpose4(_mm_loadu_si128(o), _mm_loadu_si128(o + 2), _mm_loadu_si128(o + 4),
                   _mm_loadu_si128(o + 6), x);
        transpose4(_mm_loadu_si128(o + 1), _mm_loadu_si128(o + 3), _mm_loadu_si128(o + 5),
                   _mm_loadu_si128(o + 7), x + 4);
        for (int j = 0; j < 8; j++) {
            const uint8_t *r = rp[8 * j + t8];
            if (r == NULL)
                continue;
            /* even bytes (k 0..7), then odd bytes (k 8..15): the row's 16 bytes */
            const __m128i got = _mm_packus_epi16(_mm_and_si128(x[j], low),
                                                 _mm_srli_epi16(x[j], 8));
            if (have == 16) {
                const __m128i want = _mm_loadu_si128((const __m128i *)(r + 16 * kt));
                if (_mm_movemask_epi8(_mm_cmpeq_epi8(got, want)) != 0xFFFF)
                    return 1;
            } else {
                uint8_t g[16];
                _mm_storeu_si128((__m128i *)g, got);
                if (memcmp(g, r + 16 * kt, (size_t)have) != 0)
                    return 1;
            }
        }
    }
    return 0;
}

static int unpack_differs_simd(const uint8_t *const *rows, int64_t n, int64_t k, int64_t np_,
                               const uint32_t *out, int64_t nt0, int64_t nt1)
{
    const int64_t row_words = 4 * np_, kts = (k + 15) / 16;
    const uint8_t *rp[64];
    for (int64_t nt = nt0; nt < nt1; nt++) {
        tile_rows(rows, n, nt, rp);
        for (int64_t kt = 0; kt < kts; kt++)
            if (tile_differs(out + kt * row_words + 256 * nt, rp, kt, k))
                return 1;
    }
    return 0;
}
#endif

/* The arguments both entry points take: (rows, n, k, np, kp, out, nt0, nt1[, kb[, tile]]),
 * checked. tile: use the tile kernel where it is built (else the scalar one, with kb). */
struct call {
    unsigned long long rows, out;
    long long n, k, np_, kp, nt0, nt1, kb;
    int tile;
};

static int parse_call(PyObject *args, const char *name, struct call *c)
{
    c->kb = 0;
    c->tile = HAVE_TILE_KERNEL;
    if (!PyArg_ParseTuple(args, "KLLLLKLL|Lp", &c->rows, &c->n, &c->k, &c->np_, &c->kp, &c->out,
                          &c->nt0, &c->nt1, &c->kb, &c->tile))
        return 0;
    c->tile = c->tile && HAVE_TILE_KERNEL;
    if (c->n < 0 || c->k < 0 || c->np_ % 64 || c->kp % 16 || c->n > c->np_ || c->k > c->kp ||
        c->nt0 < 0 || c->nt0 > c->nt1 || c->nt1 > c->np_ / 64) {
        PyErr_Format(PyExc_ValueError,
                     "%s: bad shape n=%lld k=%lld np=%lld kp=%lld tiles [%lld, %lld)", name,
                     c->n, c->k, c->np_, c->kp, c->nt0, c->nt1);
        return 0;
    }
    return 1;
}

static PyObject *py_unpack_differs(PyObject *self, PyObject *args)
{
    struct call c;
    int differs;
    (void)self;
    if (!parse_call(args, "unpack_differs", &c))
        return NULL;
    const uint8_t *const *rows = (const uint8_t *const *)(uintptr_t)c.rows;
    const uint32_t *out = (const uint32_t *)(uintptr_t)c.out;
    Py_BEGIN_ALLOW_THREADS
#if HAVE_TILE_KERNEL
    if (c.tile)
        differs = unpack_differs_simd(rows, c.n, c.k, c.np_, out, c.nt0, c.nt1);
    else
#endif
        differs = unpack_differs(rows, c.n, c.k, c.np_, out, c.nt0, c.nt1, c.kb);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(differs);
}

static PyObject *py_repack_tiles(PyObject *self, PyObject *args)
{
    struct call c;
    (void)self;
    if (!parse_call(args, "repack_tiles", &c))
        return NULL;
    const uint8_t *const *rows = (const uint8_t *const *)(uintptr_t)c.rows;
    uint32_t *out = (uint32_t *)(uintptr_t)c.out;
    Py_BEGIN_ALLOW_THREADS
#if HAVE_TILE_KERNEL
    if (c.tile)
        repack_tiles_simd(rows, c.n, c.k, c.np_, c.kp, out, c.nt0, c.nt1);
    else
#endif
        repack_tiles(rows, c.n, c.k, c.np_, c.kp, out, c.nt0, c.nt1, c.kb);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"repack_tiles", py_repack_tiles, METH_VARARGS,
     "repack_tiles(rows, n, k, np, kp, out, nt0, nt1, kb=0, tile=True): n-tiles [nt0, nt1) of "
     "the Marlin FP8 repack. rows: address of N row addresses (uint64); out: address of int32 "
     "[kp/16, 4*np]; tile: the tile kernel where built (TILE_KERNEL), else the scalar one with "
     "kb k-tiles per pass over an n-tile's 64 rows (0: all). Releases the GIL."},
    {"unpack_differs", py_unpack_differs, METH_VARARGS,
     "unpack_differs(rows, n, k, np, kp, out, nt0, nt1, kb=0): whether n-tiles [nt0, nt1) of "
     "the Marlin tiles at out unpack to other bytes than the N rows at rows (K bytes each; "
     "padding not read); kb and tile as for repack_tiles. Releases the GIL."},
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
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "TILE_KERNEL", HAVE_TILE_KERNEL) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
