/* A copy that sums the bytes it moves: tierkv.xxh3.copy_and_sum without the interpreter per object.
 *
 * Loaded with ctypes (no Python API here, so no interpreter lock is held while it runs).
 * The hash functions are xxHash's, handed in as function pointers by tierkv/xxh3.py from
 * the xxhash package's own extension module: this file holds no hash of its own.
 *
 * tierkv_copy_sum: for each of `count` moves, memmove(dst[i], src[i], len[i]) one `piece`
 * of bytes at a time, and after each piece feed the first bytes it wrote (up to `sum_bytes`
 * in all, in order) to the streaming state: each piece is hashed from the core's caches
 * right after its copy.  Returns the digest.  Destinations must not overlap one another
 * nor any source.
 *
 * tierkv_copy_sum_jobs: a batch of such jobs, job j being moves first[j] .. first[j+1]-1 of
 * the dst/src/len arrays with sum_bytes[j] bytes summed into out[j].  Every thread that calls
 * it with the same `next` counter (starting at 0) takes the next job until none is left, so
 * the threads share the batch, and a thread that comes late finds less (or nothing) to do.
 * Each caller hands in a streaming state of its own.  out[j] is written once, by the thread
 * that took job j: the caller reads it after every thread's call has returned.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

typedef int (*tierkv_reset_fn)(void *state);
typedef int (*tierkv_update_fn)(void *state, const void *data, size_t n);
typedef uint64_t (*tierkv_digest_fn)(void *state);

uint64_t tierkv_copy_sum(unsigned char *const *dst, const unsigned char *const *src, const size_t *len,
                         size_t count, size_t sum_bytes, size_t piece, void *state,
                         tierkv_reset_fn reset, tierkv_update_fn update, tierkv_digest_fn digest)
{
    if (piece == 0)
        piece = 64 * 1024;
    reset(state);
    for (size_t i = 0; i < count; i++) {
        size_t n = len[i];
        for (size_t off = 0; off < n; off += piece) {
            size_t m = n - off < piece ? n - off : piece;
            memmove(dst[i] + off, src[i] + off, m);
            if (sum_bytes) {
                size_t h = m < sum_bytes ? m : sum_bytes;
                update(state, dst[i] + off, h);
                sum_bytes -= h;
            }
        }
    }
    return digest(state);
}

void tierkv_copy_sum_jobs(unsigned char *const *dst, const unsigned char *const *src, const size_t *len,
                          const size_t *first, size_t njobs, const size_t *sum_bytes, uint64_t *out,
                          size_t *next, size_t piece, void *state,
                          tierkv_reset_fn reset, tierkv_update_fn update, tierkv_digest_fn digest)
{
    for (;;) {
        size_t j = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED);
        if (j >= njobs)
            return;
        size_t a = first[j];
        out[j] = tierkv_copy_sum(dst + a, src + a, len + a, first[j + 1] - a, sum_bytes[j], piece, state,
                                 reset, update, digest);
    }
}
