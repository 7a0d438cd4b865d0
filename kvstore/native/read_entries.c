/* G3's read loop without the GIL: open one file, read the wanted entries, check them.
 *
 * Python's version (kvstore/disk_files.py read_run) made five system calls and a dozen hash and
 * struct calls per entry, each one a GIL release and re-acquire; with four reader threads, a copy
 * thread and the forward sharing two cores, the hand-offs, not the bytes, bounded a tmpfs load.
 * Here one ctypes call (ctypes drops the GIL for its length) does a file's whole share:
 *
 *   lstat, refuse anything but a regular file; open without following links or blocking; fstat
 *   again (the path may have been swapped); then, for each run of adjacent entries, one preadv
 *   of (header, payload) pairs straight into the caller's buffers; then each entry's checks.
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
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define KVT_READ_ABI 1
#define HEAD_BODY 68 /* struct "<4sHHB3x16s16sQ16s" */
#define HEADER_SIZE (HEAD_BODY + 8)
#define MAX_IOV 1024

enum { ENTRY_OK = 0, ENTRY_SHORT = 1, ENTRY_UNCHECKED = 2 };
enum { FILE_OK = 0, FILE_NOT_REGULAR = 1 }; /* negative: -errno of lstat/open/fstat */

typedef struct { uint64_t low64, high64; } h128_t; /* XXH128_hash_t */
typedef h128_t (*h128_fn)(const void *, size_t);
typedef uint64_t (*h64_fn)(const void *, size_t);

int kvt_read_abi(void) { return KVT_READ_ABI; }

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

static int verified(const uint8_t *head, const uint8_t *payload, int64_t payload_len, const uint8_t *ns,
                    const uint8_t *key, h64_fn h64, h128_fn h128) {
    if (memcmp(head, "KVTB", 4) != 0 || le16(head + 4) != 1 || le16(head + 6) != HEADER_SIZE || head[8] != 1)
        return 0;
    if (memcmp(head + 12, ns, 16) != 0 || memcmp(head + 28, key, 16) != 0) return 0;
    if (le64(head + 44) != (uint64_t)payload_len) return 0;
    if (!eq_be64(head + HEAD_BODY, h64(head, HEAD_BODY))) return 0;
    h128_t sum = h128(payload, (size_t)payload_len);
    return eq_be64(head + 52, sum.high64) && eq_be64(head + 60, sum.low64);
}

/* Reads and checks `n` entries of the file at `path`, sorted by offset.
 *   offsets[i], sizes[i]: entry i's place in the file (header + payload bytes);
 *   payloads[i]: where its payload goes (sizes[i] - HEADER_SIZE bytes); heads: n * HEADER_SIZE
 *   bytes for the headers; keys: n * 16 bytes, the key each entry must hold; ns: 16 bytes;
 *   check: 0 = read only (every read entry is UNCHECKED: a keyed codec checks in Python);
 *   status[i] (out): ENTRY_OK, ENTRY_SHORT (not all its bytes came; err_out holds the errno, 0
 *   for end of file) or ENTRY_UNCHECKED; ident (out): st_dev, st_ino of the file read;
 *   ns_out (out): nanoseconds reading, checking.
 * Returns FILE_OK, FILE_NOT_REGULAR (ident[0] holds its st_mode) or -errno. */
int kvt_read_entries(const char *path, int n, const int64_t *offsets, const int64_t *sizes, void *const *payloads,
                     uint8_t *heads, const uint8_t *keys, const uint8_t *ns, int check, void *h64p, void *h128p,
                     int8_t *status, int *err_out, uint64_t *ident, int64_t *ns_out) {
    struct stat st;
    int64_t t0 = now_ns();
    *err_out = 0;
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
    struct iovec iov[MAX_IOV];
    for (int i = 0; i < n;) {
        int j = i, k = 0; /* the run [i, j) of adjacent entries */
        while (j < n && k + 2 <= MAX_IOV && (j == i || offsets[j - 1] + sizes[j - 1] == offsets[j])) {
            iov[k++] = (struct iovec){heads + (size_t)j * HEADER_SIZE, HEADER_SIZE};
            iov[k++] = (struct iovec){payloads[j], (size_t)(sizes[j] - HEADER_SIZE)};
            j++;
        }
        ssize_t got = preadv(fd, iov, k, offsets[i]);
        if (got < 0) {
            *err_out = errno;
            got = 0;
        }
        for (int m = i; m < j; m++)
            status[m] = offsets[m] + sizes[m] - offsets[i] > got ? ENTRY_SHORT : ENTRY_UNCHECKED;
        i = j;
    }
    close(fd);
    int64_t t1 = now_ns();
    if (check)
        for (int i = 0; i < n; i++)
            if (status[i] == ENTRY_UNCHECKED &&
                verified(heads + (size_t)i * HEADER_SIZE, payloads[i], sizes[i] - HEADER_SIZE, ns, keys + (size_t)i * 16,
                         (h64_fn)h64p, (h128_fn)h128p))
                status[i] = ENTRY_OK;
    ns_out[0] = t1 - t0;
    ns_out[1] = now_ns() - t1;
    return FILE_OK;
}
