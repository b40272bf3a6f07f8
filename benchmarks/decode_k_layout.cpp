// The key pass of a decode step's attention (every query row's scores against its sequence's
// keys), timed over K blocks in two layouts; driven by benchmarks/decode_k_layout.py, which
// compiles it against the production vector code (kernels/cpu/attention_vectors.h).
//
//   decode_k_layout HEAD_DIM KV_HEADS GROUP SEQS CONTEXT LAYERS ORDER REPEATS
//
// Variants (each a function of the same blocks' bytes, the same query rows, the same scores out):
//   row-major    blocks [16 keys][KV heads][head_dim], as the KV cache holds them today: each query
//                row's sixteen scores a block by `dot16` (multiply-adds, then a horizontal sum of
//                sixteen vectors), as paged_attention.cpp's decode items take them;
//   transposed   the same blocks, each head's sixteen keys transposed first (`transpose16`) and
//                scored by vertical multiply-adds (`dot16_transposed_rows`), as its prefill items
//                take them where a head has at least kTransposedRows rows;
//   dims-major   blocks [KV heads][head_dim][16 keys]: the vertical multiply-adds straight from
//                the block, no horizontal sums and no transposition.
// ORDER: "in-order" (a sequence's blocks one after another in memory, as a fresh cache hands them
// out) or "scattered" (every block anywhere, as after churn). Before each timed pass a 64 MiB
// sweep evicts the caches. Prints one JSON object a line: each repeat's seconds per variant (the
// variants in a rotating order), then the largest difference of each variant's scores from
// row-major's.
#include "attention_vectors.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr int kBlock = 16;

struct Case {
  int kv, group, seqs, context, layers;
  bool scattered;
  int blocks_per_seq() const { return context / kBlock; }
  size_t num_blocks() const { return size_t(layers) * seqs * blocks_per_seq(); }
};

template <int HD>
struct Run {
  const Case& c;
  std::vector<float> row_major, dims_major, q, scores, kt;
  std::vector<size_t> block_of;  // (layer, seq, block) -> block index in the cache
  std::vector<const float*> q_rows;
  std::vector<float*> out_rows;

  explicit Run(const Case& c_) : c(c_) {
    const size_t block_floats = size_t(kBlock) * c.kv * HD;
    row_major.resize(c.num_blocks() * block_floats);
    dims_major.resize(row_major.size());
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (float& x : row_major) x = u(rng);
    for (size_t b = 0; b < c.num_blocks(); ++b)  // the same values, dims-major
      for (int j = 0; j < kBlock; ++j)
        for (int h = 0; h < c.kv; ++h)
          for (int d = 0; d < HD; ++d)
            dims_major[b * block_floats + (size_t(h) * HD + d) * kBlock + j] =
                row_major[b * block_floats + (size_t(j) * c.kv + h) * HD + d];
    block_of.resize(c.num_blocks());
    for (size_t i = 0; i < block_of.size(); ++i) block_of[i] = i;
    if (c.scattered) std::shuffle(block_of.begin(), block_of.end(), rng);
    q.resize(size_t(c.seqs) * c.kv * c.group * HD);
    for (float& x : q) x = u(rng);
    scores.resize(size_t(c.seqs) * c.kv * c.group * c.context);
    kt.resize(size_t(HD) * kBlock);
    q_rows.resize(c.group);
    out_rows.resize(c.group);
  }

  const float* q_row(int s, int h, int r) const { return q.data() + ((size_t(s) * c.kv + h) * c.group + r) * HD; }
  float* score_row(int s, int h, int r) { return scores.data() + ((size_t(s) * c.kv + h) * c.group + r) * c.context; }

  template <int R>
  void vertical(const float* keys_t, int s, int h, int b) {
    for (int r = 0; r < R; ++r) {
      q_rows[r] = q_row(s, h, r);
      out_rows[r] = score_row(s, h, r) + b * kBlock;
    }
    dot16_transposed_rows<R, HD>(q_rows.data(), out_rows.data(), keys_t);
  }

  void vertical_rows(const float* keys_t, int s, int h, int b) {
    switch (c.group) {
      case 1: return vertical<1>(keys_t, s, h, b);
      case 2: return vertical<2>(keys_t, s, h, b);
      case 4: return vertical<4>(keys_t, s, h, b);
      default: return vertical<6>(keys_t, s, h, b);  // main() accepts 1, 2, 4 and 6
    }
  }

  // variant: 0 row-major, 1 transposed, 2 dims-major
  void pass(int variant) {
    const size_t block_floats = size_t(kBlock) * c.kv * HD;
    for (int l = 0; l < c.layers; ++l)
      for (int s = 0; s < c.seqs; ++s)
        for (int b = 0; b < c.blocks_per_seq(); ++b) {
          const size_t at = block_of[(size_t(l) * c.seqs + s) * c.blocks_per_seq() + b] * block_floats;
          for (int h = 0; h < c.kv; ++h) {
            if (variant == 0) {
              for (int r = 0; r < c.group; ++r)
                dot16<HD>(q_row(s, h, r), row_major.data() + at + size_t(h) * HD, c.kv * HD,
                          score_row(s, h, r) + b * kBlock);
            } else if (variant == 1) {
              transpose16<HD>(row_major.data() + at + size_t(h) * HD, c.kv * HD, kt.data());
              vertical_rows(kt.data(), s, h, b);
            } else {
              vertical_rows(dims_major.data() + at + size_t(h) * HD * kBlock, s, h, b);
            }
          }
        }
  }
};

const char* kNames[] = {"row-major", "transposed", "dims-major"};

template <int HD>
int measure(const Case& c, int repeats) {
  Run<HD> run(c);
  std::vector<float> sweep(size_t(64) << 18, 1.f);  // 64 MiB
  float sink = 0.f;
  std::vector<std::vector<float>> first(3);
  for (int rep = 0; rep < repeats; ++rep) {
    double seconds[3];
    for (int i = 0; i < 3; ++i) {
      const int v = (rep + i) % 3;
      for (size_t k = 0; k < sweep.size(); k += 16) sink += sweep[k];
      const auto t = std::chrono::steady_clock::now();
      run.pass(v);
      seconds[v] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
      if (rep == 0) first[v] = run.scores;
    }
    std::printf("{\"repeat\": %d, \"seconds\": {\"%s\": %.9f, \"%s\": %.9f, \"%s\": %.9f}}\n", rep, kNames[0],
                seconds[0], kNames[1], seconds[1], kNames[2], seconds[2]);
  }
  double diff[3] = {0, 0, 0};
  for (int v = 1; v < 3; ++v)
    for (size_t i = 0; i < first[0].size(); ++i) diff[v] = std::max(diff[v], double(std::abs(first[v][i] - first[0][i])));
  std::printf("{\"max_abs_diff\": {\"%s\": %.3g, \"%s\": %.3g}, \"sink\": %g}\n", kNames[1], diff[1], kNames[2], diff[2],
              double(sink) * 1e-30);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
#ifndef PDSERVE_AVX512
  std::fprintf(stderr, "decode_k_layout: needs AVX-512 (the production row-major path's dot16)\n");
  return 2;
#else
  if (argc != 9) {
    std::fprintf(stderr, "usage: decode_k_layout HEAD_DIM KV_HEADS GROUP SEQS CONTEXT LAYERS ORDER REPEATS\n");
    return 2;
  }
  const int head_dim = std::atoi(argv[1]);
  Case c{std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]), std::atoi(argv[5]), std::atoi(argv[6]),
         std::string(argv[7]) == "scattered"};
  const int repeats = std::atoi(argv[8]);
  const bool group_ok = c.group == 1 || c.group == 2 || c.group == 4 || c.group == 6;
  if (c.kv < 1 || !group_ok || c.seqs < 1 || c.context < kBlock || c.context % kBlock || c.layers < 1 || repeats < 1) {
    std::fprintf(stderr, "decode_k_layout: bad case (group 1, 2, 4 or 6; context a multiple of %d)\n", kBlock);
    return 2;
  }
  switch (head_dim) {
    case 32: return measure<32>(c, repeats);
    case 64: return measure<64>(c, repeats);
    case 128: return measure<128>(c, repeats);
    default: std::fprintf(stderr, "decode_k_layout: head_dim 32, 64 or 128\n"); return 2;
  }
#endif
}
