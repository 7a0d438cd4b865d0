/* G3's read loop without the GIL: open one file, read the wanted entries, check them.
 *
 * Python's version (kvstore/disk_files.py read_run) made five system calls and a dozen hash and
 * struct calls per entry, each one a GIL release and re-acquire; with four reader threads, a copy
 * thread and the forward sharing two cores, the hand-offs, not the bytes, bounded a tmpfs load.
 * Here one ctypes call (ctypes drops the GIL for its length) does a file's whole share:
 *
 *   lstat, refuse anything but a regular file; open without following links or blocking; fstat
 *   again (the path may have been swapped); then, per entry, one preadv of its header and its
 *   payload's pieces straight into the caller's memory, and at once (while the bytes are still
 *   in the CPU's caches) that entry's checks.
 *
 * An entry's payload may go to several places: the pieces of G1 blocks it fills (the payload is
 * layer-major, G1 is block-major within a layer), so a hit moves each byte once, not through a
 * buffer and a copy. The payload sum is then taken over the pieces in order.
 *
 * Checks are the unkeyed xxh3 format of kvstore/entry.py: magic, version, header length,
 * algorithm 1, the header's xxh3-64, namespace, key, payload length and the payload's xxh3-128.
 * The hash functions are the `xxhash` package's own (passed in as pointers), so the sums are the
 * ones Python writes. An entry passing all of them is OK; any other entry is left to Python's
 * checks (status UNCHECKED), which give the reason and decide: failures are rare, and one code
 * path for reasons is better than two. So this file only ever says "verified" or "ask Python".
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define KVT_READ_ABI 3
#define HEAD_BODY 68 /* struct "<4sHHB3x16s16sQ16s" */
#define HEADER_SIZE (HEAD_BODY + 8)
#define MAX_IOV 1024

enum { ENTRY_OK = 0, ENTRY_SHORT = 1, ENTRY_UNCHECKED = 2 };
enum { FILE_OK = 0, FILE_NOT_REGULAR = 1 }; /* negative: -errno of lstat/open/fstat */

typedef struct { uint64_t low64, high64; } h128_t; /* XXH128_hash_t */

/* The `xxhash` package's XXH3_64bits and XXH3_128bits streaming functions. */
typedef struct {
    uint64_t (*h64)(const void *, size_t);
    void *(*create)(void);
    int (*reset)(void *);
    int (*update)(void *, const void *, size_t);
    h128_t (*digest)(const void *);
    int (*release)(void *);
} xxh_fns;

int kvt_read_abi(void) { return KVT_READ_ABI; }

/* The filesystem type (statfs f_type) of `path`, or -errno. */
int64_t kvt_fs_magic(const char *path) {
    struct statfs s;
    return statfs(path, &s) == 0 ? (int64_t)(uint64_t)s.f_type : -errno;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static uint16_t le16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint64_t le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}
static int eq_be64(const uint8_t *p, uint64_t v) { /* xxhash's canonical digest is big-endian */
    for (int i = 7; i >= 0; i--, v >>= 8)
        if (p[i] != (uint8_t)v) return 0;
    return 1;
}

/* The payload is the pieces (ptrs[k], lens[k]) for k < nseg, in order. */
static int verified(const uint8_t *head, int nseg, void *const *ptrs, const int64_t *lens, int64_t payload_len,
                    const uint8_t *ns, const uint8_t *key, const xxh_fns *f, void *state) {
    if (memcmp(head, "KVTB", 4) != 0 || le16(head + 4) != 1 || le16(head + 6) != HEADER_SIZE || head[8] != 1)
        return 0;
    if (memcmp(head + 12, ns, 16) != 0 || memcmp(head + 28, key, 16) != 0) return 0;
    if (le64(head + 44) != (uint64_t)payload_len) return 0;
    if (!eq_be64(head + HEAD_BODY, f->h64(head, HEAD_BODY))) return 0;
    if (f->reset(state) != 0) return 0;
    for (int k = 0; k < nseg; k++)
        if (f->update(state, ptrs[k], (size_t)lens[k]) != 0) return 0;
    h128_t sum = f->digest(state);
    return eq_be64(head + 52, sum.high64) && eq_be64(head + 60, sum.low64);
}

/* Reads `total` bytes at `pos` into iov[0..cnt) (which it consumes), going on after short reads.
 * Returns the bytes read; on an error, *err holds its errno (end of file: 0). */
static int64_t read_fully(int fd, struct iovec *iov, int cnt, int64_t pos, int64_t total, int *err) {
    int64_t done = 0;
    while (done < total) {
        int c = cnt < MAX_IOV ? cnt : MAX_IOV;
        ssize_t got = preadv(fd, iov, c, pos + done);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) {
            if (got < 0) *err = errno;
            break;
        }
        done += got;
        while (cnt > 0 && (size_t)got >= iov->iov_len) { /* drop what was filled */
            got -= (ssize_t)iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (uint8_t *)iov->iov_base + got;
            iov->iov_len -= (size_t)got;
        }
    }
    return done;
}

/* Reads and checks `n` entries of the file at `path`.
 *   offsets[i], sizes[i]: entry i's place in the file (header + payload bytes);
 *   nseg[i]: how many pieces its payload goes to; ptrs, lens: all entries' pieces in order
 *   (entry i's lens sum to sizes[i] - HEADER_SIZE); heads: n * HEADER_SIZE bytes for the headers;
 *   (kvt_read_batch: seg_start[i] is entry i's first piece, anywhere in ptrs/lens)
 *   keys: n * 16 bytes, the key each entry must hold; ns: 16 bytes;
 *   check: 0 = read only (every read entry is UNCHECKED: a keyed codec checks in Python);
 *   status[i] (out): ENTRY_OK, ENTRY_SHORT (not all its bytes came: err_out holds the errno, 0
 *   for end of file) or ENTRY_UNCHECKED; ident (out): st_dev, st_ino of the file read;
 *   ns_out (out): nanoseconds reading, checking.
 * Returns FILE_OK, FILE_NOT_REGULAR (ident[0] holds its st_mode) or -errno. */
static int read_file(const char *path, int n, const int64_t *offsets, const int64_t *sizes, const int64_t *seg_start,
                     const int32_t *nseg, void *const *ptrs, const int64_t *lens, uint8_t *heads, const uint8_t *keys,
                     const uint8_t *ns, int check, const xxh_fns *f, int8_t *status, int *err_out, uint64_t *ident,
                     int64_t *ns_out) {
    struct stat st;
    *err_out = 0;
    ns_out[0] = ns_out[1] = 0;
    if (lstat(path, &st) != 0) return -errno;
    if (!S_ISREG(st.st_mode)) {
        ident[0] = st.st_mode;
        return FILE_NOT_REGULAR;
    }
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    if (fd < 0) return -errno;
    if (fstat(fd, &st) != 0) {
        int e = errno;
        close(fd);
        return -e;
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        ident[0] = st.st_mode;
        return FILE_NOT_REGULAR;
    }
    ident[0] = st.st_dev;
    ident[1] = st.st_ino;
    void *state = check ? f->create() : NULL;
    struct iovec iov[MAX_IOV];
    size_t first = 0; /* entry i's first piece */
    for (int i = 0; i < n; first += (size_t)nseg[i], i++) {
        if (seg_start != NULL) first = (size_t)seg_start[i];
        int64_t t0 = now_ns();
        uint8_t *head = heads + (size_t)i * HEADER_SIZE;
        int64_t done = 0, want = sizes[i];
        int k = 0, err = 0;
        iov[k++] = (struct iovec){head, HEADER_SIZE};
        for (int s = 0; s <= nseg[i]; s++) { /* an entry with more pieces than MAX_IOV: several reads */
            if (s == nseg[i] || k == MAX_IOV) {
                int64_t part = 0;
                for (int m = 0; m < k; m++) part += (int64_t)iov[m].iov_len;
                int64_t got = read_fully(fd, iov, k, offsets[i] + done, part, &err);
                done += got;
                k = 0;
                if (got < part) break;
            }
            if (s < nseg[i]) iov[k++] = (struct iovec){ptrs[first + s], (size_t)lens[first + s]};
        }
        int64_t t1 = now_ns();
        ns_out[0] += t1 - t0;
        if (done < want) {
            status[i] = ENTRY_SHORT;
            if (err) *err_out = err;
            continue;
        }
        status[i] = ENTRY_UNCHECKED;
        if (state != NULL && verified(head, nseg[i], ptrs + first, lens + first, want - HEADER_SIZE, ns,
                                      keys + (size_t)i * 16, f, state))
            status[i] = ENTRY_OK;
        ns_out[1] += now_ns() - t1;
    }
    if (state != NULL) f->release(state);
    close(fd);
    return FILE_OK;
}

int kvt_read_entries(const char *path, int n, const int64_t *offsets, const int64_t *sizes, const int32_t *nseg,
                     void *const *ptrs, const int64_t *lens, uint8_t *heads, const uint8_t *keys, const uint8_t *ns,
                     int check, const xxh_fns *f, int8_t *status, int *err_out, uint64_t *ident, int64_t *ns_out) {
    return read_file(path, n, offsets, sizes, NULL, nseg, ptrs, lens, heads, keys, ns, check, f, status, err_out,
                     ident, ns_out);
}

/* A whole load in one call: kvt_read_entries for each of `nfiles` files, spread over up to
 * `threads` threads of its own (files are taken in order from a shared counter, so the first
 * files, a prefix's start, are read first). File j's entries are entries first[j]..first[j+1] of
 * the entry arrays (kvt_read_entries' arguments, with seg_start), its results code[j], err[j],
 * ident[2j..2j+1]; spent[0..1] sums every file's reading and checking nanoseconds. */
typedef struct {
    int nfiles;
    const char *const *paths;
    const int64_t *first, *offsets, *sizes, *seg_start;
    const int32_t *nseg;
    void *const *ptrs;
    const int64_t *lens;
    uint8_t *heads;
    const uint8_t *keys, *ns;
    int check;
    const xxh_fns *f;
    int8_t *status;
    int32_t *code, *err;
    uint64_t *ident;
    int64_t spent[2];
    int next; /* the next file to take (atomic) */
    pthread_mutex_t lock; /* for spent */
} batch_t;

static void *batch_worker(void *arg) {
    batch_t *b = arg;
    int64_t mine[2] = {0, 0};
    for (;;) {
        int j = __atomic_fetch_add(&b->next, 1, __ATOMIC_RELAXED);
        if (j >= b->nfiles) break;
        int64_t e = b->first[j], n = b->first[j + 1] - e, t[2];
        int err = 0;
        b->code[j] = read_file(b->paths[j], (int)n, b->offsets + e, b->sizes + e, b->seg_start + e, b->nseg + e,
                               b->ptrs, b->lens, b->heads + e * HEADER_SIZE, b->keys + e * 16, b->ns, b->check, b->f,
                               b->status + e, &err, b->ident + 2 * j, t);
        b->err[j] = err;
        mine[0] += t[0];
        mine[1] += t[1];
    }
    pthread_mutex_lock(&b->lock);
    b->spent[0] += mine[0];
    b->spent[1] += mine[1];
    pthread_mutex_unlock(&b->lock);
    return NULL;
}

/* The calling thread is one of the workers: a thread that cannot be started leaves its share to
 * the others, and every file is read. */
void kvt_read_batch(int nfiles, const char *const *paths, const int64_t *first, const int64_t *offsets,
                   const int64_t *sizes, const int64_t *seg_start, const int32_t *nseg, void *const *ptrs,
                   const int64_t *lens, uint8_t *heads, const uint8_t *keys, const uint8_t *ns, int check,
                   const xxh_fns *f, int threads, int8_t *status, int32_t *code, int32_t *err, uint64_t *ident,
                   int64_t *spent) {
    batch_t b = {nfiles, paths, first, offsets, sizes, seg_start, nseg, ptrs, lens, heads, keys, ns, check, f,
                 status, code, err, ident, {0, 0}, 0, PTHREAD_MUTEX_INITIALIZER};
    pthread_t tid[64];
    if (threads > 64) threads = 64;
    if (threads > nfiles) threads = nfiles;
    int started = 0;
    for (; started < threads - 1; started++) /* this thread is the last worker */
        if (pthread_create(&tid[started], NULL, batch_worker, &b) != 0) break;
    batch_worker(&b);
    for (int t = 0; t < started; t++) pthread_join(tid[t], NULL);
    spent[0] = b.spent[0];
    spent[1] = b.spent[1];
}
