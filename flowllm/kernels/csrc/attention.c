/* Paged decode attention read straight from the KV cache, and the K/V store.

Layouts (elements, row-major): query and out [num_tokens, H, D] with any token stride;
k_cache, v_cache [num_blocks, block_size, kv_heads, D]; block_tables [num_seqs,
table_stride] int32; seq_lens [num_seqs] int32. Caches, query and out share one dtype,
float32 or bfloat16; the math is float32 (bf16 widened by a shift or a mask, so bf16 runs
on any CPU the library is built for; the output is rounded to nearest even). D must be a
multiple of 16 (float32) or 32 (bfloat16), whole vectors (or pairs) of either build.

One work item is one (run of queries, kv head): a run is up to ROWS_PER_RUN consecutive
queries of one sequence at successive positions (a prefill chunk's rows, or a sequence's
drafts being verified), whose keys are read once for all of them; its queries' `group`
heads each are scored against the sequence's keys LANES tokens at a time (LANES dot
products, then one transposing reduction), the scores go to a per-thread scratch (capped
there by softcap * tanh(score / softcap) when a softcap is given), a softmax runs over
each query's own keys in place, and a second walk over the blocks sums the values
weighted by the probabilities. A query's result does not depend on its run: every sum
is over the same terms in the same order as for the query alone.
A sliding window (`window` > 0) starts both walks at the first of the last `window`
positions: keys before it are never read. (An
online softmax in one walk measured slower in every case: benchmarks/README.md.)
*/
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "flowllm.h"
#include "kernel_args.h"

#define INLINE static inline __attribute__((always_inline))

enum { LANES = VL, HEADS_PER_PASS = 4, VECS_PER_PASS = 4, PREFETCH_ROWS = 32, ROWS_PER_RUN = 8 };
enum { OK = 0, BAD_SEQ_LEN = 1, BAD_BLOCK = 2, BAD_INDEX = 3, NO_MEMORY = 4 };

/* The LANES float32 lanes of a row's elements [p + LANES half, p + LANES (half + 1)), p a
   multiple of 2 LANES. bf16 rows go in runs of 2 LANES elements, one load widened by a
   shift (half 0: the even elements) or a mask (half 1: the odd ones): lane k is element
   p + LANES half + k for float32 but p + 2k + half for bf16. Queries, keys, values and
   outputs all use this order, so dot products and sums see each element once and store_lanes
   undoes it. */
INLINE vf load_lanes(const void *base, int64_t p, const int half, const int bf16) {
  if (!bf16) return vf_load((const float *)base + p + LANES * half);
  const uint16_t *pair = (const uint16_t *)base + p;
  return half ? vf_bf16_odd(pair) : vf_bf16_even(pair);
}

/* Store lanes in load_lanes' order, bf16 rounded to nearest even into every other 16-bit
   slot of the pair. */
INLINE void store_lanes(void *base, int64_t p, const int half, vf x, const int bf16) {
  if (!bf16)
    vf_store((float *)base + p + LANES * half, x);
  else if (half)
    vf_store_bf16_odd((uint16_t *)base + p, x);
  else
    vf_store_bf16_even((uint16_t *)base + p, x);
}

/* Walks one sequence's cache rows for one kv head in token order. */
typedef struct {
  const char *cache;    /* k_cache or v_cache, plus the kv head's offset */
  const int32_t *table; /* the sequence's block-table row */
  int64_t block_size;
  int64_t row_bytes;     /* kv_heads * D elements: from one token's row to the next */
  int64_t block, offset; /* where the next row is */
} Cursor;

/* A cursor at token position `start` of the sequence. */
INLINE Cursor cursor(const void *cache, int64_t head_bytes, const int32_t *table,
                     int64_t block_size, int64_t row_bytes, int64_t start) {
  return (Cursor){(const char *)cache + head_bytes,
                  table,
                  block_size,
                  row_bytes,
                  start / block_size,
                  start % block_size};
}

INLINE const char *next_row(Cursor *c) {
  const char *row =
      c->cache + ((int64_t)c->table[c->block] * c->block_size + c->offset) * c->row_bytes;
  if (++c->offset == c->block_size) c->offset = 0, c->block++;
  return row;
}

/* A cursor over n rows of `bytes` each that keeps the row PREFETCH_ROWS ahead in flight:
   one row's compute is far shorter than a DRAM miss, and a kv head's slices of a block's
   rows (128 B every kv_heads * 128 B for bf16 GPT-2) do not train the hardware
   prefetchers. Into L2 (T2), which was fastest (benchmarks/README.md "Kernel design
   figures"). */
typedef struct {
  Cursor at, ahead;
  int64_t unfetched; /* rows not prefetched yet */
  int64_t bytes;
} Stream;

INLINE void prefetch_next(Stream *s) {
  if (s->unfetched > 0) {
    const char *row = next_row(&s->ahead);
    for (int64_t i = 0; i < s->bytes; i += 64) _mm_prefetch(row + i, _MM_HINT_T2);
    s->unfetched--;
  }
}

INLINE Stream stream(Cursor c, int64_t n, int64_t bytes) {
  Stream s = {c, c, n, bytes};
  for (int i = 0; i < PREFETCH_ROWS; i++) prefetch_next(&s);
  return s;
}

INLINE const char *stream_next(Stream *s) {
  prefetch_next(s);
  return next_row(&s->at);
}

/* scores[h * stride + t] = qf[h] . k[t] for t < n (qf is scaled already). */
INLINE void score(const float *qf, int64_t group, int64_t D, Cursor keys, int64_t n, float *scores,
                  int64_t stride, const int bf16) {
  Stream rows = stream(keys, n, D * (bf16 ? 2 : 4));
  for (int64_t t0 = 0; t0 < n; t0 += LANES) {
    const int64_t m = n - t0 < LANES ? n - t0 : LANES;
    const char *k[LANES];
    for (int j = 0; j < m; j++) k[j] = stream_next(&rows);
    for (int j = m; j < LANES; j++) k[j] = k[0]; /* any valid row: the lane is dropped */
    for (int64_t h = 0; h < group; h++) {
      /* LANES independent sums (one per token) over the head's chunks of LANES */
      vf part[LANES];
      for (int j = 0; j < LANES; j++) part[j] = vf_zero();
      int64_t c = 0;
      for (; c + 2 * LANES <= D; c += 2 * LANES) {
        const vf q0 = vf_load(qf + h * D + c);
        const vf q1 = vf_load(qf + h * D + c + LANES);
        for (int j = 0; j < LANES; j++) {
          part[j] = vf_fma(q0, load_lanes(k[j], c, 0, bf16), part[j]);
          part[j] = vf_fma(q1, load_lanes(k[j], c, 1, bf16), part[j]);
        }
      }
      if (c < D) { /* float32 rows of LANES (mod 2 LANES) elements */
        const vf q0 = vf_load(qf + h * D + c);
        for (int j = 0; j < LANES; j++) part[j] = vf_fma(q0, load_lanes(k[j], c, 0, bf16), part[j]);
      }
      vf_store_n(scores + h * stride + t0, m, vf_transpose_sums(part));
    }
  }
}

/* scores[0..n) -> softcap * tanh(scores / softcap) in place (lanes past n too: scratch). */
INLINE void cap_scores(float *scores, int64_t n, float softcap) {
  const vf cap = vf_set1(softcap), inv = vf_set1(1.0f / softcap);
  for (int64_t t = 0; t < n; t += LANES)
    vf_store(scores + t, vf_mul(cap, vf_tanh(vf_mul(vf_load(scores + t), inv))));
}

/* scores[0..n) -> exp(scores - max) in place; returns their sum. */
INLINE float softmax_numerators(float *scores, int64_t n) {
  const vf lowest = vf_set1(-__builtin_inff());
  vf mx = lowest;
  for (int64_t t = 0; t < n; t += LANES) /* lanes past n hold scratch garbage */
    mx = vf_max(mx, vf_select(vm_first(n - t), lowest, vf_load(scores + t)));
  const vf m = vf_set1(vf_max_of(mx));
  vf sum = vf_zero();
  for (int64_t t = 0; t < n; t += LANES) {
    const vf e = vf_exp(vf_sub(vf_load(scores + t), m));
    const vf valid = vf_select(vm_first(n - t), vf_zero(), e);
    vf_store(scores + t, valid);
    sum = vf_add(sum, valid);
  }
  return vf_sum(sum);
}

/* out[h][c0 + c] = sum_t p[h][t] v[t][c0 + c] * inv[h] for HN heads and CN vectors of D,
   the accumulators held in registers across the walk over the rows. */
INLINE void weigh_values(const float *p, int64_t stride, const float *inv, Cursor values, int64_t n,
                         int64_t c0, void *out, int64_t D, const int HN, const int CN,
                         const int bf16) {
  const int esz = bf16 ? 2 : 4;
  vf acc[HEADS_PER_PASS][VECS_PER_PASS];
  for (int h = 0; h < HN; h++)
    for (int c = 0; c < CN; c++) acc[h][c] = vf_zero();
  values.cache += c0 * esz;
  Stream rows = stream(values, n, CN * LANES * esz);
  for (int64_t t = 0; t < n; t++) {
    const char *row = stream_next(&rows);
    for (int c = 0; c < CN; c++) {
      const vf v = load_lanes(row, c / 2 * 2 * LANES, c % 2, bf16);
      for (int h = 0; h < HN; h++) acc[h][c] = vf_fma(vf_set1(p[h * stride + t]), v, acc[h][c]);
    }
  }
  for (int h = 0; h < HN; h++)
    for (int c = 0; c < CN; c++)
      store_lanes(out, h * D + c0 + c / 2 * 2 * LANES, c % 2, vf_mul(acc[h][c], vf_set1(inv[h])),
                  bf16);
}

#define WEIGH_CASE(H, C)                                             \
  case (H - 1) * VECS_PER_PASS + C - 1:                              \
    weigh_values(p, stride, inv, values, n, c0, out, D, H, C, bf16); \
    break;

/* weigh_values with compile-time HN, CN (so its accumulators stay in registers). */
INLINE void weigh_values_any(const float *p, int64_t stride, const float *inv, Cursor values,
                             int64_t n, int64_t c0, void *out, int64_t D, int hn, int cn,
                             const int bf16) {
  switch ((hn - 1) * VECS_PER_PASS + cn - 1) {
    WEIGH_CASE(1, 1)
    WEIGH_CASE(1, 2)
    WEIGH_CASE(1, 3)
    WEIGH_CASE(1, 4)
    WEIGH_CASE(2, 1)
    WEIGH_CASE(2, 2)
    WEIGH_CASE(2, 3)
    WEIGH_CASE(2, 4)
    WEIGH_CASE(3, 1)
    WEIGH_CASE(3, 2)
    WEIGH_CASE(3, 3)
    WEIGH_CASE(3, 4)
    WEIGH_CASE(4, 1)
    WEIGH_CASE(4, 2)
    WEIGH_CASE(4, 3)
    WEIGH_CASE(4, 4)
  }
}

/* One (run of queries, kv head): q[j] and out[j] point at query j's group's [group, D]
   heads, which see the first lens[j] of the n keys and values the cursors walk. */
INLINE void attend(const char *const *q, char *const *out, const int64_t *lens, int64_t rows,
                   Cursor keys, Cursor values, int64_t n, int64_t group, int64_t D, float scale,
                   float softcap, float *scratch, int64_t stride, const int bf16) {
  const int64_t heads = rows * group;
  float *qf = scratch;         /* [heads, D] */
  float *inv = qf + heads * D; /* [heads] */
  float *scores = inv + heads; /* [heads, stride] */
  for (int64_t j = 0; j < rows; j++)
    for (int64_t i = 0; i < group * D; i += LANES) {
      const vf x = i & LANES ? load_lanes(q[j], i - LANES, 1, bf16) : load_lanes(q[j], i, 0, bf16);
      vf_store(qf + j * group * D + i, vf_mul(x, vf_set1(scale)));
    }
  score(qf, heads, D, keys, n, scores, stride, bf16);
  for (int64_t h = 0; h < heads; h++) {
    if (softcap > 0.0f) cap_scores(scores + h * stride, lens[h / group], softcap);
    inv[h] = 1.0f / softmax_numerators(scores + h * stride, lens[h / group]);
  }
  for (int64_t j = 0; j < rows; j++)
    for (int64_t h0 = 0; h0 < group; h0 += HEADS_PER_PASS) {
      const int hn = group - h0 < HEADS_PER_PASS ? (int)(group - h0) : HEADS_PER_PASS;
      const int64_t h = j * group + h0;
      for (int64_t c0 = 0; c0 < D; c0 += VECS_PER_PASS * LANES) {
        const int64_t left = (D - c0) / LANES;
        const int cn = left < VECS_PER_PASS ? (int)left : VECS_PER_PASS;
        weigh_values_any(scores + h * stride, stride, inv + h, values, lens[j], c0,
                         out[j] + h0 * D * (bf16 ? 2 : 4), D, hn, cn, bf16);
      }
    }
}

/* Whether query i's keys extend query i - 1's: as long or longer, in the same blocks as far
   as query i - 1's reach (the next position of one sequence, say), so one walk over query
   i's keys serves both. */
INLINE int extends(const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                   int64_t block_size, int64_t prev, int64_t cur) {
  const int64_t len = seq_lens[prev], nb = (len + block_size - 1) / block_size;
  if (seq_lens[cur] < len) return 0;
  const int32_t *a = block_tables + prev * table_stride, *b = block_tables + cur * table_stride;
  return memcmp(a, b, (size_t)nb * sizeof(int32_t)) == 0;
}

/* Attention of `n` decode queries over their sequences' cached context.

   seqs[i] is the i-th sequence attended (of num_seqs) and rows[i] its query's row in
   query/out (of num_tokens); NULL: i and seqs[i]. Strides count elements. window > 0: each
   query sees its sequence's last `window` positions only; softcap > 0: scores are capped. D must be
   a multiple of 16 (32 for bf16) and the heads of a token contiguous. Every index is checked before
   anything is read: returns OK, or BAD_INDEX / BAD_SEQ_LEN / BAD_BLOCK with *bad set to
   the offending entry i, or NO_MEMORY. */
static int decode_attention(int bf16, const void *query, int64_t q_stride, const void *k_cache,
                            const void *v_cache, int64_t num_blocks, int64_t block_size,
                            int64_t kv_heads, int64_t group, int64_t D, const int32_t *block_tables,
                            int64_t table_stride, const int32_t *seq_lens, int64_t num_seqs,
                            const int64_t *seqs, const int64_t *rows, int64_t n, int64_t num_tokens,
                            float scale, int64_t window, float softcap, void *out,
                            int64_t out_stride, int64_t *bad) {
  int64_t longest = 0;
  for (int64_t i = 0; i < n; i++) {
    const int64_t s = seqs ? seqs[i] : i, r = rows ? rows[i] : s;
    *bad = i;
    if (s < 0 || s >= num_seqs || r < 0 || r >= num_tokens) return BAD_INDEX;
    const int64_t len = seq_lens[s], nb = (len + block_size - 1) / block_size;
    if (len < 1 || nb > table_stride) return BAD_SEQ_LEN;
    for (int64_t b = 0; b < nb; b++) {
      const int32_t id = block_tables[s * table_stride + b];
      if (id < 0 || id >= num_blocks) return BAD_BLOCK;
    }
    longest = len > longest ? len : longest;
  }
  const int64_t stride = (longest + LANES - 1) / LANES * LANES; /* scores per head */
  const int64_t esz = bf16 ? 2 : 4;
  /* the runs: queries runs[k] .. runs[k + 1] - 1 (a window gives each query its own start,
     so each query runs alone then) */
  int64_t *runs = malloc((n + 1) * sizeof(int64_t)), num_runs = 0;
  if (runs == NULL) return NO_MEMORY;
  for (int64_t i = 0; i < n; i++) {
    const int joins = window == 0 && i > 0 && i - runs[num_runs - 1] < ROWS_PER_RUN &&
                      extends(block_tables, table_stride, seq_lens, block_size,
                              seqs ? seqs[i - 1] : i - 1, seqs ? seqs[i] : i);
    if (!joins) runs[num_runs++] = i;
  }
  runs[num_runs] = n;
  int status = OK;
#pragma omp parallel if (num_runs * kv_heads > 1)
  {
    float *scratch = malloc((ROWS_PER_RUN * group * (D + 1 + stride)) * sizeof(float));
    if (scratch == NULL) {
#pragma omp atomic write
      status = NO_MEMORY;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_runs * kv_heads; item++) {
      if (scratch == NULL) continue;
      const int64_t k = item / kv_heads, j = item % kv_heads;
      const int64_t first = runs[k], count = runs[k + 1] - first;
      const char *q[ROWS_PER_RUN];
      char *o[ROWS_PER_RUN];
      int64_t lens[ROWS_PER_RUN], start = 0, s = 0;
      for (int64_t i = 0; i < count; i++) {
        s = seqs ? seqs[first + i] : first + i; /* the run's last: the longest */
        const int64_t r = rows ? rows[first + i] : s, len = seq_lens[s];
        start = window > 0 && len > window ? len - window : 0;
        q[i] = (const char *)query + (r * q_stride + j * group * D) * esz;
        o[i] = (char *)out + (r * out_stride + j * group * D) * esz;
        lens[i] = len - start;
      }
      const int32_t *table = block_tables + s * table_stride;
      const int64_t head = j * D * esz, row = kv_heads * D * esz;
      const Cursor keys = cursor(k_cache, head, table, block_size, row, start);
      const Cursor values = cursor(v_cache, head, table, block_size, row, start);
      const int64_t n_keys = lens[count - 1];
      if (bf16)
        attend(q, o, lens, count, keys, values, n_keys, group, D, scale, softcap, scratch, stride,
               1);
      else
        attend(q, o, lens, count, keys, values, n_keys, group, D, scale, softcap, scratch, stride,
               0);
    }
    free(scratch);
  }
  free(runs);
  return status;
}

/* cache rows slots[i] <- key/value rows i (kv_heads * D contiguous elements of `esz` bytes
   each, token strides in elements). Returns OK, or BAD_BLOCK with *bad set to the first
   token whose slot is outside the cache (nothing written then). */
static int store_kv(const void *key, int64_t key_stride, const void *value, int64_t value_stride,
                    void *k_cache, void *v_cache, int64_t num_slots, const int64_t *slots,
                    int64_t n, int64_t row, int64_t esz, int64_t *bad) {
  for (int64_t i = 0; i < n; i++) {
    if (slots[i] < 0 || slots[i] >= num_slots) {
      *bad = i;
      return BAD_BLOCK;
    }
  }
  const int64_t bytes = row * esz;
  for (int64_t i = 0; i < n; i++) {
    memcpy((char *)k_cache + slots[i] * bytes, (const char *)key + i * key_stride * esz, bytes);
    memcpy((char *)v_cache + slots[i] * bytes, (const char *)value + i * value_stride * esz, bytes);
  }
  return OK;
}

/* ---- Entry points (kernel_args.h). A failed check returns its code + 256 times the
   offending entry's index. ---- */

int64_t flowllm_decode_attention(const struct flowllm_decode_attention_args *a) {
  int64_t bad = 0;
  const int status = decode_attention(
      (int)a->bf16, a->query, a->q_stride, a->k_cache, a->v_cache, a->num_blocks, a->block_size,
      a->kv_heads, a->group, a->head_dim, a->block_tables, a->table_stride, a->seq_lens,
      a->num_seqs, a->seqs, a->rows, a->n, a->num_tokens, (float)a->scale, a->window,
      (float)a->softcap, a->out, a->out_stride, &bad);
  return status == OK ? 0 : status + 256 * bad;
}

int64_t flowllm_store_kv(const struct flowllm_store_kv_args *a) {
  int64_t bad = 0;
  const int status = store_kv(a->key, a->key_stride, a->value, a->value_stride, a->k_cache,
                              a->v_cache, a->num_slots, a->slots, a->n, a->row, a->elem_size, &bad);
  return status == OK ? 0 : status + 256 * bad;
}
