// pdserve::copy_rows_crc32c, rows_crc32c and crc32c: the KV transfer's bulk copies with the
// CRC-32C of the bytes computed in the same pass over them, and its checksums alone.
//
// The copy-and-checksum loops (and how they reach memory speed) are in crc32c.h; this file
// checks the ops' arguments, walks the rows and registers the ops.
//
// Tensor and the few ops used, not <ATen/ATen.h>: every op's header took a third to half the compile.
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>

#include "crc32c.h"

namespace {

using pdserve_crc::checksum;
using pdserve_crc::copy_checksum;

int64_t row_bytes(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be on the CPU");
  TORCH_CHECK(t.dim() >= 1, what, " must have a row dimension");
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous");
  return t.size(0) ? static_cast<int64_t>(t.nbytes()) / t.size(0) : 0;
}

at::Tensor index_rows(const at::Tensor& t, int64_t width, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kLong, what, " must be int64");
  TORCH_CHECK(t.dim() == 2 && t.size(1) == width, what, " must have shape [n, ", width, "]");
  return t.contiguous();
}

uint32_t initial(int64_t crc) {
  TORCH_CHECK(crc >= 0 && crc <= 0xFFFFFFFFLL, "crc must be a 32-bit unsigned value, got ", crc);
  return ~static_cast<uint32_t>(crc);
}

// K rows then V rows of `pieces` ([n, 3]: source row, destination row, rows) copied from src to
// dst; returns the CRC-32C of the copied bytes, in that order, continuing from `crc`. Every piece
// is checked against both sides before a byte moves.
int64_t copy_rows_crc32c(const at::Tensor& src_k, const at::Tensor& src_v, at::Tensor& dst_k, at::Tensor& dst_v,
                         const at::Tensor& pieces, int64_t crc) {
  const int64_t row = row_bytes(src_k, "src_k");
  TORCH_CHECK(row_bytes(src_v, "src_v") == row && row_bytes(dst_k, "dst_k") == row &&
                  row_bytes(dst_v, "dst_v") == row,
              "copy_rows_crc32c: rows of ", row, " bytes in src_k, but src_v, dst_k and dst_v have ",
              row_bytes(src_v, "src_v"), ", ", row_bytes(dst_k, "dst_k"), " and ", row_bytes(dst_v, "dst_v"));
  TORCH_CHECK(src_k.size(0) == src_v.size(0) && dst_k.size(0) == dst_v.size(0),
              "copy_rows_crc32c: K and V must have the same number of rows on each side");
  const at::Tensor p = index_rows(pieces, 3, "pieces");
  const int64_t* q = p.data_ptr<int64_t>();
  const int64_t src_rows = src_k.size(0), dst_rows = dst_k.size(0);
  for (int64_t i = 0; i < p.size(0); ++i) {
    const int64_t s = q[3 * i], d = q[3 * i + 1], n = q[3 * i + 2];
    TORCH_CHECK(n >= 0 && s >= 0 && d >= 0 && s <= src_rows - n && d <= dst_rows - n, "copy_rows_crc32c: piece ", i,
                " (source row ", s, ", destination row ", d, ", ", n, " rows) is outside the ", src_rows,
                " source and ", dst_rows, " destination rows");
  }
  uint32_t c = initial(crc);
  for (const auto& [src, dst] : {std::pair{&src_k, &dst_k}, std::pair{&src_v, &dst_v}}) {
    const auto* from = static_cast<const uint8_t*>(src->data_ptr());
    auto* to = static_cast<uint8_t*>(dst->data_ptr());
    for (int64_t i = 0; i < p.size(0); ++i)
      c = copy_checksum(from + q[3 * i] * row, to + q[3 * i + 1] * row, q[3 * i + 2] * row, c);
  }
  return ~c;
}

// The CRC-32C of K rows then V rows of `runs` ([n, 2]: first row, rows), continuing from `crc`.
int64_t rows_crc32c(const at::Tensor& k, const at::Tensor& v, const at::Tensor& runs, int64_t crc) {
  const int64_t row = row_bytes(k, "k");
  TORCH_CHECK(row_bytes(v, "v") == row && k.size(0) == v.size(0), "rows_crc32c: k and v must have the same shape");
  const at::Tensor r = index_rows(runs, 2, "runs");
  const int64_t* q = r.data_ptr<int64_t>();
  for (int64_t i = 0; i < r.size(0); ++i)
    TORCH_CHECK(q[2 * i + 1] >= 0 && q[2 * i] >= 0 && q[2 * i] <= k.size(0) - q[2 * i + 1], "rows_crc32c: run ", i,
                " (row ", q[2 * i], ", ", q[2 * i + 1], " rows) is outside the ", k.size(0), " rows");
  uint32_t c = initial(crc);
  for (const at::Tensor* t : {&k, &v}) {
    const auto* base = static_cast<const uint8_t*>(t->data_ptr());
    for (int64_t i = 0; i < r.size(0); ++i) c = checksum(base + q[2 * i] * row, q[2 * i + 1] * row, c);
  }
  return ~c;
}

// The CRC-32C of all of a contiguous tensor's bytes, continuing from `crc`.
int64_t crc32c(const at::Tensor& data, int64_t crc) {
  TORCH_CHECK(data.device().is_cpu() && data.is_contiguous(), "crc32c: data must be a contiguous CPU tensor");
  return ~checksum(static_cast<const uint8_t*>(data.data_ptr()), data.nbytes(), initial(crc));
}

}  // namespace

#ifndef PDSERVE_OP_NAMESPACE
#define PDSERVE_OP_NAMESPACE pdserve
#endif

TORCH_LIBRARY_FRAGMENT(PDSERVE_OP_NAMESPACE, m) {
  m.def("copy_rows_crc32c(Tensor src_k, Tensor src_v, Tensor(a!) dst_k, Tensor(b!) dst_v, Tensor pieces, "
        "int crc) -> int");
  m.def("rows_crc32c(Tensor k, Tensor v, Tensor runs, int crc) -> int");
  m.def("crc32c(Tensor data, int crc) -> int");
}

TORCH_LIBRARY_IMPL(PDSERVE_OP_NAMESPACE, CPU, m) {
  m.impl("copy_rows_crc32c", &copy_rows_crc32c);
  m.impl("rows_crc32c", &rows_crc32c);
  m.impl("crc32c", &crc32c);
}
