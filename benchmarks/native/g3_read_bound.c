/* The bound on a G3 load from a fast medium: G3's read pattern in C alone, with no engine around it
 * (benchmarks/g3_read_bound.py builds and drives it).
 *
 * `threads` pthreads split `nfiles` files (file f goes to thread f % threads). Each file holds
 * `per_file` entries of `npieces * piece` bytes. Modes:
 *   0: one pread of the whole file into one reused buffer per thread (a raw read, cache-warm);
 *   1: per entry, one preadv of `npieces` pieces into G1's layout: piece p of the entry filling
 *      block b lands at g1 + (p * nblocks + b) * piece (G1 is [layers, K/V, blocks, ...]);
 *   2: mode 1, then that entry's XXH3-128 streamed over its pieces (as read_entries.c checks);
 *   3: per entry, one pread into a reused per-thread buffer (cache-warm), then the pieces copied
 *      from it into G1's layout by memcpy: the kernel's copy lands in the cache and a user-space
 *      copy moves the bytes to G1 (on some CPUs the kernel's `rep movsb` into memory not in the
 *      cache is far slower than a vector memcpy);
 *   4: mode 3 with the XXH3-128 taken over the buffer (still in the cache) before the copy.
 * The hash functions are passed in (the `xxhash` package's own, as G3 uses). *sum_out gets the sum
 * (mod 2^64) of every checked entry's XXH3-128 low half, for the caller to compare. */
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

typedef struct { uint64_t low64, high64; } h128_t;
typedef struct { /* read_entries.c's xxh_fns (kvstore/native: _Fns) */
    uint64_t (*h64)(const void *, size_t);
    void *(*create)(void);
    int (*reset)(void *);
    int (*update)(void *, const void *, size_t);
    h128_t (*digest)(const void *);
    int (*release)(void *);
} hash_fns;

typedef struct {
    const char *dir;
    int mode, threads, nfiles, per_file, npieces, tid;
    int64_t piece, nblocks, first_block;
    uint8_t *g1, *buf;
    const hash_fns *h;
    uint64_t sum;
    int failed;
} job_t;

static void *work(void *arg) {
    job_t *j = arg;
    int64_t entry = j->piece * j->npieces;
    struct iovec *iov = malloc(sizeof(struct iovec) * (size_t)j->npieces);
    void *state = j->mode == 2 || j->mode == 4 ? j->h->create() : NULL;
    char path[4096];
    for (int f = j->tid; f < j->nfiles; f += j->threads) {
        snprintf(path, sizeof path, "%s/f%d", j->dir, f);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) { j->failed = 1; break; }
        if (j->mode == 0) {
            if (pread(fd, j->buf, (size_t)(entry * j->per_file), 0) != entry * j->per_file) j->failed = 1;
        } else if (j->mode >= 3) {
            for (int e = 0; e < j->per_file; e++) {
                int64_t b = j->first_block + (int64_t)f * j->per_file + e;
                if (pread(fd, j->buf, (size_t)entry, (off_t)(e * entry)) != entry) j->failed = 1;
                if (state != NULL) {
                    j->h->reset(state);
                    j->h->update(state, j->buf, (size_t)entry);
                    j->sum += j->h->digest(state).low64;
                }
                for (int p = 0; p < j->npieces; p++)
                    memcpy(j->g1 + ((int64_t)p * j->nblocks + b) * j->piece, j->buf + (int64_t)p * j->piece,
                           (size_t)j->piece);
            }
        } else {
            for (int e = 0; e < j->per_file; e++) {
                int64_t b = j->first_block + (int64_t)f * j->per_file + e;
                for (int p = 0; p < j->npieces; p++)
                    iov[p] = (struct iovec){j->g1 + ((int64_t)p * j->nblocks + b) * j->piece, (size_t)j->piece};
                if (preadv(fd, iov, j->npieces, (off_t)(e * entry)) != entry) j->failed = 1;
                if (state != NULL) {
                    j->h->reset(state);
                    for (int p = 0; p < j->npieces; p++) j->h->update(state, iov[p].iov_base, (size_t)j->piece);
                    j->sum += j->h->digest(state).low64;
                }
            }
        }
        close(fd);
    }
    if (state != NULL) j->h->release(state);
    free(iov);
    return NULL;
}

/* Returns the seconds taken, or a negative number when a read failed. */
double g3_bound_run(const char *dir, int mode, int threads, int nfiles, int per_file, int npieces, int64_t piece,
                    uint8_t *g1, int64_t nblocks, int64_t first_block, const hash_fns *h, uint64_t *sum_out) {
    job_t jobs[64];
    pthread_t th[64];
    if (threads < 1 || threads > 64) return -1;
    struct timespec t0, t1;
    for (int i = 0; i < threads; i++) {
        jobs[i] = (job_t){dir, mode, threads, nfiles, per_file, npieces, i, piece, nblocks, first_block, g1, NULL, h, 0, 0};
        if (mode == 0) jobs[i].buf = malloc((size_t)(piece * npieces * per_file));
        if (mode >= 3) jobs[i].buf = malloc((size_t)(piece * npieces));
    }
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < threads; i++) pthread_create(&th[i], NULL, work, &jobs[i]);
    int failed = 0;
    *sum_out = 0;
    for (int i = 0; i < threads; i++) {
        pthread_join(th[i], NULL);
        failed |= jobs[i].failed;
        *sum_out += jobs[i].sum;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    for (int i = 0; i < threads; i++) free(jobs[i].buf);
    double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
    return failed ? -s : s;
}
