/* Two hot loops of lightning_shardrec on CPU, as plain C on raw buffers.
 *
 * setup.py builds this file with the package (lightning_shardrec/modules/dynamic/_loops.<suffix>) and
 * lightning_shardrec/modules/dynamic/native.py loads it with ctypes; lightning_shardrec/modules/dynamic/ops.py calls
 * it from torch.library custom ops (shardrec::locate, place, serve, write_uniform_rows) that check every
 * argument's dtype, contiguity and shape first; the index values that address memory (table, bucket, row)
 * are checked here, in the pass that reads them or a read-only pass before the first write, and a
 * failure returns a negative code with nothing written (the op then names the argument and its range).
 * Each function has a tensor-op twin that runs wherever this library cannot (a package built without
 * it, other devices), and the tests hold the two equal bit for bit. No torch headers: it builds in a
 * fraction of a second.
 *
 * shardrec_locate (twin: dynamic_slots.locate): where dynamic tables' raw ids live.
 *   For every raw id i of table t = table[i] (table == NULL: every id is of table 0):
 *     bucket = (splitmix64(id) >> 1) % num_buckets[t] - lo[t]    must lie in [0, count[t])
 *     flat   = bucket + start[t]                                  -> bucket_out[i]
 *     slot   = first entry of flat's `width` entries of held holding the id, if live
 *              (last >= 0), else -1                               -> slot_out[i]
 *   and with train != 0 every hit records its sighting: last[slot] = steps[t], seen[slot] += 1.
 *   Returns -1, the index of the first id outside its table's buckets, or LOCATE_BAD_TABLE for a table
 *   index outside [0, ntables) (nothing recorded in either case).
 *
 * shardrec_place (twin: dynamic_slots.place): unique ids, sorted by bucket then id, take entries of
 *   their bucket in (held, last, count): per bucket, ids by most `total` (ties: as given), entries
 *   not seen this step (last < step) by (LFU: count,) last seen, index; the first min(ids, such
 *   entries) pairs match. out[i] = entry or -1; the occupied entries taken over go to displaced.
 *   step[i * step_stride] is id i's step. Returns the number displaced, or PLACE_BAD_BUCKET /
 *   PLACE_UNSORTED for buckets outside [0, nbuckets) or out of order (nothing written).
 *
 * shardrec_serve (twin: inference.id_map.QuantIdMap.forward): a frozen dynamic table's rows.
 *   out[i] = the slot of bucket (splitmix64(id) >> 1) % num_buckets holding the id where live[slot],
 *   else `missing`.
 *
 * shardrec_uniform_rows (twin: table_init.uniform_rows, numpy on CPU): counter-based uniform rows
 *   (dynamic tables' fresh rows; static tables' init never calls it).
 *   out[r][j] = low[r] + (high[r] - low[r]) * u, u = (splitmix64(seeds[r] + (c0 + j) * GOLDEN) >> 11) * 2^-53,
 *   in double (product, then sum: two roundings, as the tensor ops), stored as float (out_float)
 *   or double. low/high == NULL: u itself. Row r is written at out + at[r] * stride elements
 *   (at == NULL: r * cols): straight into the rows of a table. Returns 0, or ROWS_OUT_OF_RANGE for an
 *   at[r] outside [0, nrows) (nothing written).
 */
#include <stdint.h>
#include <stdlib.h>

#define GOLDEN 0x9E3779B97F4A7C15ull

#define LOCATE_BAD_TABLE (-2) /* shardrec_locate: a table index outside [0, ntables) (nothing written) */
#define PLACE_BAD_BUCKET (-1) /* shardrec_place: a bucket outside [0, nbuckets) (nothing written) */
#define PLACE_UNSORTED (-2)   /* shardrec_place: ids not sorted by bucket (nothing written) */
#define ROWS_OUT_OF_RANGE (-1) /* shardrec_uniform_rows: a row outside [0, nrows) (nothing written) */

#ifndef SHARDREC_SOURCE
#define SHARDREC_SOURCE "unknown" /* setup.py defines it: the first 16 hex digits of this file's sha256 */
#endif

/* The source this library was built from: native.py refuses a library built from another native.c. */
const char *shardrec_source(void) { return SHARDREC_SOURCE; }

#define PREFETCH 32 /* ids ahead: rows are random, so ask for later ones while this one is compared */

static inline uint64_t splitmix64(uint64_t z) {
    z += GOLDEN;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

int64_t shardrec_locate(int64_t n, const int64_t *ids, const int64_t *table, int64_t ntables,
                        const int64_t *num_buckets, const int64_t *lo, const int64_t *count, const int64_t *start,
                        const int64_t *steps, int64_t width, const int64_t *held, int64_t *last, int64_t *seen,
                        int64_t train, int64_t *bucket_out, int64_t *slot_out) {
    for (int64_t i = 0; i < n; ++i) {
        int64_t t = table ? table[i] : 0;
        if (t < 0 || t >= ntables) return LOCATE_BAD_TABLE;
        int64_t b = (int64_t)((splitmix64((uint64_t)ids[i]) >> 1) % (uint64_t)num_buckets[t]) - lo[t];
        if (b < 0 || b >= count[t]) return i;
        bucket_out[i] = b + start[t];
    }
    for (int64_t i = 0; i < n; ++i) {
        if (i + PREFETCH < n) {
            const int64_t ahead = bucket_out[i + PREFETCH] * width;
            __builtin_prefetch(held + ahead);
            __builtin_prefetch(held + ahead + 8);
            __builtin_prefetch(last + ahead);
            if (train) __builtin_prefetch(seen + ahead, 1);
        }
        const int64_t id = ids[i], first = bucket_out[i] * width;
        const int64_t *row = held + first;
        int64_t slot = -1;
        for (int64_t j = 0; j < width; ++j) {
            if (row[j] == id) {
                slot = first + j;
                break;
            }
        }
        if (slot >= 0 && last[slot] < 0) slot = -1;
        slot_out[i] = slot;
        if (train && slot >= 0) {
            last[slot] = steps[table ? table[i] : 0];
            seen[slot] += 1;
        }
    }
    return -1;
}

typedef struct {
    int64_t count, last, index; /* an entry's place in policy order: LFU count (0 for LRU), last seen, index */
} entry_key;

static int entry_cmp(const void *pa, const void *pb) {
    const entry_key *a = pa, *b = pb;
    if (a->count != b->count) return a->count < b->count ? -1 : 1;
    if (a->last != b->last) return a->last < b->last ? -1 : 1;
    return (a->index > b->index) - (a->index < b->index);
}

int64_t shardrec_place(int64_t n, const int64_t *ids, const int64_t *bucket, int64_t nbuckets, const int64_t *total,
                       const int64_t *step, int64_t step_stride, int64_t width, int64_t lfu, int64_t *held,
                       int64_t *last, int64_t *count, int64_t *out, int64_t *displaced, int64_t *order) {
    /* order: n int64 of scratch (a bucket's ids in the order they choose) */
    for (int64_t i = 0; i < n; ++i) { /* the buckets' range and order, checked before anything is written */
        if (bucket[i] < 0 || bucket[i] >= nbuckets) return PLACE_BAD_BUCKET;
        if (i && bucket[i] < bucket[i - 1]) return PLACE_UNSORTED;
    }
    entry_key keys[width];
    int64_t moved = 0;
    for (int64_t i0 = 0, i1; i0 < n; i0 = i1) {
        for (i1 = i0 + 1; i1 < n && bucket[i1] == bucket[i0]; ++i1) {
        }
        if (i1 + PREFETCH < n) { /* buckets are random: ask for a later one's entries now */
            const int64_t ahead = bucket[i1 + PREFETCH] * width;
            __builtin_prefetch(last + ahead, 1);
            __builtin_prefetch(count + ahead, 1);
            __builtin_prefetch(held + ahead, 1);
        }
        const int64_t run = i1 - i0, first = bucket[i0] * width, now = step[i0 * step_stride];
        for (int64_t k = 0; k < run; ++k) { /* by most sightings, ties as given: stable insertion */
            int64_t j = k;
            while (j > 0 && total[i0 + order[i0 + j - 1]] < total[i0 + k]) {
                order[i0 + j] = order[i0 + j - 1];
                --j;
            }
            order[i0 + j] = k;
        }
        int64_t free = 0;
        for (int64_t j = first; j < first + width; ++j) { /* entries not seen this step, in policy order */
            if (last[j] < now) keys[free++] = (entry_key){lfu ? count[j] : 0, last[j], j};
        }
        if (run == 1 && free > 1) { /* one id: the first entry is enough */
            for (int64_t j = 1; j < free; ++j)
                if (entry_cmp(&keys[j], &keys[0]) < 0) keys[0] = keys[j];
        } else {
            qsort(keys, (size_t)free, sizeof(entry_key), entry_cmp);
        }
        for (int64_t k = 0; k < run; ++k) {
            const int64_t i = i0 + order[i0 + k];
            if (k >= free) {
                out[i] = -1;
                continue;
            }
            const int64_t e = keys[k].index;
            if (last[e] >= 0) displaced[moved++] = e;
            out[i] = e;
            held[e] = ids[i];
            last[e] = now;
            count[e] = total[i];
        }
    }
    return moved;
}

void shardrec_serve(int64_t n, const int64_t *ids, int64_t num_buckets, int64_t width, const int64_t *held,
                    const uint8_t *live, int64_t missing, int64_t *out) {
    for (int64_t i = 0; i < n; ++i) {
        if (i + PREFETCH < n) {
            const uint64_t ahead = (splitmix64((uint64_t)ids[i + PREFETCH]) >> 1) % (uint64_t)num_buckets;
            __builtin_prefetch(held + ahead * width);
            __builtin_prefetch(held + ahead * width + 8);
        }
        const int64_t first = (int64_t)((splitmix64((uint64_t)ids[i]) >> 1) % (uint64_t)num_buckets) * width;
        int64_t row = missing;
        for (int64_t j = 0; j < width; ++j) {
            if (held[first + j] == ids[i] && live[first + j]) {
                row = first + j;
                break;
            }
        }
        out[i] = row;
    }
}

int64_t shardrec_uniform_rows(int64_t rows, int64_t cols, int64_t c0, const int64_t *seeds, const double *low,
                              const double *high, int64_t out_float, void *out, const int64_t *at, int64_t nrows,
                              int64_t stride) {
    for (int64_t r = 0; at && r < rows; ++r) /* every target row in range before anything is written */
        if (at[r] < 0 || at[r] >= nrows) return ROWS_OUT_OF_RANGE;
    for (int64_t r = 0; r < rows; ++r) {
        const uint64_t seed = (uint64_t)seeds[r];
        const double lo = low ? low[r] : 0.0, span = low ? high[r] - low[r] : 1.0;
        const int64_t base = at ? at[r] * stride : r * cols;
        for (int64_t j = 0; j < cols; ++j) {
            const uint64_t z = splitmix64(seed + (uint64_t)(c0 + j) * GOLDEN);
            double v = (double)(z >> 11) * 0x1.0p-53;
            if (low) {
                v = v * span;
                v = v + lo;
            }
            if (out_float)
                ((float *)out)[base + j] = (float)v;
            else
                ((double *)out)[base + j] = v;
        }
    }
    return 0;
}
