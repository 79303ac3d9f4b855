// Fused Marlin FP8 repack: checkpoint fp8 rows [N, K] -> Marlin int32 tiles [Kp/16, 4*Np],
// zero padding to (Np, Kp) included, in one pass (SPEC-marlin-fp8.md §3.3 and §5).
//
// Standalone compile check (mpack itself builds this file with NVRTC, see
// convert/cuda_repack.py, which passes the same architecture and -std=c++17):
//   nvcc -arch=sm_90 -std=c++17 -O3 -Xptxas -v -c cuda/marlin_repack.cu -o /tmp/marlin_repack.o
//
// The layout (SPEC §5): docs/LAYOUT.md, "The tile formula", read "by 16-byte chunk"; the names
// below (kt, nt, chunk q, word j, t8, kmid, whi, wlo, h) are that section's. Tile (kt, nt) is
// the 1024 contiguous bytes at out + kt*16*Np + nt*1024, cut into 64 chunks of 16 bytes, and
// one output chunk gathers 4 bytes from each of 4 input rows.
//
// Thread/tile mapping. One block of 256 threads owns a strip of 128 input rows (2 n-tiles) by
// 128 input bytes (8 k-tiles) = 16 output tiles = 16 KiB in, 16 KiB out:
//   1. stage: thread i loads 16-byte chunks i, i+256, i+512, i+768 of the strip (chunk c is
//      row c>>3, bytes 16*(c&7)..+15), all four loads in flight before the first use; a warp
//      reads 4 full 128-byte row segments (coalesced). Chunks go to shared memory with an XOR
//      swizzle of their 16-byte column (no padding, see smem_offset).
//   2. emit: after one barrier, thread i builds output chunks c = i + 256*j (j = 0..3), where
//      c>>7 is the k-tile, (c>>6)&1 the n-tile and c&63 the chunk of that tile: 8 shared-memory
//      words and 4 byte permutes per chunk, then one 16-byte store. A warp writes 512
//      contiguous output bytes per store instruction.
// Grid: x = k-strips (ceil(Kp/128)), y = n-strips (ceil(Np/128)); strips that overhang Np or
// Kp skip those stores. 16 KiB of static shared memory and 256 threads let 8 blocks share an
// SM, so about 128 KiB of loads are in flight per SM: enough to cover HBM latency on an H200.
//
// Three entry points differ only in the width of the global loads: 16 bytes when the row
// stride, K and the base pointer are multiples of 16 (every real layer with K % 16 == 0), else
// 4 bytes (K % 4 == 0, as the SPEC requires of K), else single bytes. Loads never read past K
// in a row or past row N-1, so strided views (a TP column slice) are read in place.

#define MPACK_THREADS 256  // threads per block
#define MPACK_BLOCK_N 128  // input rows per block (2 n-tiles)
#define MPACK_BLOCK_K 128  // input bytes per row per block (8 k-tiles)
#define MPACK_STAGE_CHUNKS (MPACK_BLOCK_N * MPACK_BLOCK_K / 16)  // 1024 16-byte chunks
#define MPACK_PER_THREAD (MPACK_STAGE_CHUNKS / MPACK_THREADS)    // 4 chunks per thread

// Why: places 16-byte column c16 of staged row r so that both phases are bank-conflict free:
// a row's 8 chunks land in 8 distinct bank groups, and the emit phase's reads (rows differing
// in r&7 and in bit 5) also spread over 8 groups.
__device__ __forceinline__ int smem_offset(int r, int c16) {
    return r * MPACK_BLOCK_K + ((c16 ^ (r & 7) ^ ((r >> 3) & 4)) << 4);
}

// Why: one 16-byte piece of checkpoint row n at byte k, zero past N or K (the padding), read
// with VEC-byte loads that stay inside the row; .cs because every byte is read exactly once.
template <int VEC>
__device__ __forceinline__ uint4 load_chunk(const unsigned char* __restrict__ src, long long ld,
                                            int n, int k, int n_rows, int k_cols) {
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (n >= n_rows) return v;
    const unsigned char* p = src + (long long)n * ld + k;
    if (VEC == 16) {
        if (k < k_cols) v = __ldcs(reinterpret_cast<const uint4*>(p));
    } else if (VEC == 4) {
        unsigned int w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
            w[i] = (k + 4 * i < k_cols) ? __ldcs(reinterpret_cast<const unsigned int*>(p) + i) : 0u;
        v = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
        unsigned int w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int i = 0; i < 16; ++i)
            if (k + i < k_cols) w[i >> 2] |= (unsigned int)__ldcs(p + i) << (8 * (i & 3));
        v = make_uint4(w[0], w[1], w[2], w[3]);
    }
    return v;
}

// Why: phase 1, the coalesced read of the block's 128 x 128-byte strip into shared memory;
// the four loads are issued before any shared-memory store so they overlap.
template <int VEC>
__device__ __forceinline__ void stage_strip(unsigned char* smem,
                                            const unsigned char* __restrict__ src, long long ld,
                                            int n0, int k0, int n_rows, int k_cols, int tid) {
    uint4 v[MPACK_PER_THREAD];
#pragma unroll
    for (int i = 0; i < MPACK_PER_THREAD; ++i) {
        const int c = tid + MPACK_THREADS * i;
        v[i] = load_chunk<VEC>(src, ld, n0 + (c >> 3), k0 + 16 * (c & 7), n_rows, k_cols);
    }
#pragma unroll
    for (int i = 0; i < MPACK_PER_THREAD; ++i) {
        const int c = tid + MPACK_THREADS * i;
        *reinterpret_cast<uint4*>(smem + smem_offset(c >> 3, c & 7)) = v[i];
    }
}

// Why: one output word, the k values 2kmid + {0, 8, 1, 9} of staged row r inside k-tile ktl:
// two aligned shared-memory words (bytes 4*(kmid>>1).. and 8 further) and one byte permute.
__device__ __forceinline__ unsigned int gather_word(const unsigned char* smem, int r, int ktl,
                                                    int kmid) {
    const unsigned char* row = smem + smem_offset(r, ktl) + 4 * (kmid >> 1);
    const unsigned int lo = *reinterpret_cast<const unsigned int*>(row);      // k +0..+3
    const unsigned int hi = *reinterpret_cast<const unsigned int*>(row + 8);  // k +8..+11
    // kmid even: bytes (lo.0, hi.0, lo.1, hi.1); odd: (lo.2, hi.2, lo.3, hi.3).
    return __byte_perm(lo, hi, (kmid & 1) ? 0x7362 : 0x5140);
}

// Why: phase 2, builds the block's 16 output tiles from shared memory and writes them with
// 16-byte stores, a warp covering 512 contiguous bytes; tiles past Np or Kp are skipped.
__device__ __forceinline__ void emit_tiles(uint4* __restrict__ dst, const unsigned char* smem,
                                           int nt0, int kt0, int n_tiles, int k_tiles,
                                           long long row_chunks, int tid) {
    // row_chunks: 16-byte chunks per output row = 16*Np bytes / 16 = Np.
#pragma unroll
    for (int i = 0; i < MPACK_PER_THREAD; ++i) {
        const int c = tid + MPACK_THREADS * i;
        const int ktl = c >> 7, ntl = (c >> 6) & 1, q = c & 63;
        if (kt0 + ktl >= k_tiles || nt0 + ntl >= n_tiles) continue;
        const int t8 = q >> 3, kmid = (q >> 1) & 3, whi = q & 1;
        const int r = 64 * ntl + 32 * whi + t8;  // word j adds 16*wlo + 8*h, j = 2*wlo + h
        uint4 out;
        out.x = gather_word(smem, r, ktl, kmid);
        out.y = gather_word(smem, r + 8, ktl, kmid);
        out.z = gather_word(smem, r + 16, ktl, kmid);
        out.w = gather_word(smem, r + 24, ktl, kmid);
        dst[(long long)(kt0 + ktl) * row_chunks + (long long)(nt0 + ntl) * 64 + q] = out;
    }
}

// Why: the one kernel body, instantiated per load width (the entry points below).
template <int VEC>
__device__ __forceinline__ void repack_strip(const unsigned char* __restrict__ src, long long ld,
                                             uint4* __restrict__ dst, int n_rows, int k_cols,
                                             int np, int kp) {
    __shared__ __align__(16) unsigned char smem[MPACK_BLOCK_N * MPACK_BLOCK_K];
    const int tid = threadIdx.x;
    const int n0 = blockIdx.y * MPACK_BLOCK_N, k0 = blockIdx.x * MPACK_BLOCK_K;
    stage_strip<VEC>(smem, src, ld, n0, k0, n_rows, k_cols, tid);
    __syncthreads();
    emit_tiles(dst, smem, n0 / 64, k0 / 16, np / 64, kp / 16, (long long)np, tid);
}

// Entry points. src: uint8 [N, K] with row stride ld bytes; dst: int32 [kp/16, 4*np] (16-byte
// aligned); np % 64 == 0, kp % 16 == 0, N <= np, K <= kp. Launch: block (256), grid
// (ceil(kp/128), ceil(np/128)), no dynamic shared memory.
extern "C" __global__ void __launch_bounds__(MPACK_THREADS)
marlin_repack_v16(const unsigned char* __restrict__ src, long long ld, uint4* __restrict__ dst,
                  int n_rows, int k_cols, int np, int kp) {
    repack_strip<16>(src, ld, dst, n_rows, k_cols, np, kp);
}

extern "C" __global__ void __launch_bounds__(MPACK_THREADS)
marlin_repack_v4(const unsigned char* __restrict__ src, long long ld, uint4* __restrict__ dst,
                 int n_rows, int k_cols, int np, int kp) {
    repack_strip<4>(src, ld, dst, n_rows, k_cols, np, kp);
}

extern "C" __global__ void __launch_bounds__(MPACK_THREADS)
marlin_repack_v1(const unsigned char* __restrict__ src, long long ld, uint4* __restrict__ dst,
                 int n_rows, int k_cols, int np, int kp) {
    repack_strip<1>(src, ld, dst, n_rows, k_cols, np, kp);
}
