// pdserve::paged_attention_cpu: a step's K/V write and its attention over the paged cache, as one
// native call per layer, for short queries (decode, speculative verification, a draft's passes)
// and prefill chunks of any length (a long chunk's queries in tiles: `attend`).
//
// The torch path (`gathered_attention.py`) does the same in about twenty ATen ops per layer,
// whose fixed costs are most of a small model's batch-1 step on a CPU. Here each sequence's
// queries read its keys and values in place, block by block, with no gather copy.
//
// Layout: the flat batch holds each sequence's queries contiguously, sequence s at rows
// [query_starts[s], query_starts[s + 1]); its last query sits at position context_lens[s] - 1,
// and query i of n at position context_lens[s] - n + i sees keys 0 ..= that position.
// Math in float32 whatever the tensors' dtype; the output has q's dtype. The caches hold q's
// dtype or, under float32 rows, a 16-bit one (`EngineConfig.kv_cache_dtype`): rows are rounded
// as they are written and widened as they are read (`widen`).
//
// Vector loops (`attention_vectors.h`): AVX-512 where the compiler targets it (sixteen keys per dot-product batch, the two
// query rows of a KV head sharing each value row's loads, and the softmax in registers), else
// AVX2 (eight keys, and the softmax eight lanes at a time), else plain loops. The softmax was
// half of a decode layer's compute before it ran in vector registers: its scalar exp did not
// vectorize.
// Tensor and the few ops used, not <ATen/ATen.h>: every op's header took a third to half the compile.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_vectors.h"  // PDSERVE_AVX2 / PDSERVE_AVX512, and the vector loops
#include "kv_rows.h"            // write_rows, widen: rows between the step's dtype and the cache's
#include "native_ops.h"         // this op as a C++ function, for decoder.h

namespace {

// A sequence with more queries than this (a prefill chunk) is split into work items by KV head, and
// a long one by tiles of queries too (as many as step_inputs.MAX_GATHERED_QUERY_LEN).
constexpr int64_t kWholeQueries = 16;
// Below this many multiply-adds a step's attention stays on one thread: the fork and join cost
// about what a small batch's decode attention does.
constexpr int64_t kMinParallelWork = int64_t{1} << 20;
// Rows of one KV head (its query heads times the queries that see a block of keys) from which
// the AVX-512 scores transpose sixteen keys once for all of them (`transpose16`), instead of
// summing each row's products across lanes (`dot16`). Against the build before (scratch A/B, one
// sequence, 8 query and 4 KV heads of 32, seven interleaved repeats of 1000 calls, medians): 10
// rows (a 5-token verification) 0.99x, 18 rows 1.14x, a 64- and a 128-token prefill chunk 1.23x
// and 1.21x, the value side's four rows at a time (`axpy_row_run`; since fea8141, even passes of
// up to six) included. At 4 rows the transposition lost (0.92x), hence 8; decode (2 rows, dot16
// as before) 0.98x. That is at head_dim 32. At 64 and 128 it wins from 4 rows on (a decode step of
// the common 4 query heads per KV head): the key pass alone 1.1-1.2x at 4 rows, 0.8-0.9x at 2
// (`benchmarks/decode_k_layout.py`, BENCHMARKS.md; the same vector functions), hence
// `transposed_rows`. At head_dim 32 the key pass alone crosses over near 16 rows (scratch, the same
// script's vector functions: 0.83x at 8 rows, 0.93x at 10, 0.94x at 12, 1.09x at 16), so a
// verification of 3 to 7 drafts at two query heads per KV head takes dot16 (BENCHMARKS.md,
// Verification attention by change).
constexpr int64_t kTransposedRows = 16;
constexpr int64_t kTransposedRowsWide = 4;  // head_dim 64 and more
constexpr int64_t transposed_rows(int64_t head_dim) { return head_dim >= 64 ? kTransposedRowsWide : kTransposedRows; }
// The most floats a thread's attention buffer keeps between calls (1 MB): a decode or verification
// step's scores, or a prefill tile's (kTileFloats).
constexpr size_t kKeptFloats = size_t{1} << 18;
// The value pass takes blocks in groups of about this many bytes of one KV head's values (see
// `attend`): 8 blocks of 16 keys at head_dim 32, 2 at head_dim 128.
constexpr int64_t kGroupBytes = 16384;
// A prefill chunk's items (one KV head's query heads each) take its queries in tiles of about as
// many as keep a tile's scores within this many floats (1 MB, a Zen 4 core's L2), and at least
// kMinTileRows. With an item's scores whole, they left the cache from about 1536-token prompts on
// (the demo target's 2 heads per KV head): at 2048 tokens the op took 78 ms a layer, 1.9x the
// per-sequence SDPA path; in tiles, 28 ms, and 82 against 192 ms for 2048 queries after 2048
// cached keys (one thread, AMD EPYC, scratch timing). Tiles of 2^16 to 2^20 floats timed alike.
// Past some 8k keys the floor decides, and a tile's scores outgrow the L2: there, with 4 heads per
// KV head of 128, the op ran at SDPA's speed (0.98-0.99x, 2048 and 512 queries after 8k keys) with
// a floor of 32 rows, 0.92x with 64; at head_dim 32, 16 rows lost a quarter of 32's speed.
constexpr int64_t kTileFloats = int64_t{1} << 18;
constexpr int64_t kMinTileRows = 32;

// Queries a tile of a prefill chunk takes, its item's heads `group` and its context `ctx`.
inline int64_t tile_rows(int64_t group, int64_t ctx) {
  return std::max(kMinTileRows, kTileFloats / std::max<int64_t>(1, group * ctx));
}

// HD: head_dim known at compile time (0: read from `head_dim`), so the per-key loops unroll.
// T: q's and the output's dtype; C: the caches'.
template <typename T, typename C, int HD>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_ids, const int64_t* context_lens, const int64_t* query_starts,
            int64_t num_seqs, double scale, at::Tensor& out) {
  const int64_t num_heads = q.size(1), head_dim = HD ? HD : q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t q_stride = q.stride(0), kv_row = num_kv_heads * head_dim, block_stride = block_size * kv_row;
  const int64_t ids_stride = block_ids.stride(0), max_blocks = block_ids.size(1);
  const int64_t num_cache_blocks = k_cache.size(0);
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float sc = static_cast<float>(scale);
  // the AVX2 loops: head_dim a multiple of 8 known at compile time (keys and values are float32
  // by then: read in place, or converted into `kv`)
  [[maybe_unused]] constexpr bool kVector = HD > 0 && HD % 8 == 0;
  [[maybe_unused]] constexpr bool kWide = HD > 0 && HD % 16 == 0;  // the AVX-512 loops

  for (int64_t s = 0; s < num_seqs; ++s) {  // checked once, before any thread reads
    const int64_t nq = query_starts[s + 1] - query_starts[s], ctx = context_lens[s];
    TORCH_CHECK(nq >= 0 && ctx >= nq && (ctx + block_size - 1) / block_size <= max_blocks,
                "paged_attention_cpu: context ", ctx, " of sequence ", s, " does not fit its queries or blocks");
    for (int64_t b = 0; b < (ctx + block_size - 1) / block_size; ++b) {
      const int64_t block = ids[s * ids_stride + b];
      TORCH_CHECK(block >= 0 && block < num_cache_blocks, "paged_attention_cpu: block ", block, " out of range");
    }
  }

  // Work items: a sequence of up to kWholeQueries queries (decode, verification, a draft's
  // passes) is one item, its blocks read front to back, every head of a key row at once (a block
  // is block_size * kv_row contiguous values), so the hardware prefetcher sees long runs instead
  // of one head's 128 bytes per row. A longer chunk (a prefill) is one item per KV head: its
  // work dwarfs the split's, threads share a single long prompt (one item per sequence left a
  // prompt on one thread while SDPA split its heads), and each item's scores are 1/num_kv_heads
  // of the sequence's, nearer the core's cache. A long chunk's items are also split by queries,
  // into tiles whose scores stay in the core's cache (`tile_rows`): a query's attention needs no
  // other query's, and tile [qa, qb) of a chunk of nq queries with context ctx is exactly a chunk
  // of qb - qa queries whose context ends at its last query (ctx - nq + qb), so the loops below
  // take a tile as they take any item. Row r = (h - h0) * nq + i: head h of the item's heads
  // [h0, h1), query i.
  std::vector<std::array<int64_t, 5>> items;  // (sequence, first KV head, end KV head, first query, end query)
  int64_t work = 0;  // about the step's multiply-adds: one thread does it all below kMinParallelWork
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t nq = query_starts[s + 1] - query_starts[s];
    if (nq == 0) continue;
    work += num_heads * nq * context_lens[s] * head_dim * 2;
    if (nq <= kWholeQueries) {
      items.push_back({s, 0, num_kv_heads, 0, nq});
      continue;
    }
    const int64_t per_tile = tile_rows(group, context_lens[s]), tiles = (nq + per_tile - 1) / per_tile;
    for (int64_t kh = 0; kh < num_kv_heads; ++kh)
      for (int64_t t = 0; t < tiles; ++t) items.push_back({s, kh, kh + 1, nq * t / tiles, nq * (t + 1) / tiles});
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, num_items, work < kMinParallelWork ? num_items : 1, [&](int64_t begin, int64_t end) {
    // each thread's buffers, kept between calls up to kKeptFloats each: made per call, a decode
    // step's few kilobytes were a malloc and fresh pages every layer (the old build took 1.00-1.05x
    // this one's time at 5 queries against 200 keys, 1.05-1.10x against 400; with the softmax's
    // max in four chains, scratch A/B in one process, fifteen interleaved repeats)
    thread_local std::vector<float> qf, scores, acc, kv, block;
    [[maybe_unused]] thread_local std::vector<const float*> value_blocks;  // each block's values of one KV head
    // the transposed-key scores' buffers: sixteen keys [head_dim][16], and a KV head's rows
    [[maybe_unused]] thread_local std::vector<float> kt;
    [[maybe_unused]] thread_local std::vector<const float*> q_rows;
    [[maybe_unused]] thread_local std::vector<float*> out_rows;
    for (int64_t item = begin; item < end; ++item) {
      const auto [s, kh0, kh1, qa, qb] = items[item];
      const int64_t h0 = kh0 * group, h1 = kh1 * group;
      const int64_t first = query_starts[s] + qa, nq = qb - qa;
      const int64_t ctx = context_lens[s] - (query_starts[s + 1] - query_starts[s]) + qb;
      const int64_t rows = (h1 - h0) * nq;
      const auto row = [&](int64_t h, int64_t i) { return (h - h0) * nq + i; };
      const int64_t* table = ids + s * ids_stride;
      qf.resize(rows * head_dim);
      if (group * nq >= transposed_rows(HD)) kt.resize(HD * 16), q_rows.resize(group * nq), out_rows.resize(group * nq);
      for (int64_t h = h0; h < h1; ++h)
        for (int64_t i = 0; i < nq; ++i) {
          const T* src = qp + (first + i) * q_stride + h * head_dim;
          float* dst = qf.data() + row(h, i) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]) * sc;
        }
      // float32 caches are read in place. A 16-bit cache's rows are widened to float32: a
      // prefill item's (one KV head's) once into `kv`, laid out as a cache block would be: [keys,
      // then values][ctx][num_kv_heads][head_dim], only its head's columns; a decode or
      // verification item's block by block as the loops reach them (`rows_at`), into `block`,
      // which stays in L1. Widened whole first (1 MB at 1024 keys of 4 heads of 32, past the L2
      // before the loops read it), a bfloat16 cache's "batch-32" decode step at 1024 keys ran
      // 1.30x the float32 cache's at the median, 0.92x in the worst of 5 repeats; block by block,
      // 1.43x and 1.33x (`benchmarks/kv_cache_dtype.py` before bf7af34, whose timed steps held
      // fewer sequences than that; demo target, one thread, AMD EPYC; BENCHMARKS.md, KV cache dtype)
      [[maybe_unused]] constexpr bool kNarrow = !std::is_same_v<C, float>;
      [[maybe_unused]] const bool whole = nq > kWholeQueries;
      if constexpr (kNarrow) {
        if (whole) {
          kv.resize(2 * ctx * kv_row);
          const int64_t c0 = kh0 * head_dim, c1 = kh1 * head_dim;
          for (int64_t j0 = 0; j0 < ctx; j0 += block_size) {
            const int64_t n = std::min(block_size, ctx - j0), offset = table[j0 / block_size] * block_stride;
            for (int64_t j = 0; j < n; ++j) {
              widen(kp + offset + j * kv_row + c0, kv.data() + (j0 + j) * kv_row + c0, c1 - c0);
              widen(vp + offset + j * kv_row + c0, kv.data() + (ctx + j0 + j) * kv_row + c0, c1 - c0);
            }
          }
        } else {
          block.resize(block_size * kv_row);
        }
      }
      auto raw_at = [&](bool values, int64_t j0) -> const C* {  // the cache's key/value row j0 (a block's first)
        return (values ? vp : kp) + table[j0 / block_size] * block_stride;
      };
      auto rows_at = [&](bool values, int64_t j0) -> const float* {  // the same as float32
        if constexpr (!kNarrow) {
          return raw_at(values, j0);
        } else {
          if (whole) return kv.data() + ((values ? ctx : 0) + j0) * kv_row;
          widen(raw_at(values, j0), block.data(), std::min(block_size, ctx - j0) * kv_row);  // every head's
          return block.data();
        }
      };
      // asks for row jj of the block at `next` (n rows) while the current block's row jj is used
      auto prefetch_row = [&](const C* next, int64_t n, int64_t jj) {
        if (jj < n)
          for (int64_t x = kh0 * head_dim; x < kh1 * head_dim; x += 64 / sizeof(C))
            __builtin_prefetch(next + jj * kv_row + x);
      };
      scores.resize(rows * ctx);
      // Causal skipping: query i sees keys 0 .. ctx - nq + i, so the keys from `key` on are seen
      // only by queries from first_row(key) on. Scores a row does not see are never computed and
      // the values they would weigh never read (past its last block they are not even zeroed):
      // a fresh prompt's chunk (nq = ctx) costs about half of every row against every key.
      const auto first_row = [&](int64_t key) { return std::max<int64_t>(0, key - (ctx - nq)); };
      for (int64_t j0 = 0; j0 < ctx; j0 += block_size) {  // every row against the keys it sees
        const float* blk = rows_at(false, j0);
        const int64_t n = std::min(block_size, ctx - j0);
        // the next block (keys, or the first values) starts coming in while this one is used
        const C* next = j0 + block_size < ctx ? raw_at(false, j0 + block_size) : raw_at(true, 0);
        const int64_t next_n = j0 + block_size < ctx ? std::min(block_size, ctx - j0 - block_size) : std::min(block_size, ctx);
        int64_t jj = 0;
        // W keys at a time while W remain, every row of every head, through dot(q row, keys, stride, out)
        [[maybe_unused]] auto keys_by = [&](auto width, auto dot) {
          constexpr int64_t W = decltype(width)::value;
          for (; jj + W <= n; jj += W) {
            for (int64_t x = 0; x < W; ++x) prefetch_row(next, next_n, jj + x);
            const int64_t i0 = first_row(j0 + jj);
            for (int64_t h = h0; h < h1; ++h)
              for (int64_t i = i0; i < nq; ++i)
                dot(qf.data() + row(h, i) * head_dim, blk + jj * kv_row + (h / group) * head_dim, kv_row,
                    scores.data() + row(h, i) * ctx + j0 + jj);
          }
        };
#ifdef PDSERVE_AVX512
        if constexpr (kWide) {
          // a KV head's sixteen keys are transposed once and scored against all its rows that see
          // them, where there are at least transposed_rows(HD) (a prefill chunk; at head_dim 32 a
          // verification of 8 or more tokens at two query heads per KV head; from head_dim 64, a
          // decode step at 4); fewer rows take dot16 each, whose horizontal sums cost less than the
          // transposition there
          for (; jj + 16 <= n; jj += 16) {
            const int64_t i0 = first_row(j0 + jj);
            if (group * (nq - i0) < transposed_rows(HD)) break;
            for (int64_t x = 0; x < 16; ++x) prefetch_row(next, next_n, jj + x);
            for (int64_t kh = kh0; kh < kh1; ++kh) {
              transpose16<HD>(blk + jj * kv_row + kh * HD, kv_row, kt.data());
              int64_t count = 0;
              for (int64_t h = kh * group; h < (kh + 1) * group; ++h)
                for (int64_t i = i0; i < nq; ++i, ++count) {
                  q_rows[count] = qf.data() + row(h, i) * HD;
                  out_rows[count] = scores.data() + row(h, i) * ctx + j0 + jj;
                }
              dot16_transposed<HD>(q_rows.data(), out_rows.data(), count, kt.data());
            }
          }
          keys_by(std::integral_constant<int64_t, 16>{}, [](auto... a) { dot16<HD>(a...); });
        }
#endif
#ifdef PDSERVE_AVX2
        if constexpr (kVector)
          keys_by(std::integral_constant<int64_t, 8>{}, [](auto... a) { dot8<HD>(a...); });
#endif
        for (; jj < n; ++jj) {
          prefetch_row(next, next_n, jj);
          for (int64_t h = h0; h < h1; ++h) {
            const float* key = blk + jj * kv_row + (h / group) * head_dim;
            for (int64_t i = first_row(j0 + jj); i < nq; ++i) {
              const float* qr = qf.data() + row(h, i) * head_dim;
              float dot = 0.f;
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < head_dim; ++d) dot += qr[d] * key[d];
              scores[row(h, i) * ctx + j0 + jj] = dot;
            }
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {  // softmax over the keys the row sees (zero beyond, in its last block)
        float* row = scores.data() + r * ctx;
        const int64_t visible = ctx - nq + r % nq + 1;
        const int64_t read = std::min(ctx, (visible + block_size - 1) / block_size * block_size);
#if defined(PDSERVE_AVX512)
        softmax_row16(row, visible, read);
#elif defined(PDSERVE_AVX2)
        softmax_row8(row, visible, read);
#else
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t j = 0; j < visible; ++j) m = std::max(m, row[j]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < visible; ++j) {
          const float e = exp_nonpositive(row[j] - m);
          row[j] = e;
          sum += e;
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t j = 0; j < visible; ++j) row[j] *= inv;
        for (int64_t j = visible; j < read; ++j) row[j] = 0.f;
#endif
      }
      acc.assign(rows * head_dim, 0.f);
      bool values_done = false;
#ifdef PDSERVE_AVX512
      if constexpr (kWide) if (nq > kWholeQueries) {
        // A prefill chunk's item: out, row by row of each head in passes of up to six, a group of
        // blocks at a time (as many as keep one KV head's values within kGroupBytes, near L1):
        // first over the group's blocks that every row of the pass sees (a row's scores are
        // valid, zero past what it sees, up to the end of its last block), its accumulators held
        // in registers across them (`axpy_rows_blocks`); then the block or so that only the pass's
        // later rows see, for those rows. Each accumulator sums its keys in the order the loop
        // below does, so the output is the same to the bit. Block by block (that loop), every
        // block loaded and stored every pass's accumulators again. Decode and verification items
        // keep that loop: there a KV head's query heads share each block's value loads, where
        // this pass would run one head's row or few at a time. Scratch timings of the op, one
        // thread, AMD EPYC, 8 query heads of 32 on 4 KV heads: a 96-token chunk after 368 cached
        // keys 0.71 -> 0.50 ms, a 512-token prompt 2.85 -> 1.88 ms; at head_dim 128, 2.19 -> 2.00
        // and 10.2 -> 7.2 ms.
        const int64_t num_blocks = (ctx + block_size - 1) / block_size;
        const int64_t per_group = std::max<int64_t>(1, kGroupBytes / (block_size * HD * int64_t(sizeof(float))));
        const auto blocks_seen = [&](int64_t i) { return (ctx - nq + i + block_size) / block_size; };
        const auto keys_in = [&](int64_t b) { return std::min(block_size, ctx - b * block_size); };
        value_blocks.resize(num_blocks);
        for (int64_t kh = kh0; kh < kh1; ++kh) {
          for (int64_t b = 0; b < num_blocks; ++b) value_blocks[b] = rows_at(true, b * block_size) + kh * HD;
          for (int64_t g0 = 0; g0 < num_blocks; g0 += per_group) {
            const int64_t g1 = std::min(num_blocks, g0 + per_group);
            for (int64_t h = kh * group; h < (kh + 1) * group; ++h)
              even_passes<std::clamp(16 / (HD / 16), 1, 6)>(nq, [&](auto r, int64_t i) {
                constexpr int R = decltype(r)::value;
                const int64_t common = std::min(blocks_seen(i), g1), last = std::min(blocks_seen(i + R - 1), g1);
                if (common > g0)
                  axpy_rows_blocks<R, HD>(scores.data() + row(h, i) * ctx + g0 * block_size, ctx,
                                          value_blocks.data() + g0, common - g0, block_size, keys_in(common - 1), kv_row,
                                          acc.data() + row(h, i) * HD);
                for (int64_t b = std::max(common, g0); b < last; ++b) {  // rows i2 .. i + R - 1 see block b too
                  int64_t i2 = i + 1;
                  while (blocks_seen(i2) <= b) ++i2;
                  axpy_row_run<HD>(scores.data() + row(h, i2) * ctx + b * block_size, ctx, value_blocks[b], kv_row,
                                   keys_in(b), acc.data() + row(h, i2) * HD, i + R - i2);
                }
              });
          }
        }
        values_done = true;
      }
#endif
      for (int64_t j0 = 0; j0 < ctx && !values_done; j0 += block_size) {  // out: every row's weights times the values
        const float* blk = rows_at(true, j0);
        const int64_t n = std::min(block_size, ctx - j0);
        const C* next = j0 + block_size < ctx ? raw_at(true, j0 + block_size) : nullptr;
        const int64_t next_n = next ? std::min(block_size, ctx - j0 - block_size) : 0;
        const int64_t i0 = first_row(j0);  // rows before it see none of this block
#ifdef PDSERVE_AVX512
        if constexpr (kWide) {  // the rows of one KV head (contiguous: row = (h - h0) * nq + i), a run at a time
          for (int64_t jj = 0; jj < n; ++jj) prefetch_row(next, next_n, jj);
          const int64_t per_kv = group * nq;
          if (i0 > 0) {  // some rows see none of it: each head's rows that do
            for (int64_t h = h0; h < h1; ++h) {
              const int64_t r = row(h, i0);
              axpy_row_run<HD>(scores.data() + r * ctx + j0, ctx, blk + (h / group) * HD, kv_row, n, acc.data() + r * HD,
                               nq - i0);
            }
            continue;
          }
          for (int64_t kh = kh0; kh < kh1; ++kh) {
            const int64_t r = (kh - kh0) * per_kv;
            axpy_row_run<HD>(scores.data() + r * ctx + j0, ctx, blk + kh * HD, kv_row, n, acc.data() + r * HD, per_kv);
          }
          continue;
        }
#endif
#ifdef PDSERVE_AVX2
        if constexpr (kVector) {  // a block's values into each row's accumulator, held in registers
          for (int64_t jj = 0; jj < n; ++jj) prefetch_row(next, next_n, jj);
          for (int64_t h = h0; h < h1; ++h)
            for (int64_t i = i0; i < nq; ++i)
              axpy_row<Lanes8, HD>(scores.data() + row(h, i) * ctx + j0, blk + (h / group) * HD, kv_row, n,
                            acc.data() + row(h, i) * HD);
          continue;
        }
#endif
        for (int64_t jj = 0; jj < n; ++jj) {
          prefetch_row(next, next_n, jj);
          for (int64_t h = h0; h < h1; ++h) {
            const float* val = blk + jj * kv_row + (h / group) * head_dim;
            for (int64_t i = i0; i < nq; ++i) {
              const float w = scores[row(h, i) * ctx + j0 + jj];
              float* a = acc.data() + row(h, i) * head_dim;
#pragma omp simd
              for (int64_t d = 0; d < head_dim; ++d) a[d] += w * val[d];
            }
          }
        }
      }
      for (int64_t h = h0; h < h1; ++h)
        for (int64_t i = 0; i < nq; ++i) {
          T* dst = op + (first + i) * num_heads * head_dim + h * head_dim;
          const float* a = acc.data() + row(h, i) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(a[d]);
        }
    }
    for (std::vector<float>* buffer : {&qf, &scores, &acc, &kv})  // a long prompt's are let go
      if (buffer->capacity() > kKeptFloats) std::vector<float>().swap(*buffer);
  });
}

template <typename T, typename C>
void write_and_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                      at::Tensor& v_cache, const int64_t* slots, const at::Tensor& block_ids, const int64_t* context_lens,
                      const int64_t* query_starts, int64_t num_seqs, double scale, at::Tensor& out) {
  write_rows<T, C>(k, k_cache, slots, q.size(0));
  write_rows<T, C>(v, v_cache, slots, q.size(0));
  switch (q.size(2)) {
    case 32: return attend<T, C, 32>(q, k_cache, v_cache, block_ids, context_lens, query_starts, num_seqs, scale, out);
    case 64: return attend<T, C, 64>(q, k_cache, v_cache, block_ids, context_lens, query_starts, num_seqs, scale, out);
    case 128: return attend<T, C, 128>(q, k_cache, v_cache, block_ids, context_lens, query_starts, num_seqs, scale, out);
    default: return attend<T, C, 0>(q, k_cache, v_cache, block_ids, context_lens, query_starts, num_seqs, scale, out);
  }
}

at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                               at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_ids,
                               const at::Tensor& context_lens, const at::Tensor& query_starts, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "paged_attention_cpu: q/k/v are [tokens, heads, head_dim], the caches [blocks, block_size, heads, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention_cpu: the caches must be contiguous");
  // q, k and v share a dtype, the caches theirs or (under float32 rows) a 16-bit one
  const auto rows_type = q.scalar_type(), cache_type = k_cache.scalar_type();
  TORCH_CHECK(k.scalar_type() == rows_type && v.scalar_type() == rows_type && v_cache.scalar_type() == cache_type &&
                  (cache_type == rows_type ||
                   (rows_type == at::kFloat && (cache_type == at::kBFloat16 || cache_type == at::kHalf))),
              "paged_attention_cpu: q, k and v must share a dtype, and the caches theirs or, under float32, "
              "bfloat16 or float16; got ", rows_type, " rows and ", cache_type, " caches");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "paged_attention_cpu: the K and V caches differ in shape");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0 && k.size(1) == k_cache.size(2) &&
                  k.size(2) == k_cache.size(3) && v.size(1) == k_cache.size(2) && v.size(2) == k_cache.size(3),
              "paged_attention_cpu: head_dim or head counts do not match the cache");
  TORCH_CHECK(block_ids.dim() == 2 && context_lens.dim() == 1 && query_starts.dim() == 1 && slot_mapping.dim() == 1,
              "paged_attention_cpu: block_ids is [seqs, blocks]; slot_mapping, context_lens and query_starts are 1-D");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && block_ids.scalar_type() == at::kLong &&
                  context_lens.scalar_type() == at::kLong && query_starts.scalar_type() == at::kLong,
              "paged_attention_cpu: indices are int64");
  const int64_t num_tokens = q.size(0), num_seqs = context_lens.size(0);
  TORCH_CHECK(slot_mapping.size(0) == num_tokens && k.size(0) == num_tokens && v.size(0) == num_tokens &&
                  query_starts.size(0) == num_seqs + 1 && block_ids.size(0) == num_seqs,
              "paged_attention_cpu: sizes of the step's tensors disagree");
  auto rows_contiguous = [](const at::Tensor& t) {  // a token stride is fine; heads and dims packed
    return t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
  };
  const at::Tensor qc = rows_contiguous(q), kc = rows_contiguous(k), vc = rows_contiguous(v);
  const at::Tensor slots = slot_mapping.contiguous(), lens = context_lens.contiguous(),
                   starts = query_starts.contiguous();
  const at::Tensor ids = block_ids.stride(1) == 1 ? block_ids : block_ids.contiguous();
  TORCH_CHECK(starts.data_ptr<int64_t>()[0] == 0 && starts.data_ptr<int64_t>()[num_seqs] == num_tokens,
              "paged_attention_cpu: query_starts must run from 0 to the token count");
  at::Tensor out = at::empty({num_tokens, q.size(1), q.size(2)}, q.options());
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t *lp = lens.data_ptr<int64_t>(), *qsp = starts.data_ptr<int64_t>();
  if (rows_type == at::kFloat && cache_type == at::kBFloat16)
    write_and_attend<float, c10::BFloat16>(qc, kc, vc, k_cache, v_cache, sp, ids, lp, qsp, num_seqs, scale, out);
  else if (rows_type == at::kFloat && cache_type == at::kHalf)
    write_and_attend<float, c10::Half>(qc, kc, vc, k_cache, v_cache, sp, ids, lp, qsp, num_seqs, scale, out);
  else
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, rows_type, "paged_attention_cpu", [&] {
      write_and_attend<scalar_t, scalar_t>(qc, kc, vc, k_cache, v_cache, sp, ids, lp, qsp, num_seqs, scale, out);
    });
  return out;
}

}  // namespace

at::Tensor pdserve_native::paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping,
                                           const at::Tensor& block_ids, const at::Tensor& context_lens,
                                           const at::Tensor& query_starts, double scale) {
  return ::paged_attention_cpu(q, k, v, k_cache, v_cache, slot_mapping, block_ids, context_lens, query_starts, scale);
}

// The op's namespace: `pdserve`, except in a test that builds the file again for a narrower
// instruction set beside the loaded library (tests/kernels/test_native_attention.py).
#ifndef PDSERVE_OP_NAMESPACE
#define PDSERVE_OP_NAMESPACE pdserve
#endif

TORCH_LIBRARY_FRAGMENT(PDSERVE_OP_NAMESPACE, m) {
  m.def("paged_attention_cpu(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, Tensor block_ids, Tensor context_lens, Tensor query_starts, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(PDSERVE_OP_NAMESPACE, CPU, m) { m.impl("paged_attention_cpu", &paged_attention_cpu); }
