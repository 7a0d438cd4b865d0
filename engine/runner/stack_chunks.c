/* A cache in front of CPython's arena allocator, for the frame stack's chunks (stack_chunks.py).
 *
 * CPython 3.11+ keeps frames in chunks of at least 16 KiB that it gets from the arena allocator
 * (mmap) and returns as soon as the last frame in one returns (munmap). A loop whose calls cross a
 * chunk's edge maps, faults in and unmaps a chunk on every call (gh-142183; fixed upstream after
 * 3.14 by caching one chunk per thread). Here freed blocks up to MAX_CACHED bytes, which pymalloc's
 * 1 MiB arenas never are, wait in a few slots and the next request of the same size takes one back.
 *
 * Every call is made with the GIL held (the frame stack and pymalloc both need it), so the slots
 * need no lock; stack_chunks.py does not install this on a free-threaded build. Blocks came from
 * the previous allocator and go back to it, so blocks allocated before installation are freed
 * correctly too.
 */
#include <stddef.h>

typedef struct {  /* CPython's PyObjectArenaAllocator (Include/cpython/objimpl.h, stable since 3.4) */
  void *ctx;
  void *(*alloc)(void *ctx, size_t size);
  void (*free)(void *ctx, void *ptr, size_t size);
} arena_allocator;

#define SLOTS 4
#define MAX_CACHED ((size_t)256 << 10)

arena_allocator kvt_stack_prev;  /* filled by PyObject_GetArenaAllocator before installing */
arena_allocator kvt_stack_ours;
long long kvt_stack_reused, kvt_stack_passed;  /* allocations served from a slot / by the previous allocator */

static struct { void *ptr; size_t size; } slot[SLOTS];
static int used;

static void *cached_alloc(void *ctx, size_t size) {
  (void)ctx;
  for (int i = used - 1; i >= 0; --i)
    if (slot[i].size == size) {
      void *p = slot[i].ptr;
      slot[i] = slot[--used];
      ++kvt_stack_reused;
      return p;
    }
  ++kvt_stack_passed;
  return kvt_stack_prev.alloc(kvt_stack_prev.ctx, size);
}

static void cached_free(void *ctx, void *ptr, size_t size) {
  (void)ctx;
  if (ptr != NULL && size <= MAX_CACHED && used < SLOTS) {
    slot[used].ptr = ptr;
    slot[used].size = size;
    ++used;
    return;
  }
  kvt_stack_prev.free(kvt_stack_prev.ctx, ptr, size);
}

int kvt_stack_abi(void) { return 1; }

void kvt_stack_init(void) {
  kvt_stack_ours.ctx = NULL;
  kvt_stack_ours.alloc = cached_alloc;
  kvt_stack_ours.free = cached_free;
}
